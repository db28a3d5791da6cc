// MultiHeadAttention with inline projection weights against the naive
// reference: self- and cross-attention, grouped-query, biases, bfloat16,
// precision, and the returned attention weights and log-sum-exp.
#include <utility>

#include "absl/status/statusor.h"
#include "attnserve/client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"
#include "server/server_fixture.h"
#include "server/weights_helpers.h"

namespace attnserve {
namespace {

using ::attnserve::testing::Biases;
using ::attnserve::testing::Expected;
using ::attnserve::testing::ExpectNear;
using ::attnserve::testing::HeadMean;
using ::attnserve::testing::kAbs;
using ::attnserve::testing::kCrossShape;
using ::attnserve::testing::kRel;
using ::attnserve::testing::kSelfShape;
using ::attnserve::testing::kTimeout;
using ::attnserve::testing::MakeRequest;
using ::attnserve::testing::MakeWeights;
using ::attnserve::testing::ReferenceMhaShape;
using ::attnserve::testing::ReferenceResult;
using ::attnserve::testing::ServerFixture;
using ::testing::ElementsAre;

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

}  // namespace
}  // namespace attnserve
