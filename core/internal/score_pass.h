// The pass between the two matmuls of the unfused path: turns one slab of
// scaled scores into attention probabilities, applying what decides which keys
// each query sees.
#ifndef ATTNSERVE_CORE_INTERNAL_SCORE_PASS_H_
#define ATTNSERVE_CORE_INTERNAL_SCORE_PASS_H_

#include <cstdint>

#include "absl/types/span.h"
#include "attnserve/core/attention_types.h"
#include "internal/matmul.h"

namespace attnserve::internal {

// A slab: batch items [first_batch, first_batch + batch_count), kv heads
// [first_kv_head, first_kv_head + kv_head_count) and query rows
// [first_query, first_query + query_count), whose scores are packed as
// [batch_count, kv_head_count, H / Hkv, query_count, Lk].
struct ScoreSlab {
  int64_t first_batch = 0;
  int64_t batch_count = 0;
  int64_t first_kv_head = 0;
  int64_t kv_head_count = 0;
  int64_t first_query = 0;
  int64_t query_count = 0;
};

// For every row of `scores` (already multiplied by the scale): applies the
// softcap and ALiBi (internal/score_mods.h), adds a float mask, drops keys
// that a boolean mask, causality, key_lengths, a window or sinks exclude, and
// replaces the row by its softmax. A row with no key left becomes zeros. Writes
// each row's log-sum-exp to `lse` and the probabilities to `weights` if
// `options` ask for them (head-mean weights accumulate: the caller zeroes them
// before the first slab). The probabilities the context matmul reads are left
// as `input` says: f32 in `scores` (kF32), rounded to bf16 values in `scores`
// (kRoundedF32), or as bf16 in `probabilities_bf16` (kBf16: same packing,
// `scores` left undefined).
// Runs on the calling thread's OpenMP team.
void SoftmaxScoreSlab(const AttentionShape& shape,
                      const AttentionOptions& options, const ScoreSlab& slab,
                      float* scores, MatmulInput input,
                      uint16_t* probabilities_bf16, absl::Span<float> weights,
                      absl::Span<float> lse);

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_SCORE_PASS_H_
