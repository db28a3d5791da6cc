// A deliberately naive attention, for tests only.
//
// It shares no code with core/: loops straight from the definitions in
// docs/api.md, double accumulation, an explicit max-subtracted softmax, masks
// applied element by element. Slow by design; keep test shapes small.
#ifndef ATTNSERVE_TESTS_REFERENCE_REFERENCE_ATTENTION_H_
#define ATTNSERVE_TESTS_REFERENCE_REFERENCE_ATTENTION_H_

#include <cstdint>
#include <optional>
#include <vector>

namespace attnserve::testing {

struct ReferenceShape {
  int64_t batch, heads, kv_heads, query_len, key_len, key_dim, value_dim;
};

// A mask of rank 1 to 4, broadcastable to [B, H, Lq, Lk] (aligned from the
// right).
struct ReferenceMask {
  std::vector<int64_t> shape;
  std::vector<uint8_t>
      allowed;              // Boolean mask (nonzero = may attend), or empty.
  std::vector<float> bias;  // Float mask added to the scores, or empty.
};

struct ReferenceOptions {
  std::optional<double> scale;  // Default 1 / sqrt(Dk).
  bool causal = false;
  // The alignment (bottom-right uses key_lengths[b]): of the causal edge,
  // the window and ALiBi's distances, whether causal or not.
  bool bottom_right = false;
  std::vector<int64_t> key_lengths;  // Empty: all Lk keys valid.
  std::optional<ReferenceMask> mask;
  // Query i (at position p = i + offset) sees key j only if p − window_left
  // <= j <= p + window_right (−1: unbounded), or j < num_sink_tokens.
  int64_t window_left = -1;
  int64_t window_right = -1;
  int64_t num_sink_tokens = 0;
  std::vector<double> alibi_slopes;  // Empty, or H: − slope · |p − j|.
  std::optional<double> softcap;     // x → softcap · tanh(x / softcap).
};

// RoPE of the multi-head reference: pair m of a token at position p turns by
// p · theta^(−2m / rotary_dim); pairs (2m, 2m + 1) if interleaved, else (m, m
// + rotary_dim / 2).
struct ReferenceRope {
  double theta = 10000.0;
  int64_t rotary_dim = 0;  // 0: the head dim
  bool interleaved = false;
  std::vector<int64_t> query_positions, key_positions;  // [B, L]; empty: 0..L−1
};

struct ReferenceResult {
  std::vector<double> output;   // SDPA [B, H, Lq, Dv]; MHA [B, Lq, E].
  std::vector<double> weights;  // [B, H, Lq, Lk]
  std::vector<double> lse;  // [B, H, Lq]; −inf for a row with no key to attend.
};

// SDPA: query [B, H, Lq, Dk], key [B, Hkv, Lk, Dk], value [B, Hkv, Lk, Dv];
// query head h reads kv head h / (H / Hkv).
ReferenceResult ReferenceAttention(const ReferenceShape& shape,
                                   const std::vector<float>& query,
                                   const std::vector<float>& key,
                                   const std::vector<float>& value,
                                   const ReferenceOptions& options = {});

// [B, Lq, Lk]: the mean over heads of weights [B, H, Lq, Lk].
std::vector<double> HeadMean(const std::vector<double>& weights, int64_t batch,
                             int64_t heads, int64_t query_len, int64_t key_len);

struct ReferenceMhaShape {
  int64_t batch, query_len, key_len, embed_dim, kv_embed_dim, heads, kv_heads,
      key_dim, value_dim;
};

// torch.nn.Linear layout: w [out, in]; empty bias = none.
struct ReferenceMhaWeights {
  std::vector<float> w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o;
};

// Multi-head attention (batch first): query_input [B, Lq, E], kv_input [B, Lk,
// Ekv] (empty: self-attention on query_input). Projections are computed in
// double.
ReferenceResult ReferenceMultiHeadAttention(
    const ReferenceMhaShape& shape, const std::vector<float>& query_input,
    const std::vector<float>& kv_input, const ReferenceMhaWeights& weights,
    const ReferenceOptions& options = {},
    const std::optional<ReferenceRope>& rope = std::nullopt);

// Rows [first, first + count) of a token-major [total, heads, dim] tensor
// (packed sequences) as [1, heads, count, dim], for the reference.
std::vector<float> PackedRowsAsHeads(const std::vector<float>& packed,
                                     int64_t first, int64_t count,
                                     int64_t heads, int64_t dim);

// `count` values uniform in [-1, 1) from a fixed-seed generator.
std::vector<float> RandomValues(int64_t count, uint64_t seed);

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_REFERENCE_REFERENCE_ATTENTION_H_
