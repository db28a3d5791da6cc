// RoPE in MultiHeadAttention, and the attention variants through it, against
// the double-precision reference: both pairings, a partial rotary dim,
// default and explicit positions, self-attention through the stacked QKV
// projection and cross-attention through three, f32 and bf16; and the
// refusals, each naming its field.
#include "attnserve/core/rotary.h"

#include <cmath>
#include <memory>
#include <optional>
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
using ::attnserve::testing::RandomValues;
using ::attnserve::testing::ReferenceMhaShape;
using ::attnserve::testing::ReferenceMhaWeights;
using ::attnserve::testing::ReferenceMultiHeadAttention;
using ::attnserve::testing::ReferenceOptions;
using ::attnserve::testing::ReferenceResult;
using ::attnserve::testing::ReferenceRope;
using ::testing::HasSubstr;

// Weights uniform in ±1/sqrt(fan in), as torch.nn.Linear draws them.
std::vector<float> Linear(int64_t out, int64_t in, uint64_t seed) {
  std::vector<float> w = RandomValues(out * in, seed);
  for (float& x : w) x /= std::sqrt(static_cast<float>(in));
  return w;
}

struct Case {
  bool self_attention;
  bool stacked;  // self-attention through w_qkv
  bool interleaved;
  int64_t rotary_dim;
  bool positions;
  bool variants;  // a window, sinks, ALiBi and a softcap too
  Precision precision;
};

std::string Describe(const Case& c) {
  return absl::StrCat("self=", c.self_attention, " stacked=", c.stacked,
                      " interleaved=", c.interleaved,
                      " rotary_dim=", c.rotary_dim, " positions=", c.positions,
                      " variants=", c.variants,
                      " bf16=", c.precision == Precision::kBFloat16);
}

void RunCase(AttentionEngine& engine, const Case& c) {
  SCOPED_TRACE(Describe(c));
  MultiHeadShape s;
  s.batch = 2;
  s.query_len = 9;
  s.key_len = c.self_attention ? 9 : 13;
  s.embed_dim = 24;
  s.kv_embed_dim = c.self_attention ? 24 : 20;
  s.heads = 4;
  s.kv_heads = 2;
  s.key_dim = 16;
  s.value_dim = 8;
  ReferenceMhaWeights w;
  w.w_q = Linear(s.heads * s.key_dim, s.embed_dim, 1);
  w.w_k = Linear(s.kv_heads * s.key_dim, s.kv_embed_dim, 2);
  w.w_v = Linear(s.kv_heads * s.value_dim, s.kv_embed_dim, 3);
  w.w_o = Linear(s.embed_dim, s.heads * s.value_dim, 4);
  w.b_q = RandomValues(s.heads * s.key_dim, 5);
  w.b_k = RandomValues(s.kv_heads * s.key_dim, 6);
  w.b_v = RandomValues(s.kv_heads * s.value_dim, 7);
  const std::vector<float> query_input =
      RandomValues(s.batch * s.query_len * s.embed_dim, 8);
  const std::vector<float> kv_input =
      c.self_attention ? std::vector<float>()
                       : RandomValues(s.batch * s.key_len * s.kv_embed_dim, 9);

  ProjectionWeights projection;
  projection.w_q = w.w_q;
  projection.w_k = w.w_k;
  projection.w_v = w.w_v;
  projection.w_o = w.w_o;
  projection.b_q = w.b_q;
  projection.b_k = w.b_k;
  projection.b_v = w.b_v;
  std::vector<float> w_qkv, b_qkv;
  if (c.stacked) {
    for (const auto* part : {&w.w_q, &w.w_k, &w.w_v}) {
      w_qkv.insert(w_qkv.end(), part->begin(), part->end());
    }
    for (const auto* part : {&w.b_q, &w.b_k, &w.b_v}) {
      b_qkv.insert(b_qkv.end(), part->begin(), part->end());
    }
    projection.w_qkv = w_qkv;
    projection.b_qkv = b_qkv;
  }
  RotaryEmbedding rope;
  rope.theta = 500.0f;
  rope.rotary_dim = c.rotary_dim;
  rope.interleaved = c.interleaved;
  projection.rope = rope;
  ReferenceRope reference_rope;
  reference_rope.theta = 500.0;
  reference_rope.rotary_dim = c.rotary_dim;
  reference_rope.interleaved = c.interleaved;

  AttentionOptions options;
  ReferenceOptions reference;
  options.precision = c.precision;
  std::vector<int64_t> query_positions, key_positions;
  if (c.positions) {
    // Positions as a KV cache continues them: keys 100 on, queries at the
    // last ones; batch item 1 further along.
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t i = 0; i < s.query_len; ++i) {
        query_positions.push_back(100 + 1000 * b + s.key_len - s.query_len + i);
      }
      for (int64_t j = 0; j < s.key_len; ++j) {
        key_positions.push_back(100 + 1000 * b + j);
      }
    }
    options.query_positions = query_positions;
    options.key_positions = key_positions;
    reference_rope.query_positions = query_positions;
    reference_rope.key_positions = key_positions;
  }
  std::vector<float> slopes;
  if (c.variants) {
    options.causal = reference.causal = true;
    options.causal_alignment = CausalAlignment::kBottomRight;
    reference.bottom_right = true;
    options.window_left = reference.window_left = 3;
    options.num_sink_tokens = reference.num_sink_tokens = 1;
    slopes = {0.5f, 0.25f, 0.125f, 0.0625f};
    options.alibi_slopes = slopes;
    reference.alibi_slopes.assign(slopes.begin(), slopes.end());
    options.softcap = 2.5f;
    reference.softcap = 2.5;
  }
  std::vector<float> output(query_input.size());
  const absl::Status status = engine.MultiHeadAttention(
      s, projection, options, query_input, kv_input, absl::MakeSpan(output));
  ASSERT_TRUE(status.ok()) << status;
  const ReferenceResult expected = ReferenceMultiHeadAttention(
      ReferenceMhaShape{s.batch, s.query_len, s.key_len, s.embed_dim,
                        s.kv_embed_dim, s.heads, s.kv_heads, s.key_dim,
                        s.value_dim},
      query_input, kv_input, w, reference, reference_rope);
  ExpectNear("output", output, expected.output,
             c.precision == Precision::kBFloat16 ? testing::kOutputBf16
                                                 : testing::kOutputF32);
}

TEST(RotaryTest, MultiHeadAttentionMatchesTheReference) {
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(EngineOptions{}).value();
  for (const bool self_attention : {true, false}) {
    for (const bool interleaved : {false, true}) {
      for (const int64_t rotary_dim : {0, 8}) {
        for (const bool positions : {false, true}) {
          RunCase(*engine,
                  {self_attention, self_attention && positions, interleaved,
                   rotary_dim, positions, false, Precision::kFloat32});
        }
      }
    }
  }
  RunCase(*engine, {true, true, false, 0, true, true, Precision::kFloat32});
  RunCase(*engine, {false, false, true, 8, false, true, Precision::kBFloat16});
}

// The rotation itself on a vector whose answer is known: a quarter turn of
// pair 0 at position 1 when theta^0 · 1 = π / 2 is not reachable, so check
// position 0 (identity) and the norm kept at a large position.
TEST(RotaryTest, PositionZeroIsIdentityAndEveryTurnKeepsTheNorm) {
  std::vector<float> head = RandomValues(32, 11);
  const std::vector<float> original = head;
  RotaryEmbedding rope;
  ApplyRotary(rope, 32, 1, head.data(), 1, 32, 0);
  EXPECT_EQ(head, original);
  ApplyRotary(rope, 32, 1, head.data(), 1, 32, 123456);
  for (int64_t m = 0; m < 16; ++m) {
    const double before = std::hypot(original[m], original[m + 16]);
    const double after = std::hypot(head[m], head[m + 16]);
    EXPECT_NEAR(after, before, 1e-6) << m;
  }
  // Pair 0 turns by the position itself (theta^0 = 1): at position 2, by 2
  // radians.
  std::vector<float> unit(4, 0.0f);
  unit[0] = 1.0f;  // pair 0 is (0, 2) half-split
  ApplyRotary(rope, 4, 1, unit.data(), 1, 4, 2);
  EXPECT_NEAR(unit[0], std::cos(2.0), 1e-7);
  EXPECT_NEAR(unit[2], std::sin(2.0), 1e-7);
}

TEST(RotaryTest, RefusalsNameTheirField) {
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(EngineOptions{}).value();
  MultiHeadShape s;
  s.batch = 1;
  s.query_len = s.key_len = 3;
  s.embed_dim = s.kv_embed_dim = 8;
  s.heads = s.kv_heads = 2;
  s.key_dim = s.value_dim = 4;
  const std::vector<float> w = RandomValues(64, 1);
  const std::vector<float> input = RandomValues(24, 2);
  std::vector<float> output(24);
  ProjectionWeights projection;
  projection.w_q = projection.w_k = projection.w_v = projection.w_o = w;
  const auto refused = [&](const ProjectionWeights& p,
                           const AttentionOptions& o) {
    return engine->MultiHeadAttention(s, p, o, input, {},
                                      absl::MakeSpan(output));
  };
  AttentionOptions options;
  const std::vector<int64_t> positions = {0, 1, 2};
  options.query_positions = positions;
  EXPECT_THAT(refused(projection, options).message(),
              HasSubstr("without RoPE"));
  ProjectionWeights with_rope = projection;
  with_rope.rope = RotaryEmbedding{10000.0f, 3, false};
  EXPECT_THAT(refused(with_rope, {}).message(),
              HasSubstr("weights.rope.rotary_dim is 3, expected 0 (the whole "
                        "head) or an even number from 2 to the head dim 4"));
  with_rope.rope = RotaryEmbedding{1.0f, 0, false};
  EXPECT_THAT(
      refused(with_rope, {}).message(),
      HasSubstr("weights.rope.theta is 1, expected a finite number > 1"));
  with_rope.rope = RotaryEmbedding{};
  const std::vector<int64_t> short_positions = {0, 1};
  options.query_positions = short_positions;
  EXPECT_THAT(refused(with_rope, options).message(),
              HasSubstr("options.query_positions has 2 elements, expected 3"));
  const std::vector<int64_t> negative = {0, -1, 2};
  options.query_positions = negative;
  EXPECT_THAT(refused(with_rope, options).message(),
              HasSubstr("options.query_positions[1] is -1, expected 0 to"));
  // Attend takes no positions.
  AttentionShape shape;
  shape.key_dim = shape.value_dim = 4;
  std::vector<float> one(4), out(4);
  AttentionOptions attend;
  attend.key_positions = positions;
  EXPECT_THAT(engine->Attend(shape, attend, one, one, one, absl::MakeSpan(out))
                  .message(),
              HasSubstr("are for MultiHeadAttention with RoPE"));
}

}  // namespace
}  // namespace attnserve
