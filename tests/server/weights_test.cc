// Projection weights end to end: the PutWeights / ListWeights / DeleteWeights
// registry, MultiHeadAttention (inline and registered weights) against the
// naive reference, malformed weights and requests, the --max_weights_bytes
// limit, and --weights_dir folders of .npy files.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"
#include "server/server_fixture.h"
#include "weights_loader.h"

namespace attnserve {
namespace {

using ::attnserve::testing::HeadMean;
using ::attnserve::testing::RandomValues;
using ::attnserve::testing::ReferenceMhaShape;
using ::attnserve::testing::ReferenceMhaWeights;
using ::attnserve::testing::ReferenceMultiHeadAttention;
using ::attnserve::testing::ReferenceOptions;
using ::attnserve::testing::ReferenceResult;
using ::attnserve::testing::ServerFixture;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(30);

// f32 tolerance against the double reference: abs + rel * |expected|.
constexpr double kAbs = 1e-5;
constexpr double kRel = 1e-5;

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t elements = 1;
  for (int64_t dim : shape) elements *= dim;
  return elements;
}

// A tensor of `dtype` and `shape` holding values uniform in [-scale, scale).
v1::Tensor RandomTensor(v1::DType dtype, const std::vector<int64_t>& shape,
                        uint64_t seed, float scale) {
  std::vector<float> values = RandomValues(Elements(shape), seed);
  for (float& value : values) value *= scale;
  return MakeTensor(dtype, shape, values);
}

// Gives `tensor` a new shape with a matching FLOAT32 byte count.
void Reshape(const std::vector<int64_t>& shape, v1::Tensor* tensor) {
  *tensor = RandomTensor(v1::FLOAT32, shape, 7, 1.0f);
}

// The elements of a float tensor, widened to float (a test failure if it
// cannot be read).
std::vector<float> ValuesOf(const v1::Tensor& tensor) {
  absl::StatusOr<std::vector<float>> values = FloatValues(tensor);
  EXPECT_TRUE(values.ok()) << values.status();
  return values.ok() ? *std::move(values) : std::vector<float>();
}

enum class Biases { kNone, kAll, kQueryAndOutputOnly };

// Projection weights for the dimensions of `s` (B, Lq and Lk unused): Q and K
// in [-1, 1) so that the softmax is not flat, V and O scaled like
// nn.Linear's init so that outputs stay near 1.
v1::ProjectionWeights MakeWeights(const ReferenceMhaShape& s, uint64_t seed,
                                  Biases biases = Biases::kAll,
                                  v1::DType dtype = v1::FLOAT32) {
  const int64_t q_out = s.heads * s.key_dim;
  const int64_t k_out = s.kv_heads * s.key_dim;
  const int64_t v_out = s.kv_heads * s.value_dim;
  const int64_t o_in = s.heads * s.value_dim;
  v1::ProjectionWeights w;
  w.set_num_heads(s.heads);
  w.set_num_kv_heads(s.kv_heads);
  *w.mutable_w_q() = RandomTensor(dtype, {q_out, s.embed_dim}, seed, 1.0f);
  *w.mutable_w_k() =
      RandomTensor(dtype, {k_out, s.kv_embed_dim}, seed + 1, 1.0f);
  *w.mutable_w_v() =
      RandomTensor(dtype, {v_out, s.kv_embed_dim}, seed + 2,
                   1.0f / std::sqrt(static_cast<float>(s.kv_embed_dim)));
  *w.mutable_w_o() = RandomTensor(dtype, {s.embed_dim, o_in}, seed + 3,
                                  1.0f / std::sqrt(static_cast<float>(o_in)));
  if (biases != Biases::kNone) {
    *w.mutable_b_q() = RandomTensor(dtype, {q_out}, seed + 4, 0.5f);
    *w.mutable_b_o() = RandomTensor(dtype, {s.embed_dim}, seed + 7, 0.5f);
  }
  if (biases == Biases::kAll) {
    *w.mutable_b_k() = RandomTensor(dtype, {k_out}, seed + 5, 0.5f);
    *w.mutable_b_v() = RandomTensor(dtype, {v_out}, seed + 6, 0.5f);
  }
  return w;
}

// The reference's view of `w`: the values the server receives, after any
// rounding to the tensors' dtype.
ReferenceMhaWeights ReferenceWeightsOf(const v1::ProjectionWeights& w) {
  ReferenceMhaWeights r;
  r.w_q = ValuesOf(w.w_q());
  r.w_k = ValuesOf(w.w_k());
  r.w_v = ValuesOf(w.w_v());
  r.w_o = ValuesOf(w.w_o());
  if (w.has_b_q()) r.b_q = ValuesOf(w.b_q());
  if (w.has_b_k()) r.b_k = ValuesOf(w.b_k());
  if (w.has_b_v()) r.b_v = ValuesOf(w.b_v());
  if (w.has_b_o()) r.b_o = ValuesOf(w.b_o());
  return r;
}

// query_input [B, Lq, E] and, for cross-attention, kv_input [B, Lk, Ekv];
// no weights source yet.
v1::MultiHeadAttentionRequest MakeRequest(const ReferenceMhaShape& s,
                                          uint64_t seed, bool cross,
                                          v1::DType dtype = v1::FLOAT32) {
  v1::MultiHeadAttentionRequest request;
  *request.mutable_query_input() =
      RandomTensor(dtype, {s.batch, s.query_len, s.embed_dim}, seed, 1.0f);
  if (cross) {
    *request.mutable_kv_input() = RandomTensor(
        dtype, {s.batch, s.key_len, s.kv_embed_dim}, seed + 1, 1.0f);
  }
  return request;
}

ReferenceOptions ReferenceOptionsOf(const v1::AttentionOptions& proto) {
  ReferenceOptions options;
  if (proto.has_scale()) options.scale = proto.scale();
  options.causal = proto.causal();
  options.bottom_right =
      proto.causal_alignment() == v1::AttentionOptions::BOTTOM_RIGHT;
  options.key_lengths.assign(proto.key_lengths().begin(),
                             proto.key_lengths().end());
  return options;
}

// The reference's answer for `request` computed with weights `w`.
ReferenceResult Expected(const ReferenceMhaShape& s,
                         const v1::MultiHeadAttentionRequest& request,
                         const v1::ProjectionWeights& w) {
  return ReferenceMultiHeadAttention(
      s, ValuesOf(request.query_input()),
      request.has_kv_input() ? ValuesOf(request.kv_input())
                             : std::vector<float>(),
      ReferenceWeightsOf(w), ReferenceOptionsOf(request.options()));
}

void ExpectNear(const v1::Tensor& actual_tensor,
                const std::vector<double>& expected, double abs, double rel,
                const std::string& what) {
  absl::StatusOr<std::vector<float>> actual = FloatValues(actual_tensor);
  ASSERT_TRUE(actual.ok()) << what << ": " << actual.status();
  ASSERT_EQ(actual->size(), expected.size()) << what;
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_NEAR((*actual)[i], expected[i], abs + rel * std::abs(expected[i]))
        << what << " index " << i;
  }
}

// The largest absolute difference between two equally sized tensors.
double MaxDifference(const v1::Tensor& a, const v1::Tensor& b) {
  const std::vector<float> x = ValuesOf(a);
  const std::vector<float> y = ValuesOf(b);
  EXPECT_EQ(x.size(), y.size());
  double largest = 0.0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
    largest = std::max(largest, std::abs(double{x[i]} - double{y[i]}));
  }
  return largest;
}

std::vector<std::string> NamesOf(const v1::ListWeightsResponse& list) {
  std::vector<std::string> names;
  for (const v1::WeightsInfo& info : list.weights())
    names.push_back(info.name());
  return names;
}

const v1::WeightsInfo* FindInfo(const v1::ListWeightsResponse& list,
                                const std::string& name) {
  for (const v1::WeightsInfo& info : list.weights()) {
    if (info.name() == name) return &info;
  }
  return nullptr;
}

// Expects `info` to describe weights of the dimensions of `s`.
void ExpectDims(const v1::WeightsInfo& info, const ReferenceMhaShape& s,
                bool has_bias) {
  SCOPED_TRACE(info.name());
  EXPECT_EQ(info.num_heads(), s.heads);
  EXPECT_EQ(info.num_kv_heads(), s.kv_heads);
  EXPECT_EQ(info.embed_dim(), s.embed_dim);
  EXPECT_EQ(info.kv_embed_dim(), s.kv_embed_dim);
  EXPECT_EQ(info.key_dim(), s.key_dim);
  EXPECT_EQ(info.value_dim(), s.value_dim);
  EXPECT_EQ(info.has_bias(), has_bias);
  EXPECT_GT(info.version(), 0);
  EXPECT_GT(info.bytes(), 0);
}

v1::PutWeightsRequest PutRequest(const std::string& name,
                                 const v1::ProjectionWeights& weights) {
  v1::PutWeightsRequest request;
  request.set_name(name);
  *request.mutable_weights() = weights;
  return request;
}

// Self-attention shape: E == Ekv, Lq == Lk.
constexpr ReferenceMhaShape kSelfShape{
    /*batch=*/2,        /*query_len=*/5,
    /*key_len=*/5,      /*embed_dim=*/8,
    /*kv_embed_dim=*/8, /*heads=*/2,
    /*kv_heads=*/2,     /*key_dim=*/4,
    /*value_dim=*/4};

// Cross-attention, grouped-query, Dv != Dk, Ekv != E, Lk != Lq.
constexpr ReferenceMhaShape kCrossShape{
    /*batch=*/2,        /*query_len=*/3,
    /*key_len=*/7,      /*embed_dim=*/8,
    /*kv_embed_dim=*/6, /*heads=*/4,
    /*kv_heads=*/2,     /*key_dim=*/2,
    /*value_dim=*/3};

// ---------------------------------------------------------------------------
// The registry.

using WeightsRegistryTest = ServerFixture;

TEST_F(WeightsRegistryTest, DemoWeightsAreListedAtStart) {
  EXPECT_THAT(server_->startup_weights(), ElementsAre("demo"));
  absl::StatusOr<v1::ListWeightsResponse> list = client_->ListWeights(kTimeout);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_THAT(NamesOf(*list), ElementsAre("demo"));
  ExpectDims(list->weights(0), {1, 1, 1, 64, 64, 8, 8, 8, 8},
             /*has_bias=*/true);
  EXPECT_EQ(list->total_bytes(), list->weights(0).bytes());
}

TEST_F(WeightsRegistryTest, DemoWeightsMatchReference) {
  const ReferenceMhaShape s{1, 4, 4, 64, 64, 8, 8, 8, 8};
  v1::MultiHeadAttentionRequest request = MakeRequest(s, 3, /*cross=*/false);
  request.set_weights_name("demo");
  absl::StatusOr<v1::MultiHeadAttentionResponse> response =
      client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_GT(response->weights_version(), 0);
  EXPECT_THAT(response->output().shape(), ElementsAre(1, 4, 64));
  ExpectNear(response->output(),
             Expected(s, request, DemoWeights().weights()).output, kAbs, kRel,
             "output");
}

TEST_F(WeightsRegistryTest, PutWeightsReturnsVersionAndBytesAndListIsSorted) {
  absl::StatusOr<v1::PutWeightsResponse> zeta = client_->PutWeights(
      PutRequest("zeta", MakeWeights(kSelfShape, 1)), kTimeout);
  ASSERT_TRUE(zeta.ok()) << zeta.status();
  absl::StatusOr<v1::PutWeightsResponse> alpha = client_->PutWeights(
      PutRequest("alpha.v1_x-y", MakeWeights(kCrossShape, 2, Biases::kNone)),
      kTimeout);
  ASSERT_TRUE(alpha.ok()) << alpha.status();
  EXPECT_GT(zeta->version(), 0);
  EXPECT_GT(alpha->version(), zeta->version());
  EXPECT_GT(zeta->bytes(), 0);
  EXPECT_GT(alpha->bytes(), 0);

  absl::StatusOr<v1::ListWeightsResponse> list = client_->ListWeights(kTimeout);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_THAT(NamesOf(*list), ElementsAre("alpha.v1_x-y", "demo", "zeta"));
  ExpectDims(list->weights(0), kCrossShape, /*has_bias=*/false);
  ExpectDims(list->weights(2), kSelfShape, /*has_bias=*/true);
  EXPECT_EQ(list->weights(0).version(), alpha->version());
  EXPECT_EQ(list->weights(0).bytes(), alpha->bytes());
  EXPECT_EQ(list->weights(2).version(), zeta->version());
  EXPECT_EQ(list->weights(2).bytes(), zeta->bytes());
  EXPECT_EQ(list->total_bytes(),
            alpha->bytes() + list->weights(1).bytes() + zeta->bytes());
}

TEST_F(WeightsRegistryTest, WeightsNameMatchesReferenceAndReportsVersion) {
  const v1::ProjectionWeights self_weights = MakeWeights(kSelfShape, 11);
  const v1::ProjectionWeights cross_weights = MakeWeights(kCrossShape, 21);
  absl::StatusOr<v1::PutWeightsResponse> self_put =
      client_->PutWeights(PutRequest("self", self_weights), kTimeout);
  ASSERT_TRUE(self_put.ok()) << self_put.status();
  absl::StatusOr<v1::PutWeightsResponse> cross_put =
      client_->PutWeights(PutRequest("cross", cross_weights), kTimeout);
  ASSERT_TRUE(cross_put.ok()) << cross_put.status();

  // Self-attention with registered weights (E == Ekv: the fused projection).
  v1::MultiHeadAttentionRequest request =
      MakeRequest(kSelfShape, 31, /*cross=*/false);
  request.set_weights_name("self");
  absl::StatusOr<v1::MultiHeadAttentionResponse> response =
      client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->weights_version(), self_put->version());
  EXPECT_EQ(response->output().dtype(), v1::FLOAT32);
  EXPECT_THAT(response->output().shape(), ElementsAre(2, 5, 8));
  ExpectNear(response->output(),
             Expected(kSelfShape, request, self_weights).output, kAbs, kRel,
             "self output");

  // The same E == Ekv weights used for cross-attention (separate projections).
  ReferenceMhaShape cross_self = kSelfShape;
  cross_self.key_len = 3;
  request = MakeRequest(cross_self, 41, /*cross=*/true);
  request.set_weights_name("self");
  response = client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->weights_version(), self_put->version());
  ExpectNear(response->output(),
             Expected(cross_self, request, self_weights).output, kAbs, kRel,
             "self weights, cross-attention output");

  // Registered grouped-query weights with Ekv != E.
  request = MakeRequest(kCrossShape, 51, /*cross=*/true);
  request.set_weights_name("cross");
  response = client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->weights_version(), cross_put->version());
  EXPECT_THAT(response->output().shape(), ElementsAre(2, 3, 8));
  ExpectNear(response->output(),
             Expected(kCrossShape, request, cross_weights).output, kAbs, kRel,
             "cross output");
}

TEST_F(WeightsRegistryTest, RegisteredWeightsWithSomeBiasesMatchReference) {
  // b_q and b_o only: the fused self-attention bias has zeros for K and V.
  const v1::ProjectionWeights weights =
      MakeWeights(kSelfShape, 61, Biases::kQueryAndOutputOnly);
  ASSERT_TRUE(
      client_->PutWeights(PutRequest("partial", weights), kTimeout).ok());
  v1::MultiHeadAttentionRequest request =
      MakeRequest(kSelfShape, 71, /*cross=*/false);
  request.set_weights_name("partial");
  absl::StatusOr<v1::MultiHeadAttentionResponse> response =
      client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  ExpectNear(response->output(), Expected(kSelfShape, request, weights).output,
             kAbs, kRel, "output");
}

TEST_F(WeightsRegistryTest, SecondPutRaisesVersionAndNextCallUsesNewValues) {
  const v1::ProjectionWeights first = MakeWeights(kSelfShape, 101);
  const v1::ProjectionWeights second = MakeWeights(kSelfShape, 202);
  absl::StatusOr<v1::PutWeightsResponse> first_put =
      client_->PutWeights(PutRequest("model", first), kTimeout);
  ASSERT_TRUE(first_put.ok()) << first_put.status();

  v1::MultiHeadAttentionRequest request =
      MakeRequest(kSelfShape, 303, /*cross=*/false);
  request.set_weights_name("model");
  absl::StatusOr<v1::MultiHeadAttentionResponse> before =
      client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->weights_version(), first_put->version());
  ExpectNear(before->output(), Expected(kSelfShape, request, first).output,
             kAbs, kRel, "output before");

  absl::StatusOr<v1::PutWeightsResponse> second_put =
      client_->PutWeights(PutRequest("model", second), kTimeout);
  ASSERT_TRUE(second_put.ok()) << second_put.status();
  EXPECT_GT(second_put->version(), first_put->version());
  EXPECT_EQ(second_put->bytes(), first_put->bytes());

  absl::StatusOr<v1::MultiHeadAttentionResponse> after =
      client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->weights_version(), second_put->version());
  ExpectNear(after->output(), Expected(kSelfShape, request, second).output,
             kAbs, kRel, "output after");
  EXPECT_GT(MaxDifference(before->output(), after->output()), 1e-2);

  absl::StatusOr<v1::ListWeightsResponse> list = client_->ListWeights(kTimeout);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_THAT(NamesOf(*list), ElementsAre("demo", "model"));
  EXPECT_EQ(list->weights(1).version(), second_put->version());
  EXPECT_EQ(list->total_bytes(),
            list->weights(0).bytes() + second_put->bytes());
}

TEST_F(WeightsRegistryTest, DeleteWeightsReturnsInfoThenNameIsNotFound) {
  absl::StatusOr<v1::PutWeightsResponse> put = client_->PutWeights(
      PutRequest("doomed", MakeWeights(kCrossShape, 5)), kTimeout);
  ASSERT_TRUE(put.ok()) << put.status();

  absl::StatusOr<v1::DeleteWeightsResponse> deleted =
      client_->DeleteWeights("doomed", kTimeout);
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_EQ(deleted->deleted().name(), "doomed");
  EXPECT_EQ(deleted->deleted().version(), put->version());
  EXPECT_EQ(deleted->deleted().bytes(), put->bytes());
  ExpectDims(deleted->deleted(), kCrossShape, /*has_bias=*/true);

  absl::StatusOr<v1::ListWeightsResponse> list = client_->ListWeights(kTimeout);
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_THAT(NamesOf(*list), ElementsAre("demo"));
  EXPECT_EQ(list->total_bytes(), list->weights(0).bytes());

  v1::MultiHeadAttentionRequest request =
      MakeRequest(kCrossShape, 6, /*cross=*/true);
  request.set_weights_name("doomed");
  const absl::Status call =
      client_->MultiHeadAttention(request, kTimeout).status();
  EXPECT_EQ(call.code(), absl::StatusCode::kNotFound) << call;
  EXPECT_THAT(std::string(call.message()), HasSubstr("'doomed'"));

  const absl::Status again =
      client_->DeleteWeights("doomed", kTimeout).status();
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound) << again;
  EXPECT_THAT(std::string(again.message()), HasSubstr("'doomed'"));
}

// Names are checked before use, and echoed at most 256 bytes, cut on a UTF-8
// character boundary.
TEST_F(WeightsRegistryTest, DeleteWeightsChecksTheNameAndEchoesItBounded) {
  const std::string huge(1 << 20, 'n');
  const absl::Status status = client_->DeleteWeights(huge, kTimeout).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("…\" (1048576 bytes), expected 1 to 128 characters"));
  EXPECT_LT(status.message().size(), 400u);

  std::string accents = "a";
  while (accents.size() < 600)
    accents += "é";  // Two bytes each, at odd offsets.
  v1::MultiHeadAttentionRequest request =
      MakeRequest(kSelfShape, 8, /*cross=*/false);
  request.set_weights_name(accents);
  const absl::Status named =
      client_->MultiHeadAttention(request, kTimeout).status();
  EXPECT_EQ(named.code(), absl::StatusCode::kInvalidArgument) << named;
  const std::string message(named.message());
  EXPECT_THAT(message, HasSubstr("éé…\" (" + std::to_string(accents.size()) +
                                 " bytes)"));
}

TEST_F(WeightsRegistryTest, UnknownWeightsNameIsNotFoundNamingIt) {
  v1::MultiHeadAttentionRequest request =
      MakeRequest(kSelfShape, 8, /*cross=*/false);
  request.set_weights_name("never-registered");
  const absl::Status status =
      client_->MultiHeadAttention(request, kTimeout).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("weights_name 'never-registered' is not registered"));
}

// ---------------------------------------------------------------------------
// MultiHeadAttention numerics with inline weights.

using MultiHeadNumericsTest = ServerFixture;

// Calls MultiHeadAttention with inline `weights` and expects the reference's
// output within the f32 tolerance; returns the response.
v1::MultiHeadAttentionResponse ExpectInlineMatchesReference(
    Client& client, const ReferenceMhaShape& s,
    v1::MultiHeadAttentionRequest request,
    const v1::ProjectionWeights& weights) {
  *request.mutable_weights() = weights;
  absl::StatusOr<v1::MultiHeadAttentionResponse> response =
      client.MultiHeadAttention(request, kTimeout);
  EXPECT_TRUE(response.ok()) << response.status();
  if (!response.ok()) return {};
  EXPECT_EQ(response->weights_version(), 0);
  EXPECT_THAT(response->output().shape(),
              ElementsAre(s.batch, s.query_len, s.embed_dim));
  ExpectNear(response->output(), Expected(s, request, weights).output, kAbs,
             kRel, "output");
  return *std::move(response);
}

TEST_F(MultiHeadNumericsTest, SelfAttentionWithBiasesMatchesReference) {
  ExpectInlineMatchesReference(*client_, kSelfShape,
                               MakeRequest(kSelfShape, 1, /*cross=*/false),
                               MakeWeights(kSelfShape, 2));
}

TEST_F(MultiHeadNumericsTest, CrossAttentionWithOtherEmbedDimAndLengthMatches) {
  const ReferenceMhaShape s{2, 3, 6, 8, 5, 2, 2, 4, 4};
  ExpectInlineMatchesReference(*client_, s, MakeRequest(s, 3, /*cross=*/true),
                               MakeWeights(s, 4));
}

TEST_F(MultiHeadNumericsTest, GroupedQueryWithValueDimUnlikeKeyDimMatches) {
  ExpectInlineMatchesReference(*client_, kCrossShape,
                               MakeRequest(kCrossShape, 5, /*cross=*/true),
                               MakeWeights(kCrossShape, 6));
  const ReferenceMhaShape self{1, 6, 6, 6, 6, 6, 2, 3, 5};
  ExpectInlineMatchesReference(*client_, self,
                               MakeRequest(self, 7, /*cross=*/false),
                               MakeWeights(self, 8));
}

TEST_F(MultiHeadNumericsTest, NoBiasesMatchesReference) {
  ExpectInlineMatchesReference(*client_, kSelfShape,
                               MakeRequest(kSelfShape, 9, /*cross=*/false),
                               MakeWeights(kSelfShape, 10, Biases::kNone));
  ExpectInlineMatchesReference(*client_, kCrossShape,
                               MakeRequest(kCrossShape, 11, /*cross=*/true),
                               MakeWeights(kCrossShape, 12, Biases::kNone));
}

TEST_F(MultiHeadNumericsTest, CausalWithKeyLengthsMatchesReference) {
  v1::MultiHeadAttentionRequest request =
      MakeRequest(kSelfShape, 13, /*cross=*/false);
  request.mutable_options()->set_causal(true);
  request.mutable_options()->add_key_lengths(5);
  request.mutable_options()->add_key_lengths(3);
  request.mutable_options()->set_scale(0.3f);
  ExpectInlineMatchesReference(*client_, kSelfShape, request,
                               MakeWeights(kSelfShape, 14));
}

TEST_F(MultiHeadNumericsTest, Bfloat16WeightsMatchReferenceOfRoundedValues) {
  const v1::ProjectionWeights weights =
      MakeWeights(kCrossShape, 15, Biases::kAll, v1::BFLOAT16);
  ASSERT_EQ(weights.w_q().dtype(), v1::BFLOAT16);
  // The reference reads the bf16 values back from the request's tensors.
  const v1::MultiHeadAttentionResponse response = ExpectInlineMatchesReference(
      *client_, kCrossShape, MakeRequest(kCrossShape, 16, /*cross=*/true),
      weights);
  EXPECT_EQ(response.output().dtype(), v1::FLOAT32);  // The query_input's.
}

TEST_F(MultiHeadNumericsTest, Bfloat16InputsGiveBfloat16OutputNearReference) {
  const v1::ProjectionWeights weights = MakeWeights(kCrossShape, 17);
  v1::MultiHeadAttentionRequest request =
      MakeRequest(kCrossShape, 18, /*cross=*/true, v1::BFLOAT16);
  *request.mutable_weights() = weights;
  absl::StatusOr<v1::MultiHeadAttentionResponse> response =
      client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->output().dtype(), v1::BFLOAT16);
  // f32 compute on the bf16 inputs; only the output is rounded (2^-9
  // relative).
  ExpectNear(response->output(), Expected(kCrossShape, request, weights).output,
             1e-5, 4e-3, "output");
}

TEST_F(MultiHeadNumericsTest, Bf16PrecisionIsNearReference) {
  for (const bool cross : {false, true}) {
    SCOPED_TRACE(cross ? "cross" : "self");
    const ReferenceMhaShape& s = cross ? kCrossShape : kSelfShape;
    const v1::ProjectionWeights weights = MakeWeights(s, 19);
    v1::MultiHeadAttentionRequest request = MakeRequest(s, 20, cross);
    request.mutable_options()->set_precision(v1::AttentionOptions::BF16);
    *request.mutable_weights() = weights;
    absl::StatusOr<v1::MultiHeadAttentionResponse> response =
        client_->MultiHeadAttention(request, kTimeout);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->output().dtype(), v1::FLOAT32);
    ExpectNear(response->output(), Expected(s, request, weights).output, 3e-2,
               0.0, "output");
  }
}

TEST_F(MultiHeadNumericsTest, ReturnsPerHeadWeightsAndLseMatchingReference) {
  const ReferenceMhaShape& s = kCrossShape;
  const v1::ProjectionWeights weights = MakeWeights(s, 21);
  v1::MultiHeadAttentionRequest request = MakeRequest(s, 22, /*cross=*/true);
  request.mutable_options()->set_return_weights(v1::AttentionOptions::PER_HEAD);
  request.mutable_options()->set_return_lse(true);
  const v1::MultiHeadAttentionResponse response =
      ExpectInlineMatchesReference(*client_, s, request, weights);
  const ReferenceResult expected = Expected(s, request, weights);
  EXPECT_EQ(response.weights().dtype(), v1::FLOAT32);
  EXPECT_THAT(response.weights().shape(),
              ElementsAre(s.batch, s.heads, s.query_len, s.key_len));
  ExpectNear(response.weights(), expected.weights, kAbs, kRel, "weights");
  EXPECT_EQ(response.lse().dtype(), v1::FLOAT32);
  EXPECT_THAT(response.lse().shape(),
              ElementsAre(s.batch, s.heads, s.query_len));
  ExpectNear(response.lse(), expected.lse, 1e-4, 0.0, "lse");
}

TEST_F(MultiHeadNumericsTest, ReturnsHeadMeanWeightsMatchingReference) {
  const ReferenceMhaShape& s = kCrossShape;
  const v1::ProjectionWeights weights = MakeWeights(s, 23);
  v1::MultiHeadAttentionRequest request = MakeRequest(s, 24, /*cross=*/true);
  request.mutable_options()->set_return_weights(
      v1::AttentionOptions::HEAD_MEAN);
  const v1::MultiHeadAttentionResponse response =
      ExpectInlineMatchesReference(*client_, s, request, weights);
  EXPECT_THAT(response.weights().shape(),
              ElementsAre(s.batch, s.query_len, s.key_len));
  ExpectNear(response.weights(),
             HeadMean(Expected(s, request, weights).weights, s.batch, s.heads,
                      s.query_len, s.key_len),
             kAbs, kRel, "head-mean weights");
  EXPECT_FALSE(response.has_lse());
}

// ---------------------------------------------------------------------------
// Malformed MultiHeadAttention and PutWeights requests: each gets the right
// code and a message naming the field, and the server goes on serving.

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
       {"weights.w_q.shape[0]", "is 9, expected a multiple of 4 (num_heads)"}},
      {"KeyRowsInconsistentWithQuery",
       [](Mha& r) {
         Reshape({6, 6}, r.mutable_weights()->mutable_w_k());
       },
       kInvalid,
       {"weights.w_k.shape[0]", "is 6, expected 4 (num_kv_heads"}},
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
        "is 5, expected a multiple of 2 (num_kv_heads)"}},
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
       {"weights.b_q.shape[0] (out) is 7, expected 8 (w_q.shape[0])"}},
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
       {"query_input.shape[2] (E) is 8, expected 6",
        "self-attention needs Ekv == E"}},
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
       {"weights.b_v.shape[0] (out) is 5, expected 6 (w_v.shape[0])"}},
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

// ---------------------------------------------------------------------------
// --max_weights_bytes.

using WeightsLimitTest = ServerFixture;

TEST_F(WeightsLimitTest, PutOverLimitIsResourceExhaustedAndEarlierSetsRemain) {
  const v1::ProjectionWeights small = MakeWeights(kSelfShape, 1);
  const v1::ProjectionWeights big =
      MakeWeights({1, 1, 1, 16, 16, 4, 4, 4, 4}, 2);
  // The bytes each set takes, as the server counts them, from the default
  // server.
  absl::StatusOr<v1::PutWeightsResponse> small_put =
      client_->PutWeights(PutRequest("small", small), kTimeout);
  ASSERT_TRUE(small_put.ok()) << small_put.status();
  absl::StatusOr<v1::PutWeightsResponse> big_put =
      client_->PutWeights(PutRequest("big", big), kTimeout);
  ASSERT_TRUE(big_put.ok()) << big_put.status();
  absl::StatusOr<v1::ListWeightsResponse> list = client_->ListWeights(kTimeout);
  ASSERT_TRUE(list.ok()) << list.status();
  const v1::WeightsInfo* demo = FindInfo(*list, "demo");
  ASSERT_NE(demo, nullptr);
  const int64_t demo_bytes = demo->bytes();
  const int64_t small_bytes = small_put->bytes();
  const int64_t big_bytes = big_put->bytes();
  ASSERT_GT(big_bytes, small_bytes);

  // Room for demo and either set, not both.
  ServerOptions options = DefaultOptions();
  options.max_weights_bytes = demo_bytes + small_bytes + big_bytes - 1;
  StartServer(options);
  if (HasFatalFailure()) return;

  small_put = client_->PutWeights(PutRequest("small", small), kTimeout);
  ASSERT_TRUE(small_put.ok()) << small_put.status();
  const absl::Status refused =
      client_->PutWeights(PutRequest("big", big), kTimeout).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr(absl::StrCat("weights 'big' need ", big_bytes)));
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr(absl::StrCat("holds ", demo_bytes + small_bytes)));
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr(absl::StrCat("--max_weights_bytes limit of ",
                                     options.max_weights_bytes)));

  list = client_->ListWeights(kTimeout);
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_THAT(NamesOf(*list), ElementsAre("demo", "small"));
  EXPECT_EQ(list->total_bytes(), demo_bytes + small_bytes);
  v1::MultiHeadAttentionRequest request =
      MakeRequest(kSelfShape, 3, /*cross=*/false);
  request.set_weights_name("small");
  absl::StatusOr<v1::MultiHeadAttentionResponse> response =
      client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  ExpectNear(response->output(), Expected(kSelfShape, request, small).output,
             kAbs, kRel, "output");

  // Replacing a set counts the bytes it frees; deleting makes room.
  EXPECT_TRUE(client_->PutWeights(PutRequest("small", small), kTimeout).ok());
  ASSERT_TRUE(client_->DeleteWeights("small", kTimeout).ok());
  const absl::StatusOr<v1::PutWeightsResponse> fits =
      client_->PutWeights(PutRequest("big", big), kTimeout);
  EXPECT_TRUE(fits.ok()) << fits.status();
}

TEST_F(WeightsLimitTest, StartFailsWhenDemoWeightsDoNotFit) {
  ServerOptions options = DefaultOptions();
  options.max_weights_bytes = 1000;
  const absl::StatusOr<std::unique_ptr<AttnServer>> server =
      AttnServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kResourceExhausted)
      << server.status();
  EXPECT_THAT(std::string(server.status().message()),
              HasSubstr("weights 'demo'"));
  EXPECT_THAT(std::string(server.status().message()),
              HasSubstr("--max_weights_bytes limit of 1000"));
}

// ---------------------------------------------------------------------------
// --weights_dir.

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the .npy files below are written little-endian in place");

// The bytes of a .npy v1.0 file of `descr` ('<f4' or '<f8') holding `values`.
std::string NpyBytes(const std::string& descr,
                     const std::vector<int64_t>& shape,
                     const std::vector<float>& values) {
  const std::string dims = shape.size() == 1 ? absl::StrCat(shape[0], ",")
                                             : absl::StrJoin(shape, ", ");
  std::string header =
      absl::StrCat("{'descr': '", descr,
                   "', 'fortran_order': False, 'shape': (", dims, "), }");
  // Pad with spaces so that magic, version, length and header end on a
  // multiple of 64 bytes, the last being '\n'.
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');
  header.push_back('\n');
  std::string bytes("\x93NUMPY\x01\x00", 8);
  bytes.push_back(static_cast<char>(header.size() & 0xff));
  bytes.push_back(static_cast<char>(header.size() >> 8));
  bytes += header;
  if (descr == "<f8") {
    for (float value : values) {
      const double wide = value;
      bytes.append(reinterpret_cast<const char*>(&wide), sizeof(wide));
    }
  } else {
    bytes.append(reinterpret_cast<const char*>(values.data()),
                 values.size() * sizeof(float));
  }
  return bytes;
}

class WeightsDirTest : public ServerFixture {
 protected:
  void SetUp() override {
    root_ = std::filesystem::path(::testing::TempDir()) /
            absl::StrCat(
                "weights_test_",
                ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                "_", getpid());
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
  }

  void TearDown() override {
    std::error_code error;
    std::filesystem::remove_all(root_, error);
  }

  static void WriteFile(const std::filesystem::path& path,
                        const std::string& contents) {
    std::ofstream file(path, std::ios::binary);
    file << contents;
    ASSERT_TRUE(file.good()) << path;
  }

  // Writes `weights` as folder `name` of root_: config.txt and one .npy per
  // tensor present.
  void WriteFolder(const std::string& name, const std::string& config,
                   const v1::ProjectionWeights& weights,
                   const std::string& descr) {
    const std::filesystem::path folder = root_ / name;
    std::filesystem::create_directories(folder);
    if (!config.empty()) WriteFile(folder / "config.txt", config);
    const std::pair<const char*, const v1::Tensor*> tensors[] = {
        {"w_q", weights.has_w_q() ? &weights.w_q() : nullptr},
        {"w_k", weights.has_w_k() ? &weights.w_k() : nullptr},
        {"w_v", weights.has_w_v() ? &weights.w_v() : nullptr},
        {"w_o", weights.has_w_o() ? &weights.w_o() : nullptr},
        {"b_q", weights.has_b_q() ? &weights.b_q() : nullptr},
        {"b_k", weights.has_b_k() ? &weights.b_k() : nullptr},
        {"b_v", weights.has_b_v() ? &weights.b_v() : nullptr},
        {"b_o", weights.has_b_o() ? &weights.b_o() : nullptr},
    };
    for (const auto& [file, tensor] : tensors) {
      if (tensor == nullptr) continue;
      const std::vector<int64_t> shape(tensor->shape().begin(),
                                       tensor->shape().end());
      WriteFile(folder / absl::StrCat(file, ".npy"),
                NpyBytes(descr, shape, ValuesOf(*tensor)));
    }
  }

  std::filesystem::path root_;
};

TEST_F(WeightsDirTest, NpyHelperWritesAlignedVersionOneHeader) {
  const std::string bytes = NpyBytes("<f4", {8, 4}, std::vector<float>(32));
  ASSERT_GT(bytes.size(), 10u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  const size_t header_length = static_cast<unsigned char>(bytes[8]) |
                               (static_cast<unsigned char>(bytes[9]) << 8);
  EXPECT_EQ((10 + header_length) % 64, 0u);
  EXPECT_EQ(bytes[10 + header_length - 1], '\n');
  EXPECT_EQ(bytes.size(), 10 + header_length + 32 * sizeof(float));
  EXPECT_THAT(bytes.substr(10, header_length),
              HasSubstr("{'descr': '<f4', 'fortran_order': False, "
                        "'shape': (8, 4), }"));
}

TEST_F(WeightsDirTest, FoldersAreRegisteredAtStartAndMatchReference) {
  // "tiny": E = 4, H = Hkv = 2, Dk = 4, Dv = 3, b_q only; w_q is (8, 4).
  const ReferenceMhaShape tiny{2, 3, 3, 4, 4, 2, 2, 4, 3};
  v1::ProjectionWeights tiny_weights = MakeWeights(tiny, 500, Biases::kNone);
  *tiny_weights.mutable_b_q() = RandomTensor(v1::FLOAT32, {8}, 505, 0.5f);
  WriteFolder("tiny", "num_heads=2\n", tiny_weights, "<f4");
  // "gqa64": float64 files, grouped-query, Ekv != E, a comment in config.txt.
  const ReferenceMhaShape gqa{2, 3, 4, 6, 5, 4, 2, 2, 2};
  const v1::ProjectionWeights gqa_weights = MakeWeights(gqa, 600);
  WriteFolder("gqa64", "# grouped-query\nnum_heads=4\nnum_kv_heads=2\n",
              gqa_weights, "<f8");
  WriteFile(root_ / "README.txt", "not a folder: ignored\n");
  if (HasFatalFailure()) return;

  ServerOptions options = DefaultOptions();
  options.weights_dir = root_.string();
  StartServer(options);
  if (HasFatalFailure()) return;
  EXPECT_THAT(server_->startup_weights(), ElementsAre("demo", "gqa64", "tiny"));

  absl::StatusOr<v1::ListWeightsResponse> list = client_->ListWeights(kTimeout);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_THAT(NamesOf(*list), ElementsAre("demo", "gqa64", "tiny"));
  ExpectDims(list->weights(1), gqa, /*has_bias=*/true);
  ExpectDims(list->weights(2), tiny, /*has_bias=*/true);

  for (const bool cross : {false, true}) {
    SCOPED_TRACE(cross ? "tiny, cross-attention" : "tiny, self-attention");
    ReferenceMhaShape s = tiny;
    if (cross) s.key_len = 5;
    v1::MultiHeadAttentionRequest request = MakeRequest(s, 700, cross);
    request.set_weights_name("tiny");
    absl::StatusOr<v1::MultiHeadAttentionResponse> response =
        client_->MultiHeadAttention(request, kTimeout);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->weights_version(), list->weights(2).version());
    ExpectNear(response->output(), Expected(s, request, tiny_weights).output,
               kAbs, kRel, "output");
  }

  v1::MultiHeadAttentionRequest request = MakeRequest(gqa, 800, true);
  request.set_weights_name("gqa64");
  absl::StatusOr<v1::MultiHeadAttentionResponse> response =
      client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  ExpectNear(response->output(), Expected(gqa, request, gqa_weights).output,
             kAbs, kRel, "gqa64 output");
}

TEST_F(WeightsDirTest, FolderWithoutConfigFailsStartNamingTheFolder) {
  const ReferenceMhaShape tiny{1, 1, 1, 4, 4, 2, 2, 4, 4};
  WriteFolder("broken", /*config=*/"", MakeWeights(tiny, 900), "<f4");
  if (HasFatalFailure()) return;
  ServerOptions options = DefaultOptions();
  options.weights_dir = root_.string();
  const absl::StatusOr<std::unique_ptr<AttnServer>> server =
      AttnServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kNotFound)
      << server.status();
  const std::string message(server.status().message());
  EXPECT_THAT(message, HasSubstr((root_ / "broken").string()));
  EXPECT_THAT(message, HasSubstr("config.txt is missing"));
}

TEST_F(WeightsDirTest, MissingWeightsDirFailsStartNamingIt) {
  ServerOptions options = DefaultOptions();
  options.weights_dir = (root_ / "does-not-exist").string();
  const absl::StatusOr<std::unique_ptr<AttnServer>> server =
      AttnServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()),
              HasSubstr(options.weights_dir));
}

}  // namespace
}  // namespace attnserve
