// Real-world check: numbers from PyTorch's nn.MultiheadAttention
// (tests/data/torch_mha, made by tests/data/make_torch_mha_fixture.py)
// reproduced through the gRPC API, with inline weights and with the same
// weights registered by name; and RoPE (Llama's, GPT-J's) and ALiBi
// (BLOOM's) as the fixture script's own torch code computes them
// (tests/data/torch_variants, made by make_torch_variants_fixture.py).
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "attnserve/common/npy.h"
#include "gtest/gtest.h"
#include "server/server_fixture.h"

namespace attnserve {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(30);
// PyTorch ran in float64; attnserve computes in f32.
constexpr double kAbsTolerance = 2e-5;
constexpr double kRelTolerance = 1e-5;

const char* const kCases[] = {"self_attention", "cross_attention",
                              "key_padding", "causal_bool_mask", "no_weights"};

std::string CaseDir(const std::string& name) {
  return std::string(ATTNSERVE_TEST_DATA_DIR) + "/torch_mha/" + name;
}

std::map<std::string, std::string> ReadCase(const std::string& dir) {
  std::map<std::string, std::string> entries;
  std::ifstream file(dir + "/case.txt");
  std::string line;
  while (std::getline(file, line)) {
    std::vector<std::string> parts =
        absl::StrSplit(line, absl::MaxSplits('=', 1));
    if (parts.size() == 2) entries[parts[0]] = parts[1];
  }
  return entries;
}

bool Exists(const std::string& path) { return std::ifstream(path).good(); }

NpyArray Read(const std::string& path) {
  absl::StatusOr<NpyArray> array = ReadNpyFile(path, 1 << 20);
  EXPECT_TRUE(array.ok()) << array.status();
  return array.ok() ? *std::move(array) : NpyArray{};
}

v1::Tensor ToTensor(const NpyArray& array) {
  v1::Tensor tensor;
  tensor.set_dtype(array.dtype == NpyDType::kBool ? v1::BOOL : v1::FLOAT32);
  tensor.mutable_shape()->Assign(array.shape.begin(), array.shape.end());
  tensor.set_data(array.data);
  return tensor;
}

std::vector<float> Floats(const NpyArray& array) {
  std::vector<float> values(array.data.size() / sizeof(float));
  std::memcpy(values.data(), array.data.data(), array.data.size());
  return values;
}

v1::ProjectionWeights ReadWeights(const std::string& dir, int64_t num_heads) {
  v1::ProjectionWeights weights;
  weights.set_num_heads(num_heads);
  *weights.mutable_w_q() = ToTensor(Read(dir + "/w_q.npy"));
  *weights.mutable_w_k() = ToTensor(Read(dir + "/w_k.npy"));
  *weights.mutable_w_v() = ToTensor(Read(dir + "/w_v.npy"));
  *weights.mutable_w_o() = ToTensor(Read(dir + "/w_o.npy"));
  if (Exists(dir + "/b_q.npy")) {
    *weights.mutable_b_q() = ToTensor(Read(dir + "/b_q.npy"));
    *weights.mutable_b_k() = ToTensor(Read(dir + "/b_k.npy"));
    *weights.mutable_b_v() = ToTensor(Read(dir + "/b_v.npy"));
    *weights.mutable_b_o() = ToTensor(Read(dir + "/b_o.npy"));
  }
  return weights;
}

// The request for one case, weights left for the caller to set.
v1::MultiHeadAttentionRequest ReadRequest(
    const std::string& dir, const std::map<std::string, std::string>& config) {
  v1::MultiHeadAttentionRequest request;
  *request.mutable_query_input() = ToTensor(Read(dir + "/query_input.npy"));
  if (Exists(dir + "/kv_input.npy")) {
    *request.mutable_kv_input() = ToTensor(Read(dir + "/kv_input.npy"));
  }
  v1::AttentionOptions& options = *request.mutable_options();
  if (Exists(dir + "/attn_mask.npy")) {
    *options.mutable_attn_mask() = ToTensor(Read(dir + "/attn_mask.npy"));
  }
  if (Exists(dir + "/key_lengths.npy")) {
    const NpyArray lengths = Read(dir + "/key_lengths.npy");
    for (size_t i = 0; i < lengths.data.size() / sizeof(int64_t); ++i) {
      int64_t length;
      std::memcpy(&length, lengths.data.data() + i * sizeof(int64_t),
                  sizeof(length));
      options.add_key_lengths(length);
    }
  }
  const std::string& weights = config.at("weights");
  options.set_return_weights(
      weights == "per_head"    ? v1::AttentionOptions::PER_HEAD
      : weights == "head_mean" ? v1::AttentionOptions::HEAD_MEAN
                               : v1::AttentionOptions::NONE);
  return request;
}

void ExpectMatches(const char* what, const v1::Tensor& actual,
                   const NpyArray& expected) {
  ASSERT_EQ(std::vector<int64_t>(actual.shape().begin(), actual.shape().end()),
            expected.shape)
      << what;
  const std::vector<float> values = FloatValues(actual).value();
  const std::vector<float> reference = Floats(expected);
  ASSERT_EQ(values.size(), reference.size());
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_NEAR(values[i], reference[i],
                kAbsTolerance + kRelTolerance * std::abs(reference[i]))
        << what << " at flat index " << i;
  }
}

class TorchFixtureTest : public ::attnserve::testing::ServerFixture,
                         public ::testing::WithParamInterface<const char*> {};

TEST_P(TorchFixtureTest, InlineAndRegisteredWeightsReproducePyTorch) {
  const std::string dir = CaseDir(GetParam());
  const std::map<std::string, std::string> config = ReadCase(dir);
  ASSERT_FALSE(config.empty()) << "no case.txt in " << dir;
  int64_t num_heads = 0;
  ASSERT_TRUE(absl::SimpleAtoi(config.at("num_heads"), &num_heads));
  const v1::ProjectionWeights weights = ReadWeights(dir, num_heads);

  v1::MultiHeadAttentionRequest inline_request = ReadRequest(dir, config);
  *inline_request.mutable_weights() = weights;
  v1::PutWeightsRequest put;
  put.set_name(std::string("torch_") + GetParam());
  *put.mutable_weights() = weights;
  ASSERT_TRUE(client_->PutWeights(put, kTimeout).ok());
  v1::MultiHeadAttentionRequest named_request = ReadRequest(dir, config);
  named_request.set_weights_name(put.name());

  for (const v1::MultiHeadAttentionRequest* request :
       {&inline_request, &named_request}) {
    SCOPED_TRACE(request->has_weights() ? "inline weights"
                                        : "registered weights");
    absl::StatusOr<v1::MultiHeadAttentionResponse> response =
        client_->MultiHeadAttention(*request, kTimeout);
    ASSERT_TRUE(response.ok()) << response.status();
    ExpectMatches("output", response->output(), Read(dir + "/output.npy"));
    if (config.at("weights") != "none") {
      ExpectMatches("weights", response->weights(), Read(dir + "/weights.npy"));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TorchFixtureTest, ::testing::ValuesIn(kCases),
    [](const ::testing::TestParamInfo<const char*>& param) {
      return std::string(param.param);
    });

const char* const kVariantCases[] = {"llama_rope_gqa", "gptj_rope_positions",
                                     "bloom_alibi"};

std::vector<int64_t> Int64s(const NpyArray& array) {
  std::vector<int64_t> values(array.data.size() / sizeof(int64_t));
  std::memcpy(values.data(), array.data.data(), array.data.size());
  return values;
}

class TorchVariantsTest : public ::attnserve::testing::ServerFixture,
                          public ::testing::WithParamInterface<const char*> {};

// A Llama layer is one MultiHeadAttention call with a weights name: the
// registered set carries its RoPE.
TEST_P(TorchVariantsTest, RopeAndAlibiReproducePyTorch) {
  const std::string dir =
      std::string(ATTNSERVE_TEST_DATA_DIR) + "/torch_variants/" + GetParam();
  const std::map<std::string, std::string> config = ReadCase(dir);
  ASSERT_FALSE(config.empty()) << "no case.txt in " << dir;
  if (config.at("kind") == "attend") {
    v1::AttendRequest request;
    *request.mutable_query() = ToTensor(Read(dir + "/query.npy"));
    *request.mutable_key() = ToTensor(Read(dir + "/key.npy"));
    *request.mutable_value() = ToTensor(Read(dir + "/value.npy"));
    request.mutable_options()->set_causal(config.at("causal") == "1");
    *request.mutable_options()->mutable_alibi_slopes() =
        ToTensor(Read(dir + "/alibi_slopes.npy"));
    absl::StatusOr<v1::AttendResponse> response =
        client_->Attend(request, kTimeout);
    ASSERT_TRUE(response.ok()) << response.status();
    ExpectMatches("output", response->output(), Read(dir + "/output.npy"));
    return;
  }
  int64_t num_heads = 0, num_kv_heads = 0, rotary_dim = 0;
  float theta = 0.0f;
  ASSERT_TRUE(absl::SimpleAtoi(config.at("num_heads"), &num_heads));
  ASSERT_TRUE(absl::SimpleAtoi(config.at("num_kv_heads"), &num_kv_heads));
  ASSERT_TRUE(absl::SimpleAtoi(config.at("rotary_dim"), &rotary_dim));
  ASSERT_TRUE(absl::SimpleAtof(config.at("rope_theta"), &theta));
  v1::ProjectionWeights weights = ReadWeights(dir, num_heads);
  weights.set_num_kv_heads(num_kv_heads);
  weights.mutable_rope()->set_theta(theta);
  weights.mutable_rope()->set_rotary_dim(rotary_dim);
  weights.mutable_rope()->set_interleaved(config.at("interleaved") == "1");
  v1::PutWeightsRequest put;
  put.set_name(std::string("torch_") + GetParam());
  *put.mutable_weights() = weights;
  ASSERT_TRUE(client_->PutWeights(put, kTimeout).ok());

  v1::MultiHeadAttentionRequest request;
  *request.mutable_query_input() = ToTensor(Read(dir + "/query_input.npy"));
  v1::AttentionOptions& options = *request.mutable_options();
  options.set_causal(config.at("causal") == "1");
  if (Exists(dir + "/positions.npy")) {
    for (const int64_t p : Int64s(Read(dir + "/positions.npy"))) {
      options.add_query_positions(p);
      options.add_key_positions(p);
    }
  }
  v1::MultiHeadAttentionRequest inline_request = request;
  *inline_request.mutable_weights() = weights;
  request.set_weights_name(put.name());
  for (const v1::MultiHeadAttentionRequest* r : {&inline_request, &request}) {
    SCOPED_TRACE(r->has_weights() ? "inline weights" : "registered weights");
    absl::StatusOr<v1::MultiHeadAttentionResponse> response =
        client_->MultiHeadAttention(*r, kTimeout);
    ASSERT_TRUE(response.ok()) << response.status();
    ExpectMatches("output", response->output(), Read(dir + "/output.npy"));
  }
  // Without the RoPE the layer is another one: the fixture tells them apart.
  v1::MultiHeadAttentionRequest plain = inline_request;
  plain.mutable_weights()->clear_rope();
  plain.mutable_options()->clear_query_positions();
  plain.mutable_options()->clear_key_positions();
  absl::StatusOr<v1::MultiHeadAttentionResponse> response =
      client_->MultiHeadAttention(plain, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  const std::vector<float> without = FloatValues(response->output()).value();
  const std::vector<float> expected = Floats(Read(dir + "/output.npy"));
  double largest = 0.0;
  for (size_t i = 0; i < without.size(); ++i) {
    largest = std::max(largest, std::abs(double{without[i]} - expected[i]));
  }
  EXPECT_GT(largest, 1e-3);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TorchVariantsTest, ::testing::ValuesIn(kVariantCases),
    [](const ::testing::TestParamInfo<const char*>& param) {
      return std::string(param.param);
    });

}  // namespace
}  // namespace attnserve
