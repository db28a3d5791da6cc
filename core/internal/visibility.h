// Which keys a query row may see: the bounds that causality and key_lengths
// put on a row, and the strides of a mask broadcast to [B, H, Lq, Lk]. Shared
// by the unfused score pass and the fused kernel so that both draw the same
// lines.
#ifndef ATTNSERVE_CORE_INTERNAL_VISIBILITY_H_
#define ATTNSERVE_CORE_INTERNAL_VISIBILITY_H_

#include <algorithm>
#include <cstdint>

#include "attnserve/core/attention_types.h"

namespace attnserve::internal {

// One past the last key query `query` of batch item `batch` may see, before any
// mask.
inline int64_t VisibleKeyEnd(const AttentionShape& shape,
                             const AttentionOptions& options, int64_t batch,
                             int64_t query) {
  const int64_t length =
      options.key_lengths.empty() ? shape.key_len : options.key_lengths[batch];
  if (!options.causal) return length;
  const int64_t causal_end =
      options.causal_alignment == CausalAlignment::kTopLeft
          ? query + 1
          : query + length - shape.query_len + 1;
  return std::clamp<int64_t>(causal_end, 0, length);
}

// Element strides of a mask broadcast to [B, H, Lq, Lk]: 0 along a broadcast
// dimension.
struct MaskStrides {
  int64_t batch, head, query, key;
};

inline MaskStrides StridesOf(const AttentionMask& mask) {
  const auto& d = mask.dims;
  return {d[0] == 1 ? 0 : d[1] * d[2] * d[3], d[1] == 1 ? 0 : d[2] * d[3],
          d[2] == 1 ? 0 : d[3], d[3] == 1 ? 0 : 1};
}

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_VISIBILITY_H_
