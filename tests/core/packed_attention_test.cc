// AttendPacked (FlashAttention's varlen layout) against the reference run on
// each sequence alone: random lengths (empty sequences and sequences without
// keys among them), every option it takes, f32 and bf16, fused and unfused;
// and its refusals.
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/core/attention_engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"
#include "reference/tolerance.h"

namespace attnserve {
namespace {

using ::attnserve::testing::ExpectNear;
using ::attnserve::testing::PackedRowsAsHeads;
using ::attnserve::testing::RandomValues;
using ::attnserve::testing::ReferenceAttention;
using ::attnserve::testing::ReferenceOptions;
using ::attnserve::testing::ReferenceResult;
using ::testing::HasSubstr;

class PackedAttentionTest : public ::testing::TestWithParam<AttentionKernel> {};

TEST_P(PackedAttentionTest, EachSequenceEqualsItsOwnAttend) {
  EngineOptions engine_options;
  engine_options.kernel = GetParam();
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(engine_options).value();
  std::mt19937_64 rng(2212);
  const auto pick = [&rng](std::initializer_list<int64_t> values) {
    return *(values.begin() +
             std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng));
  };
  for (int round = 0; round < 30; ++round) {
    PackedShape shape;
    shape.kv_heads = pick({1, 2});
    shape.heads = shape.kv_heads * pick({1, 3});
    shape.key_dim = pick({8, 16, 33});
    shape.value_dim = pick({8, 5});
    std::vector<int64_t> cu_q = {0}, cu_k = {0};
    const int64_t sequences = pick({1, 2, 5});
    for (int64_t s = 0; s < sequences; ++s) {
      const int64_t lk = pick({0, 1, 7, 70, 300});
      const int64_t lq = pick({0, 1, 5, 64, 100});
      cu_q.push_back(cu_q.back() + lq);
      cu_k.push_back(cu_k.back() + lk);
    }
    shape.cu_seqlens_q = cu_q;
    shape.cu_seqlens_k = cu_k;
    AttentionOptions options;
    ReferenceOptions reference;
    if (pick({0, 1}) == 1) {
      options.causal = reference.causal = true;
      reference.bottom_right = pick({0, 1}) == 1;
      options.causal_alignment = reference.bottom_right
                                     ? CausalAlignment::kBottomRight
                                     : CausalAlignment::kTopLeft;
    }
    if (pick({0, 1}) == 1) {
      options.window_left = reference.window_left = pick({0, 3, 40});
      options.num_sink_tokens = reference.num_sink_tokens = pick({0, 2});
    }
    std::vector<float> slopes;
    if (pick({0, 1}) == 1) {
      for (int64_t h = 0; h < shape.heads; ++h)
        slopes.push_back(0.1f * (h + 1));
      options.alibi_slopes = slopes;
      reference.alibi_slopes.assign(slopes.begin(), slopes.end());
    }
    if (pick({0, 1}) == 1) {
      options.softcap = 3.0f;
      reference.softcap = 3.0;
    }
    options.return_lse = true;
    const bool bf16 = pick({0, 0, 1}) == 1;
    if (bf16) options.precision = Precision::kBFloat16;
    const int64_t total_q = cu_q.back(), total_k = cu_k.back();
    const std::vector<float> query =
        RandomValues(total_q * shape.heads * shape.key_dim, round * 3 + 1);
    const std::vector<float> key =
        RandomValues(total_k * shape.kv_heads * shape.key_dim, round * 3 + 2);
    const std::vector<float> value =
        RandomValues(total_k * shape.kv_heads * shape.value_dim, round * 3 + 3);
    std::vector<float> output(total_q * shape.heads * shape.value_dim, -7.0f);
    std::vector<float> lse(total_q * shape.heads, -7.0f);
    SCOPED_TRACE(absl::StrCat("round ", round, " H=", shape.heads,
                              " Hkv=", shape.kv_heads, " Dk=", shape.key_dim,
                              " Dv=", shape.value_dim, " bf16=", bf16));
    const absl::Status status = engine->AttendPacked(
        shape, options, query, key, value,
        AttentionOutputs(absl::MakeSpan(output), {}, absl::MakeSpan(lse)));
    ASSERT_TRUE(status.ok()) << status;
    for (int64_t s = 0; s < sequences; ++s) {
      const int64_t q0 = cu_q[s], lq = cu_q[s + 1] - q0;
      const int64_t k0 = cu_k[s], lk = cu_k[s + 1] - k0;
      if (lq == 0) continue;
      SCOPED_TRACE(absl::StrCat("sequence ", s, ": Lq ", lq, " Lk ", lk));
      std::vector<double> expected_output(lq * shape.heads * shape.value_dim,
                                          0.0);
      std::vector<double> expected_lse(
          lq * shape.heads, -std::numeric_limits<double>::infinity());
      if (lk > 0) {
        const ReferenceResult r = ReferenceAttention(
            {1, shape.heads, shape.kv_heads, lq, lk, shape.key_dim,
             shape.value_dim},
            PackedRowsAsHeads(query, q0, lq, shape.heads, shape.key_dim),
            PackedRowsAsHeads(key, k0, lk, shape.kv_heads, shape.key_dim),
            PackedRowsAsHeads(value, k0, lk, shape.kv_heads, shape.value_dim),
            reference);
        // [H, Lq, Dv] → token-major [Lq, H, Dv].
        for (int64_t h = 0; h < shape.heads; ++h) {
          for (int64_t i = 0; i < lq; ++i) {
            for (int64_t d = 0; d < shape.value_dim; ++d) {
              expected_output[(i * shape.heads + h) * shape.value_dim + d] =
                  r.output[(h * lq + i) * shape.value_dim + d];
            }
            expected_lse[h * lq + i] = r.lse[h * lq + i];
          }
        }
      }
      const std::vector<float> got_output(
          output.begin() + q0 * shape.heads * shape.value_dim,
          output.begin() + (q0 + lq) * shape.heads * shape.value_dim);
      std::vector<float> got_lse;
      for (int64_t h = 0; h < shape.heads; ++h) {
        got_lse.insert(got_lse.end(), lse.begin() + h * total_q + q0,
                       lse.begin() + h * total_q + q0 + lq);
      }
      ExpectNear("output", got_output, expected_output,
                 bf16 ? testing::kOutputBf16 : testing::kOutputF32);
      ExpectNear("lse", got_lse, expected_lse,
                 bf16 ? testing::kLseBf16 : testing::kLseF32);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_P(PackedAttentionTest, RefusalsNameTheirField) {
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(EngineOptions{}).value();
  PackedShape shape;
  shape.key_dim = shape.value_dim = 2;
  std::vector<float> q(6), k(6), v(6), out(6);
  const auto attend = [&](std::vector<int64_t> cu_q, std::vector<int64_t> cu_k,
                          const AttentionOptions& options = {}) {
    shape.cu_seqlens_q = cu_q;
    shape.cu_seqlens_k = cu_k;
    return std::string(
        engine->AttendPacked(shape, options, q, k, v, absl::MakeSpan(out))
            .message());
  };
  EXPECT_THAT(attend({0, 3}, {0, 1, 3}), HasSubstr("expected the same number"));
  EXPECT_THAT(attend({1, 3}, {0, 3}),
              HasSubstr("options.cu_seqlens_q[0] is 1, expected 0"));
  EXPECT_THAT(attend({0, 2, 1, 3}, {0, 1, 2, 3}),
              HasSubstr("options.cu_seqlens_q[2] is 1, expected >= "
                        "options.cu_seqlens_q[1] = 2"));
  EXPECT_THAT(attend({0, 3}, {0, 4}),
              HasSubstr("key has 6 elements, expected 8"));
  AttentionOptions weights;
  weights.weights = AttentionWeightsMode::kPerHead;
  EXPECT_THAT(attend({0, 3}, {0, 3}, weights),
              HasSubstr("do not combine with packed sequences"));
}

INSTANTIATE_TEST_SUITE_P(Kernels, PackedAttentionTest,
                         ::testing::Values(AttentionKernel::kAuto,
                                           AttentionKernel::kUnfused));

}  // namespace
}  // namespace attnserve
