// What a call does to its scores beyond scaling them: a logit softcap, ALiBi's
// distance penalty, and the keys a window and attention sinks hide. The three
// kernels (fused, unfused, paged) keep their fast code for calls without any
// of these, and run ModifyScores over each block of scores of a call with
// them, so that every kernel computes the same formula:
//
//   x_j = softcap · tanh(scale · s_j / softcap) − slope · |position − j|
//         + bias_j,  or −inf for a key the row does not see.
#ifndef ATTNSERVE_CORE_INTERNAL_SCORE_MODS_H_
#define ATTNSERVE_CORE_INTERNAL_SCORE_MODS_H_

#include <cstdint>

#include "attnserve/core/attention_types.h"
#include "internal/tile_kernels.h"
#include "internal/visibility.h"

namespace attnserve::internal {

// Whether `options` ask for a window, sinks, ALiBi or a softcap.
inline bool HasScoreMods(const AttentionOptions& options) {
  return options.window_left >= 0 || options.window_right >= 0 ||
         options.num_sink_tokens > 0 || !options.alibi_slopes.empty() ||
         options.softcap.has_value();
}

// One row's softcap and ALiBi terms.
struct RowScoreMods {
  float softcap = 0.0f;  // 0: none
  float slope = 0.0f;    // ALiBi slope of the row's head; 0: none
  int64_t position = 0;  // QueryPosition of the row
};

// The softcap and ALiBi terms of query head `head` at `position`.
inline RowScoreMods ModsOf(const AttentionOptions& options, int64_t head,
                           int64_t position) {
  RowScoreMods mods;
  mods.softcap = options.softcap.value_or(0.0f);
  if (!options.alibi_slopes.empty()) {
    mods.slope = options.alibi_slopes[static_cast<size_t>(head)];
  }
  mods.position = position;
  return mods;
}

// Rewrites the raw scores s[0, n) of keys [k0, k0 + n) of one row as the
// scores its softmax takes (the formula above); `mask` holds the row's mask
// entries from key k0 (none if both are null).
void ModifyScores(float* s, int64_t n, int64_t k0, float scale,
                  const RowKeys& keys, const RowScoreMods& mods,
                  const RowMask& mask);

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_SCORE_MODS_H_
