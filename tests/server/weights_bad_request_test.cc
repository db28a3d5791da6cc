// Malformed MultiHeadAttention and PutWeights requests: each gets the right
// code and a message naming the field, and the server goes on serving.
#include <functional>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/core/attention_engine.h"
#include "attnserve/server/attention/request_validator.h"
#include "attnserve/server/weights/weights_loader.h"
#include "attnserve/server/weights/weights_registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"
#include "server/server_fixture.h"
#include "server/weights_helpers.h"

namespace attnserve {
namespace {

using ::attnserve::testing::kTimeout;
using ::attnserve::testing::MakeRequest;
using ::attnserve::testing::MakeWeights;
using ::attnserve::testing::NamesOf;
using ::attnserve::testing::PutRequest;
using ::attnserve::testing::RandomTensor;
using ::attnserve::testing::ReferenceMhaShape;
using ::attnserve::testing::ServerFixture;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Gives `tensor` a new shape with a matching FLOAT32 byte count.
void Reshape(const std::vector<int64_t>& shape, v1::Tensor* tensor) {
  *tensor = RandomTensor(v1::FLOAT32, shape, 7, 1.0f);
}

// B = 2, Lq = 3, Lk = 5, E = 8, Ekv = 6, H = 4, Hkv = 2, Dk = 2, Dv = 3: w_q
// [8, 8], w_k [4, 6], w_v [6, 6], w_o [8, 12], b_q [8], b_k [4], b_v [6], b_o
// [8].
constexpr ReferenceMhaShape kValidShape{2, 3, 5, 8, 6, 4, 2, 2, 3};

v1::ProjectionWeights ValidWeights() { return MakeWeights(kValidShape, 77); }

v1::MultiHeadAttentionRequest ValidMhaRequest() {
  v1::MultiHeadAttentionRequest request =
      MakeRequest(kValidShape, 88, /*cross=*/true);
  *request.mutable_weights() = ValidWeights();
  return request;
}

struct BadMhaCase {
  const char* name;
  std::function<void(v1::MultiHeadAttentionRequest&)> mutate;
  absl::StatusCode code;
  std::vector<std::string> message_parts;
};

void PrintTo(const BadMhaCase& test_case, std::ostream* os) {
  *os << test_case.name;
}

using Mha = v1::MultiHeadAttentionRequest;
constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

const std::vector<BadMhaCase>& BadMhaCases() {
  static const auto* cases = new std::vector<BadMhaCase>{
      {"NoWeightsSource",
       [](Mha& r) { r.clear_weights(); },
       kInvalid,
       {"weights and weights_name are both missing"}},
      {"WeightsNameWithSpace",
       [](Mha& r) { r.set_weights_name("my weights"); },
       kInvalid,
       {"weights_name is \"my weights\"", "[A-Za-z0-9._-]"}},
      {"EmptyWeightsName",
       [](Mha& r) { r.set_weights_name(""); },
       kInvalid,
       {"weights_name is \"\"", "expected 1 to 128 characters"}},
      {"WeightsNameTooLong",
       [](Mha& r) { r.set_weights_name(std::string(129, 'a')); },
       kInvalid,
       {"weights_name is \"aaaa", "expected 1 to 128 characters"}},
      {"UnknownWeightsName",
       [](Mha& r) { r.set_weights_name("no-such-set"); },
       absl::StatusCode::kNotFound,
       {"weights_name 'no-such-set' is not registered"}},
      {"RopeOddRotaryDim",
       [](Mha& r) { r.mutable_weights()->mutable_rope()->set_rotary_dim(1); },
       kInvalid,
       {"weights.rope.rotary_dim is 1, expected 0 (the whole head) or an even "
        "number from 2 to the head dim 2"}},
      {"RopeThetaBelowOne",
       [](Mha& r) { r.mutable_weights()->mutable_rope()->set_theta(0.5f); },
       kInvalid,
       {"weights.rope.theta is 0.5, expected a finite number > 1"}},
      {"PositionsWithoutRope",
       [](Mha& r) {
         for (int i = 0; i < 6; ++i)
           r.mutable_options()->add_query_positions(i);
       },
       kInvalid,
       {"options.query_positions and key_positions are given without RoPE"}},
      {"PackedSequencesOnMha",
       [](Mha& r) {
         for (int64_t x : {0, 3, 6}) {
           r.mutable_options()->add_cu_seqlens_q(x);
           r.mutable_options()->add_cu_seqlens_k(x);
         }
       },
       kInvalid,
       {"options.cu_seqlens_q and cu_seqlens_k (packed sequences) are for "
        "Attend, expected none on MultiHeadAttention"}},
      {"QueryPositionsNotBTimesLq",
       [](Mha& r) {
         r.mutable_weights()->mutable_rope();
         for (int i = 0; i < 5; ++i)
           r.mutable_options()->add_query_positions(i);
       },
       kInvalid,
       {"options.query_positions size is 5, expected 6 (B x L"}},
      {"NegativeKeyPosition",
       [](Mha& r) {
         r.mutable_weights()->mutable_rope();
         for (int i = 0; i < 10; ++i) {
           r.mutable_options()->add_key_positions(i == 3 ? -1 : i);
         }
       },
       kInvalid,
       {"options.key_positions[3] is -1, expected 0 to 2147483647"}},
      {"ZeroHeads",
       [](Mha& r) { r.mutable_weights()->set_num_heads(0); },
       kInvalid,
       {"weights.num_heads is 0, expected > 0"}},
      {"NegativeHeads",
       [](Mha& r) { r.mutable_weights()->set_num_heads(-4); },
       kInvalid,
       {"weights.num_heads is -4, expected > 0"}},
      {"KvHeadsNotDividingHeads",
       [](Mha& r) { r.mutable_weights()->set_num_kv_heads(3); },
       kInvalid,
       {"weights.num_kv_heads is 3, expected 0 (= num_heads) or a divisor of "
        "4 (weights.num_heads)"}},
      {"KvHeadsAboveHeads",
       [](Mha& r) { r.mutable_weights()->set_num_kv_heads(8); },
       kInvalid,
       {"weights.num_kv_heads is 8"}},
      {"QueryRowsNotMultipleOfHeads",
       [](Mha& r) {
         Reshape({9, 8}, r.mutable_weights()->mutable_w_q());
       },
       kInvalid,
       {"weights.w_q.shape[0]",
        "is 9, expected a multiple of 4 (weights.num_heads)"}},
      {"HeadsBeyondQueryRows",
       [](Mha& r) {
         r.mutable_weights()->set_num_heads(int64_t{1} << 40);
         r.mutable_weights()->set_num_kv_heads(1);
       },
       kInvalid,
       {"weights.num_heads is 1099511627776, expected a divisor of 8 "
        "(weights.w_q.shape[0] (H·Dk))"}},
      {"KeyRowsInconsistentWithQuery",
       [](Mha& r) {
         Reshape({6, 6}, r.mutable_weights()->mutable_w_k());
       },
       kInvalid,
       {"weights.w_k.shape[0]", "is 6, expected 4 (weights.num_kv_heads"}},
      {"ValueEmbedDimDiffersFromKey",
       [](Mha& r) {
         Reshape({6, 5}, r.mutable_weights()->mutable_w_v());
       },
       kInvalid,
       {"weights.w_v.shape[1] (Ekv) is 5, expected 6 (weights.w_k.shape[1] "
        "(Ekv))"}},
      {"ValueRowsNotMultipleOfKvHeads",
       [](Mha& r) {
         Reshape({5, 6}, r.mutable_weights()->mutable_w_v());
       },
       kInvalid,
       {"weights.w_v.shape[0]",
        "is 5, expected a multiple of 2 (weights.num_kv_heads)"}},
      {"OutputProjectionRowsNotEmbedDim",
       [](Mha& r) {
         Reshape({7, 12}, r.mutable_weights()->mutable_w_o());
       },
       kInvalid,
       {"weights.w_o.shape[0] (E) is 7, expected 8 (weights.w_q.shape[1] "
        "(E))"}},
      {"OutputProjectionColumnsNotHeadsTimesDv",
       [](Mha& r) {
         Reshape({8, 10}, r.mutable_weights()->mutable_w_o());
       },
       kInvalid,
       {"weights.w_o.shape[1]", "is 10, expected 12"}},
      {"QueryBiasWrongLength",
       [](Mha& r) { Reshape({7}, r.mutable_weights()->mutable_b_q()); },
       kInvalid,
       {"weights.b_q.shape[0] (out) is 7, expected 8 (weights.w_q.shape[0])"}},
      {"OutputBiasRankTwo",
       [](Mha& r) {
         Reshape({1, 8}, r.mutable_weights()->mutable_b_o());
       },
       kInvalid,
       {"weights.b_o.shape is [1, 8] with 2 dimensions, expected 1"}},
      {"QueryProjectionMissing",
       [](Mha& r) { r.mutable_weights()->clear_w_q(); },
       kInvalid,
       {"weights.w_q is missing, expected a tensor of shape"}},
      {"KeyProjectionBoolDType",
       [](Mha& r) { r.mutable_weights()->mutable_w_k()->set_dtype(v1::BOOL); },
       kInvalid,
       {"weights.w_k.dtype is BOOL, expected FLOAT32 or BFLOAT16 or FLOAT16"}},
      {"ValueProjectionDataShort",
       [](Mha& r) {
         r.mutable_weights()->mutable_w_v()->mutable_data()->pop_back();
       },
       kInvalid,
       {"weights.w_v.data has 143 bytes, expected 144"}},
      {"QueryInputMissing",
       [](Mha& r) { r.clear_query_input(); },
       kInvalid,
       {"query_input is missing", "[B, Lq, E]"}},
      {"QueryInputRankTwo",
       [](Mha& r) {
         Reshape({6, 8}, r.mutable_query_input());
       },
       kInvalid,
       {"query_input.shape is [6, 8] with 2 dimensions, expected 3"}},
      {"QueryInputEmbedDimDiffersFromWeights",
       [](Mha& r) {
         Reshape({2, 3, 7}, r.mutable_query_input());
       },
       kInvalid,
       {"query_input.shape[2] (E) is 7, expected 8 (E of weights)"}},
      {"KvInputBatchDiffers",
       [](Mha& r) {
         Reshape({3, 5, 6}, r.mutable_kv_input());
       },
       kInvalid,
       {"kv_input.shape[0] (B) is 3, expected 2 (query_input.shape[0] (B))"}},
      {"KvInputEmbedDimDiffersFromWeights",
       [](Mha& r) {
         Reshape({2, 5, 8}, r.mutable_kv_input());
       },
       kInvalid,
       {"kv_input.shape[2] (Ekv) is 8, expected 6 (Ekv of weights)"}},
      {"KvInputRankFour",
       [](Mha& r) {
         Reshape({2, 5, 6, 1}, r.mutable_kv_input());
       },
       kInvalid,
       {"kv_input.shape is [2, 5, 6, 1] with 4 dimensions, expected 3"}},
      {"SelfAttentionWithCrossWeights",
       [](Mha& r) { r.clear_kv_input(); },
       kInvalid,
       {"kv_input is missing: weights project queries of E = 8 features and "
        "keys and values of Ekv = 6 (cross-attention), so they need one"}},
      {"RegisteredWeightsOfOtherEmbedDim",
       [](Mha& r) { r.set_weights_name("demo"); },
       kInvalid,
       {"query_input.shape[2] (E) is 8, expected 64 (E of weights 'demo')"}},
      {"NanScale",
       [](Mha& r) {
         r.mutable_options()->set_scale(
             std::numeric_limits<float>::quiet_NaN());
       },
       kInvalid,
       {"options.scale is nan, expected a finite number"}},
      {"UnknownReturnWeights",
       [](Mha& r) {
         r.mutable_options()->set_return_weights(
             static_cast<v1::AttentionOptions::ReturnWeights>(7));
       },
       kInvalid,
       {"options.return_weights is 7"}},
      {"ResponseOverMessageLimit",
       [](Mha& r) {
         // Weights [2, 4, 512, 512] f32: 8 MiB, over the 4 MiB limit.
         Reshape({2, 512, 8}, r.mutable_query_input());
         Reshape({2, 512, 6}, r.mutable_kv_input());
         r.mutable_options()->set_return_weights(
             v1::AttentionOptions::PER_HEAD);
       },
       absl::StatusCode::kResourceExhausted,
       {"max_message_bytes limit of 4194304"}},
  };
  return *cases;
}

class BadMultiHeadRequestTest
    : public ServerFixture,
      public ::testing::WithParamInterface<BadMhaCase> {};

TEST_P(BadMultiHeadRequestTest, GetsCodeNamingTheFieldAndServerKeepsServing) {
  const BadMhaCase& test_case = GetParam();
  v1::MultiHeadAttentionRequest request = ValidMhaRequest();
  test_case.mutate(request);
  const absl::Status status =
      client_->MultiHeadAttention(request, kTimeout).status();
  EXPECT_EQ(status.code(), test_case.code) << status;
  for (const std::string& part : test_case.message_parts) {
    EXPECT_THAT(std::string(status.message()), HasSubstr(part));
  }
  const absl::StatusOr<v1::MultiHeadAttentionResponse> valid =
      client_->MultiHeadAttention(ValidMhaRequest(), kTimeout);
  EXPECT_TRUE(valid.ok()) << valid.status();
}

INSTANTIATE_TEST_SUITE_P(Cases, BadMultiHeadRequestTest,
                         ::testing::ValuesIn(BadMhaCases()),
                         [](const ::testing::TestParamInfo<BadMhaCase>& param) {
                           return std::string(param.param.name);
                         });

// The same cases against the checks alone: every one is refused before
// anything is allocated or computed, not by the computation.
class BadMultiHeadValidationTest : public ::testing::TestWithParam<BadMhaCase> {
};

TEST_P(BadMultiHeadValidationTest, RefusedBeforeTheCompute) {
  const BadMhaCase& test_case = GetParam();
  v1::MultiHeadAttentionRequest request = ValidMhaRequest();
  test_case.mutate(request);
  EngineOptions engine_options;
  engine_options.max_workspace_bytes = 16 << 20;
  const absl::StatusOr<std::unique_ptr<AttentionEngine>> engine =
      AttentionEngine::Create(engine_options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  RequestChecks checks;
  checks.max_message_bytes = 4 << 20;
  checks.engine = engine->get();
  // The server's registry at start-up: the demo set.
  WeightsRegistry registry(int64_t{64} << 20);
  ASSERT_TRUE(PutWeightsInto(registry, DemoWeights()).ok());
  absl::Status status;
  const absl::StatusOr<MultiHeadWeights> weights =
      ResolveMultiHeadWeights(request, registry);
  if (!weights.ok()) {
    status = weights.status();
  } else {
    status = ValidateMultiHeadRequest(request, weights->shape, weights->origin,
                                      checks)
                 .status();
  }
  EXPECT_EQ(status.code(), test_case.code) << status;
  for (const std::string& part : test_case.message_parts) {
    EXPECT_THAT(std::string(status.message()), HasSubstr(part));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, BadMultiHeadValidationTest,
                         ::testing::ValuesIn(BadMhaCases()),
                         [](const ::testing::TestParamInfo<BadMhaCase>& param) {
                           return std::string(param.param.name);
                         });

struct BadPutCase {
  const char* name;
  std::function<void(v1::PutWeightsRequest&)> mutate;
  absl::StatusCode code;
  std::vector<std::string> message_parts;
};

void PrintTo(const BadPutCase& test_case, std::ostream* os) {
  *os << test_case.name;
}

using Put = v1::PutWeightsRequest;

const std::vector<BadPutCase>& BadPutCases() {
  static const auto* cases = new std::vector<BadPutCase>{
      {"EmptyName",
       [](Put& r) { r.set_name(""); },
       kInvalid,
       {"name is \"\", expected 1 to 128 characters of [A-Za-z0-9._-]"}},
      {"NameWithSlash",
       [](Put& r) { r.set_name("a/b"); },
       kInvalid,
       {"name is \"a/b\"", "[A-Za-z0-9._-]"}},
      {"NameTooLong",
       [](Put& r) { r.set_name(std::string(129, 'n')); },
       kInvalid,
       {"name is \"nnnn", "expected 1 to 128 characters"}},
      {"NoWeights",
       [](Put& r) { r.clear_weights(); },
       kInvalid,
       {"weights is missing, expected ProjectionWeights"}},
      {"ZeroHeads",
       [](Put& r) { r.mutable_weights()->set_num_heads(0); },
       kInvalid,
       {"weights.num_heads is 0, expected > 0"}},
      {"NegativeKvHeads",
       [](Put& r) { r.mutable_weights()->set_num_kv_heads(-2); },
       kInvalid,
       {"weights.num_kv_heads is -2"}},
      {"OutputProjectionMissing",
       [](Put& r) { r.mutable_weights()->clear_w_o(); },
       kInvalid,
       {"weights.w_o is missing"}},
      {"KeyProjectionZeroRows",
       [](Put& r) { r.mutable_weights()->mutable_w_k()->set_shape(0, 0); },
       kInvalid,
       {"weights.w_k.shape[0]", "is 0, expected > 0"}},
      {"ValueBiasWrongLength",
       [](Put& r) { Reshape({5}, r.mutable_weights()->mutable_b_v()); },
       kInvalid,
       {"weights.b_v.shape[0] (out) is 5, expected 6 "
        "(weights.w_v.shape[0])"}},
      {"KeyBiasUnspecifiedDType",
       [](Put& r) {
         r.mutable_weights()->mutable_b_k()->set_dtype(v1::DTYPE_UNSPECIFIED);
       },
       kInvalid,
       {"weights.b_k.dtype is DTYPE_UNSPECIFIED"}},
  };
  return *cases;
}

class BadPutWeightsTest : public ServerFixture,
                          public ::testing::WithParamInterface<BadPutCase> {};

TEST_P(BadPutWeightsTest, GetsCodeNamingTheFieldAndRegistersNothing) {
  const BadPutCase& test_case = GetParam();
  v1::PutWeightsRequest request = PutRequest("valid", ValidWeights());
  test_case.mutate(request);
  const absl::Status status = client_->PutWeights(request, kTimeout).status();
  EXPECT_EQ(status.code(), test_case.code) << status;
  for (const std::string& part : test_case.message_parts) {
    EXPECT_THAT(std::string(status.message()), HasSubstr(part));
  }
  absl::StatusOr<v1::ListWeightsResponse> list = client_->ListWeights(kTimeout);
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_THAT(NamesOf(*list), ElementsAre("demo"));
  const absl::StatusOr<v1::MultiHeadAttentionResponse> valid =
      client_->MultiHeadAttention(ValidMhaRequest(), kTimeout);
  EXPECT_TRUE(valid.ok()) << valid.status();
}

INSTANTIATE_TEST_SUITE_P(Cases, BadPutWeightsTest,
                         ::testing::ValuesIn(BadPutCases()),
                         [](const ::testing::TestParamInfo<BadPutCase>& param) {
                           return std::string(param.param.name);
                         });

// A --weights_dir set's own version moves the registry's count, so that a
// later put of any name gets a higher one, never a version a set had: a
// weights_version pin names one set of weights.
TEST(WeightsRegistryVersionsTest, PutsNeverReuseAFoldersVersion) {
  WeightsRegistry registry(int64_t{64} << 20);
  v1::PutWeightsRequest folder = DemoWeights();
  folder.set_name("x");
  const absl::StatusOr<v1::PutWeightsResponse> at_three =
      PutWeightsInto(registry, folder, /*version=*/3);
  ASSERT_TRUE(at_three.ok()) << at_three.status();
  EXPECT_EQ(at_three->version(), 3);
  v1::PutWeightsRequest other = DemoWeights();
  other.set_name("y");
  const absl::StatusOr<v1::PutWeightsResponse> y =
      PutWeightsInto(registry, other);
  ASSERT_TRUE(y.ok());
  EXPECT_EQ(y->version(), 4);
  const absl::StatusOr<v1::PutWeightsResponse> x_again =
      PutWeightsInto(registry, folder);
  ASSERT_TRUE(x_again.ok());
  EXPECT_EQ(x_again->version(), 5);
}

}  // namespace
}  // namespace attnserve
