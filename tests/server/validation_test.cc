// Malformed and oversized requests: each gets the right code and a message
// naming the field, and the server goes on serving.
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"
#include "server/server_fixture.h"

namespace attnserve {
namespace {

using ::attnserve::testing::RandomValues;
using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(30);

// Gives `tensor` a new shape with a matching FLOAT32 byte count.
void Reshape(std::vector<int64_t> shape, v1::Tensor* tensor) {
  int64_t elements = 1;
  for (int64_t dim : shape) elements *= dim;
  *tensor = MakeFloat32Tensor(shape, RandomValues(elements, 7));
}

// query [2, 4, 5, 8], key [2, 2, 7, 8], value [2, 2, 7, 3].
v1::AttendRequest ValidRequest() {
  v1::AttendRequest request;
  Reshape({2, 4, 5, 8}, request.mutable_query());
  Reshape({2, 2, 7, 8}, request.mutable_key());
  Reshape({2, 2, 7, 3}, request.mutable_value());
  return request;
}

struct BadRequestCase {
  const char* name;
  std::function<void(v1::AttendRequest&)> mutate;
  absl::StatusCode code;
  std::vector<std::string> message_parts;
};

void PrintTo(const BadRequestCase& test_case, std::ostream* os) {
  *os << test_case.name;
}

const std::vector<BadRequestCase>& BadRequestCases() {
  static const auto* cases = new std::vector<BadRequestCase>{
      {"MissingQuery",
       [](v1::AttendRequest& r) { r.clear_query(); },
       absl::StatusCode::kInvalidArgument,
       {"query is missing", "[B, H, Lq, Dk]"}},
      {"MissingValue",
       [](v1::AttendRequest& r) { r.clear_value(); },
       absl::StatusCode::kInvalidArgument,
       {"value is missing", "[B, Hkv, Lk, Dv]"}},
      {"UnspecifiedDType",
       [](v1::AttendRequest& r) {
         r.mutable_query()->set_dtype(v1::DTYPE_UNSPECIFIED);
       },
       absl::StatusCode::kInvalidArgument,
       {"query.dtype is DTYPE_UNSPECIFIED, expected FLOAT32"}},
      {"MaskDTypeAsValues",
       [](v1::AttendRequest& r) { r.mutable_key()->set_dtype(v1::BOOL); },
       absl::StatusCode::kInvalidArgument,
       {"key.dtype is BOOL, expected FLOAT32 or BFLOAT16 or FLOAT16"}},
      {"DTypeBytesMismatch",
       [](v1::AttendRequest& r) { r.mutable_key()->set_dtype(v1::BFLOAT16); },
       absl::StatusCode::kInvalidArgument,
       {"key.data has 896 bytes, expected 448", "BFLOAT16"}},
      {"UnknownDType",
       [](v1::AttendRequest& r) {
         r.mutable_value()->set_dtype(static_cast<v1::DType>(42));
       },
       absl::StatusCode::kInvalidArgument,
       {"value.dtype is 42 (not a DType)"}},
      {"RankThree",
       [](v1::AttendRequest& r) {
         Reshape({2, 4, 40}, r.mutable_query());
       },
       absl::StatusCode::kInvalidArgument,
       {"query.shape is [2, 4, 40] with 3 dimensions, expected 4"}},
      {"RankFive",
       [](v1::AttendRequest& r) {
         Reshape({2, 2, 7, 8, 1}, r.mutable_key());
       },
       absl::StatusCode::kInvalidArgument,
       {"key.shape", "5 dimensions, expected 4"}},
      {"AMillionDimensions",
       [](v1::AttendRequest& r) {
         r.mutable_query()->mutable_shape()->Resize(1'000'000, 1);
       },
       absl::StatusCode::kInvalidArgument,
       {"query.shape is [2, 4, 5, 8, 1, 1, 1, 1, … 1000000 dimensions] with "
        "1000000 dimensions, expected 4"}},
      {"ZeroDimension",
       [](v1::AttendRequest& r) { r.mutable_query()->set_shape(2, 0); },
       absl::StatusCode::kInvalidArgument,
       {"query.shape[2] (Lq) is 0, expected > 0"}},
      {"NegativeDimension",
       [](v1::AttendRequest& r) { r.mutable_value()->set_shape(3, -3); },
       absl::StatusCode::kInvalidArgument,
       {"value.shape[3] (Dv) is -3, expected > 0"}},
      // Claims a billion keys without sending them: refused on the byte count,
      // before anything is allocated for that many keys.
      {"HugeClaimedKeyLength",
       [](v1::AttendRequest& r) {
         r.mutable_key()->set_shape(2, 1000000000);
         r.mutable_value()->set_shape(2, 1000000000);
       },
       absl::StatusCode::kInvalidArgument,
       {"key.data has 896 bytes, expected 128000000000"}},
      {"OverflowingShape",
       [](v1::AttendRequest& r) {
         for (int dim = 0; dim < 3; ++dim)
           r.mutable_query()->set_shape(dim, int64_t{1} << 31);
       },
       absl::StatusCode::kInvalidArgument,
       {"query.shape is [2147483648", "data would pass 2^63 bytes"}},
      {"DataOneByteShort",
       [](v1::AttendRequest& r) {
         r.mutable_query()->mutable_data()->pop_back();
       },
       absl::StatusCode::kInvalidArgument,
       {"query.data has 1279 bytes, expected 1280"}},
      {"DataTooLong",
       [](v1::AttendRequest& r) {
         r.mutable_key()->mutable_data()->append(4, 0);
       },
       absl::StatusCode::kInvalidArgument,
       {"key.data has 900 bytes, expected 896"}},
      {"BatchMismatch",
       [](v1::AttendRequest& r) {
         Reshape({3, 2, 7, 8}, r.mutable_key());
       },
       absl::StatusCode::kInvalidArgument,
       {"key.shape[0] (B) is 3, expected 2 (query.shape[0]"}},
      {"KeyDimMismatch",
       [](v1::AttendRequest& r) {
         Reshape({2, 2, 7, 16}, r.mutable_key());
       },
       absl::StatusCode::kInvalidArgument,
       {"key.shape[3] (Dk) is 16, expected 8 (query.shape[3] (Dk))"}},
      {"ValueHeadsMismatch",
       [](v1::AttendRequest& r) {
         Reshape({2, 1, 7, 3}, r.mutable_value());
       },
       absl::StatusCode::kInvalidArgument,
       {"value.shape[1] (Hkv) is 1, expected 2"}},
      {"ValueLengthMismatch",
       [](v1::AttendRequest& r) {
         Reshape({2, 2, 6, 3}, r.mutable_value());
       },
       absl::StatusCode::kInvalidArgument,
       {"value.shape[2] (Lk) is 6, expected 7 (key.shape[2] (Lk))"}},
      {"HeadsNotMultipleOfKvHeads",
       [](v1::AttendRequest& r) {
         Reshape({2, 3, 5, 8}, r.mutable_query());
       },
       absl::StatusCode::kInvalidArgument,
       {"query.shape[1] (H) is 3, expected a multiple of 2 (key.shape[1] "
        "(Hkv))"}},
      {"NanScale",
       [](v1::AttendRequest& r) {
         r.mutable_options()->set_scale(
             std::numeric_limits<float>::quiet_NaN());
       },
       absl::StatusCode::kInvalidArgument,
       {"options.scale is nan, expected a finite number"}},
      {"InfiniteScale",
       [](v1::AttendRequest& r) {
         r.mutable_options()->set_scale(
             -std::numeric_limits<float>::infinity());
       },
       absl::StatusCode::kInvalidArgument,
       {"options.scale is -inf"}},
      {"OutputOverMessageLimit",
       [](v1::AttendRequest& r) {
         Reshape({1, 1, 65536, 1}, r.mutable_query());
         Reshape({1, 1, 1, 1}, r.mutable_key());
         Reshape({1, 1, 1, 32}, r.mutable_value());
       },
       absl::StatusCode::kResourceExhausted,
       {"the response (output, framing) would need 8389632 bytes",
        "max_message_bytes limit of 4194304"}},
      {"MaskNotBroadcastable",
       [](v1::AttendRequest& r) {
         *r.mutable_options()->mutable_attn_mask() =
             MakeFloat32Tensor({5, 6}, RandomValues(30, 8));
       },
       absl::StatusCode::kInvalidArgument,
       {"options.attn_mask.shape[1] is 6, expected 1 or 7 (Lk)"}},
      {"MaskRankFive",
       [](v1::AttendRequest& r) {
         *r.mutable_options()->mutable_attn_mask() =
             MakeFloat32Tensor({1, 1, 1, 5, 7}, RandomValues(35, 8));
       },
       absl::StatusCode::kInvalidArgument,
       {"options.attn_mask.shape is [1, 1, 1, 5, 7] with 5 dimensions, "
        "expected 1 to 4"}},
      {"MaskWithoutDType",
       [](v1::AttendRequest& r) {
         r.mutable_options()->mutable_attn_mask()->add_shape(7);
         r.mutable_options()->mutable_attn_mask()->set_data(std::string(7, 1));
       },
       absl::StatusCode::kInvalidArgument,
       {"options.attn_mask.dtype is DTYPE_UNSPECIFIED, expected BOOL or "
        "FLOAT32"}},
      {"BoolMaskBytesMismatch",
       [](v1::AttendRequest& r) {
         *r.mutable_options()->mutable_attn_mask() =
             MakeBoolTensor({5, 7}, std::vector<bool>(34, true));
       },
       absl::StatusCode::kInvalidArgument,
       {"options.attn_mask.data has 34 bytes, expected 35"}},
      {"KeyLengthsSizeNotBatch",
       [](v1::AttendRequest& r) {
         for (int64_t length : {1, 2, 3})
           r.mutable_options()->add_key_lengths(length);
       },
       absl::StatusCode::kInvalidArgument,
       {"options.key_lengths size is 3, expected 2 (one entry per batch item, "
        "B)"}},
      {"KeyLengthPastKeys",
       [](v1::AttendRequest& r) {
         for (int64_t length : {7, 8})
           r.mutable_options()->add_key_lengths(length);
       },
       absl::StatusCode::kInvalidArgument,
       {"options.key_lengths[1] is 8, expected 0 to 7 (Lk)"}},
      {"WindowLeftBelowMinusOne",
       [](v1::AttendRequest& r) { r.mutable_options()->set_window_left(-2); },
       absl::StatusCode::kInvalidArgument,
       {"options.window_left is -2, expected -1 or absent (unbounded) or "
        ">= 0"}},
      {"WindowRightBelowMinusOne",
       [](v1::AttendRequest& r) {
         r.mutable_options()->set_window_right(
             std::numeric_limits<int64_t>::min());
       },
       absl::StatusCode::kInvalidArgument,
       {"options.window_right is -9223372036854775808"}},
      {"NegativeSinks",
       [](v1::AttendRequest& r) {
         r.mutable_options()->set_num_sink_tokens(-3);
       },
       absl::StatusCode::kInvalidArgument,
       {"options.num_sink_tokens is -3, expected >= 0"}},
      {"ZeroSoftcap",
       [](v1::AttendRequest& r) { r.mutable_options()->set_softcap(0.0f); },
       absl::StatusCode::kInvalidArgument,
       {"options.softcap is 0, expected a finite number >= 1.17549435e-38 (the "
        "smallest normal float), or absent for none"}},
      {"SubnormalSoftcap",
       [](v1::AttendRequest& r) { r.mutable_options()->set_softcap(2e-39f); },
       absl::StatusCode::kInvalidArgument,
       {"options.softcap is 2.00000043e-39, expected a finite number >= "
        "1.17549435e-38"}},
      {"NegativeSoftcap",
       [](v1::AttendRequest& r) { r.mutable_options()->set_softcap(-30.0f); },
       absl::StatusCode::kInvalidArgument,
       {"options.softcap is -30"}},
      {"NanSoftcap",
       [](v1::AttendRequest& r) {
         r.mutable_options()->set_softcap(
             std::numeric_limits<float>::quiet_NaN());
       },
       absl::StatusCode::kInvalidArgument,
       {"options.softcap is nan"}},
      {"AlibiSlopesNotOnePerHead",
       [](v1::AttendRequest& r) {
         *r.mutable_options()->mutable_alibi_slopes() =
             MakeFloat32Tensor({2}, {0.5f, 0.25f});
       },
       absl::StatusCode::kInvalidArgument,
       {"options.alibi_slopes.shape[0] is 2, expected 4 (one slope per query "
        "head, H)"}},
      {"AlibiSlopesRankTwo",
       [](v1::AttendRequest& r) {
         *r.mutable_options()->mutable_alibi_slopes() =
             MakeFloat32Tensor({1, 4}, RandomValues(4, 3));
       },
       absl::StatusCode::kInvalidArgument,
       {"options.alibi_slopes.shape is [1, 4] with 2 dimensions, expected 1"}},
      {"AlibiSlopesInBf16",
       [](v1::AttendRequest& r) {
         v1::Tensor* slopes = r.mutable_options()->mutable_alibi_slopes();
         slopes->set_dtype(v1::BFLOAT16);
         slopes->add_shape(4);
         slopes->set_data(std::string(8, 0));
       },
       absl::StatusCode::kInvalidArgument,
       {"options.alibi_slopes.dtype is BFLOAT16, expected FLOAT32"}},
      {"AlibiSlopesShortData",
       [](v1::AttendRequest& r) {
         v1::Tensor* slopes = r.mutable_options()->mutable_alibi_slopes();
         *slopes = MakeFloat32Tensor({4}, RandomValues(4, 3));
         slopes->mutable_data()->resize(15);
       },
       absl::StatusCode::kInvalidArgument,
       {"options.alibi_slopes.data has 15 bytes, expected 16"}},
      {"InfiniteAlibiSlope",
       [](v1::AttendRequest& r) {
         *r.mutable_options()->mutable_alibi_slopes() = MakeFloat32Tensor(
             {4}, {0.5f, std::numeric_limits<float>::infinity(), 0.1f, 0.1f});
       },
       absl::StatusCode::kInvalidArgument,
       {"options.alibi_slopes[1] is inf, expected a finite number"}},
      {"PackedNeedsRankThree",
       [](v1::AttendRequest& r) {
         for (int64_t x : {0, 5}) r.mutable_options()->add_cu_seqlens_q(x);
         for (int64_t x : {0, 7}) r.mutable_options()->add_cu_seqlens_k(x);
       },
       absl::StatusCode::kInvalidArgument,
       {"query.shape is [2, 4, 5, 8] with 4 dimensions, expected 3: "
        "[total_q, H, Dk]"}},
      {"PackedOffsetPastTheRows",
       [](v1::AttendRequest& r) {
         Reshape({10, 4, 8}, r.mutable_query());
         Reshape({14, 2, 8}, r.mutable_key());
         Reshape({14, 2, 3}, r.mutable_value());
         for (int64_t x : {0, 4, 11}) r.mutable_options()->add_cu_seqlens_q(x);
         for (int64_t x : {0, 7, 14}) r.mutable_options()->add_cu_seqlens_k(x);
       },
       absl::StatusCode::kInvalidArgument,
       {"options.cu_seqlens_q[2] is 11, expected 4 to 10"}},
      {"PackedOffsetsEndShort",
       [](v1::AttendRequest& r) {
         Reshape({10, 4, 8}, r.mutable_query());
         Reshape({14, 2, 8}, r.mutable_key());
         Reshape({14, 2, 3}, r.mutable_value());
         for (int64_t x : {0, 4, 10}) r.mutable_options()->add_cu_seqlens_q(x);
         for (int64_t x : {0, 7, 13}) r.mutable_options()->add_cu_seqlens_k(x);
       },
       absl::StatusCode::kInvalidArgument,
       {"options.cu_seqlens_k[2] is 13, expected 14, the tensor's rows"}},
      {"PackedOffsetsOfTwoSizes",
       [](v1::AttendRequest& r) {
         Reshape({10, 4, 8}, r.mutable_query());
         Reshape({14, 2, 8}, r.mutable_key());
         Reshape({14, 2, 3}, r.mutable_value());
         for (int64_t x : {0, 10}) r.mutable_options()->add_cu_seqlens_q(x);
         for (int64_t x : {0, 7, 14}) r.mutable_options()->add_cu_seqlens_k(x);
       },
       absl::StatusCode::kInvalidArgument,
       {"options.cu_seqlens_q and cu_seqlens_k have 2 and 3 entries, expected "
        "the same number"}},
      {"PackedWithWeights",
       [](v1::AttendRequest& r) {
         Reshape({10, 4, 8}, r.mutable_query());
         Reshape({14, 2, 8}, r.mutable_key());
         Reshape({14, 2, 3}, r.mutable_value());
         for (int64_t x : {0, 10}) r.mutable_options()->add_cu_seqlens_q(x);
         for (int64_t x : {0, 14}) r.mutable_options()->add_cu_seqlens_k(x);
         r.mutable_options()->set_return_weights(
             v1::AttentionOptions::HEAD_MEAN);
       },
       absl::StatusCode::kInvalidArgument,
       {"options.return_weights is set, expected it unset",
        "do not combine with packed sequences"}},
      {"PositionsOnAttend",
       [](v1::AttendRequest& r) { r.mutable_options()->add_key_positions(0); },
       absl::StatusCode::kInvalidArgument,
       {"options.query_positions and key_positions are for "
        "MultiHeadAttention with RoPE"}},
      {"NegativeKeyLength",
       [](v1::AttendRequest& r) {
         for (int64_t length : {-1, 3})
           r.mutable_options()->add_key_lengths(length);
       },
       absl::StatusCode::kInvalidArgument,
       {"options.key_lengths[0] is -1"}},
      {"UnknownCausalAlignment",
       [](v1::AttendRequest& r) {
         r.mutable_options()->set_causal_alignment(
             static_cast<v1::AttentionOptions::CausalAlignment>(7));
       },
       absl::StatusCode::kInvalidArgument,
       {"options.causal_alignment is 7, expected TOP_LEFT (0), BOTTOM_RIGHT "
        "(1)"}},
      {"UnknownReturnWeights",
       [](v1::AttendRequest& r) {
         r.mutable_options()->set_return_weights(
             static_cast<v1::AttentionOptions::ReturnWeights>(9));
       },
       absl::StatusCode::kInvalidArgument,
       {"options.return_weights is 9, expected NONE (0), PER_HEAD (1), "
        "HEAD_MEAN (2)"}},
      {"UnknownPrecision",
       [](v1::AttendRequest& r) {
         r.mutable_options()->set_precision(
             static_cast<v1::AttentionOptions::Precision>(5));
       },
       absl::StatusCode::kInvalidArgument,
       {"options.precision is 5, expected F32 (0), BF16 (1)"}},
      {"OutputDTypeBool",
       [](v1::AttendRequest& r) {
         r.mutable_options()->set_output_dtype(v1::BOOL);
       },
       absl::StatusCode::kInvalidArgument,
       {"options.output_dtype is BOOL, expected FLOAT32"}},
      {"WeightsOverMessageLimit",
       [](v1::AttendRequest& r) {
         Reshape({1, 1, 1024, 1}, r.mutable_query());
         Reshape({1, 1, 1100, 1}, r.mutable_key());
         Reshape({1, 1, 1100, 1}, r.mutable_value());
         r.mutable_options()->set_return_weights(
             v1::AttentionOptions::PER_HEAD);
       },
       absl::StatusCode::kResourceExhausted,
       {"the response (output, weights, framing) would need 4510720 bytes",
        "limit of 4194304"}},
      {"RequestOverMessageLimit",
       [](v1::AttendRequest& r) {
         Reshape({1, 1, 1 << 20, 2}, r.mutable_query());
       },
       absl::StatusCode::kResourceExhausted,
       {"larger than max"}},
  };
  return *cases;
}

class BadRequestTest : public ::attnserve::testing::ServerFixture,
                       public ::testing::WithParamInterface<BadRequestCase> {};

TEST_P(BadRequestTest, GetsCodeNamingTheFieldAndServerKeepsServing) {
  const BadRequestCase& test_case = GetParam();
  v1::AttendRequest request = ValidRequest();
  test_case.mutate(request);
  const absl::Status status = client_->Attend(request, kTimeout).status();
  EXPECT_EQ(status.code(), test_case.code) << status;
  for (const std::string& part : test_case.message_parts) {
    EXPECT_THAT(std::string(status.message()), HasSubstr(part));
  }
  const absl::StatusOr<v1::AttendResponse> valid =
      client_->Attend(ValidRequest(), kTimeout);
  EXPECT_TRUE(valid.ok()) << valid.status();
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BadRequestTest, ::testing::ValuesIn(BadRequestCases()),
    [](const ::testing::TestParamInfo<BadRequestCase>& param) {
      return std::string(param.param.name);
    });

// The fused kernel's scratch does not grow with the scores; the unfused
// path's does, and a request whose scores would not fit the workspace is
// refused before it is queued.
class UnfusedWorkspaceTest : public ::attnserve::testing::ServerFixture {
 protected:
  void SetUp() override {
    ServerOptions options = DefaultOptions();
    options.engine.kernel = AttentionKernel::kUnfused;
    StartServer(options);
  }
};

// The unfused path's least slab is one query row of a kv head's group: 64
// heads of 131072 keys, 32 MiB of scores, over the fixture's 16 MiB workspace.
v1::AttendRequest LargeScoresRequest() {
  v1::AttendRequest request;
  Reshape({1, 64, 2, 1}, request.mutable_query());
  Reshape({1, 1, 131072, 1}, request.mutable_key());
  Reshape({1, 1, 131072, 1}, request.mutable_value());
  return request;
}

TEST_F(UnfusedWorkspaceTest, ScoresOverWorkspaceLimitAreRefused) {
  const absl::Status status =
      client_->Attend(LargeScoresRequest(), kTimeout).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("33554432 bytes"));
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("workspace limit of 16777216"));
}

class FusedWorkspaceTest : public ::attnserve::testing::ServerFixture {};

TEST_F(FusedWorkspaceTest, SameRequestFitsTheFusedKernel) {
  const v1::AttendRequest request = LargeScoresRequest();
  const absl::StatusOr<v1::AttendResponse> response =
      client_->Attend(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  const std::vector<double> expected =
      ::attnserve::testing::ReferenceAttention(
          {1, 64, 1, 2, 131072, 1, 1}, FloatValues(request.query()).value(),
          FloatValues(request.key()).value(),
          FloatValues(request.value()).value())
          .output;
  const std::vector<float> output = FloatValues(response->output()).value();
  ASSERT_EQ(output.size(), expected.size());
  for (size_t i = 0; i < output.size(); ++i) {
    EXPECT_NEAR(output[i], expected[i], 1e-5) << i;
  }
}

}  // namespace
}  // namespace attnserve
