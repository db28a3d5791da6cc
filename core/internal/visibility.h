// Which keys a query row may see: the bounds that causality, key_lengths, a
// sliding window and attention sinks put on a row, and the strides of a mask
// broadcast to [B, H, Lq, Lk]. Shared by the unfused score pass, the fused
// kernel and the paged kernel so that all three draw the same lines.
#ifndef ATTNSERVE_CORE_INTERNAL_VISIBILITY_H_
#define ATTNSERVE_CORE_INTERNAL_VISIBILITY_H_

#include <algorithm>
#include <cstdint>

#include "attnserve/core/attention_types.h"

namespace attnserve::internal {

// The keys one query row sees before any mask: [0, sink_end) ∪ [start, end),
// with sink_end < start <= end, or sink_end = start = 0 (one run [0, end)).
struct RowKeys {
  int64_t sink_end = 0;
  int64_t start = 0;
  int64_t end = 0;

  bool Sees(int64_t j) const { return j < sink_end || (start <= j && j < end); }
};

// What decides RowKeys, the same for every row of a call.
struct KeyRules {
  bool causal = false;
  bool bottom_right = false;
  int64_t window_left = -1;  // −1: unbounded
  int64_t window_right = -1;
  int64_t sinks = 0;

  bool Windowed() const { return window_left >= 0 || window_right >= 0; }
};

inline KeyRules RulesOf(const AttentionOptions& options) {
  return {options.causal,
          options.causal_alignment == CausalAlignment::kBottomRight,
          options.window_left, options.window_right, options.num_sink_tokens};
}

// Where query `query` of Lq = `query_len` queries over `length` keys stands
// among the keys: 0 under top-left alignment, L − Lq under bottom-right. The
// causal edge, the window and ALiBi's distances are measured from it.
inline int64_t QueryPosition(const KeyRules& rules, int64_t length,
                             int64_t query_len, int64_t query) {
  return rules.bottom_right ? query + length - query_len : query;
}

// The keys query `query` sees among `length` keys.
inline RowKeys VisibleKeys(const KeyRules& rules, int64_t length,
                           int64_t query_len, int64_t query) {
  const int64_t position = QueryPosition(rules, length, query_len, query);
  int64_t end = length;
  if (rules.causal) end = std::clamp<int64_t>(position + 1, 0, length);
  if (!rules.Windowed() && rules.sinks == 0) return {0, 0, end};
  const int64_t sink_end = std::min(rules.sinks, end);
  // |position| < length + query_len: a window at least that wide reaches
  // every key (and is left alone, so that no sum overflows).
  const int64_t reach = length + query_len;
  int64_t start = 0;
  if (rules.window_left >= 0 && rules.window_left < reach) {
    start = std::clamp<int64_t>(position - rules.window_left, 0, length);
  }
  int64_t window_end = end;
  if (rules.window_right >= 0 && rules.window_right < reach) {
    window_end =
        std::clamp<int64_t>(position + rules.window_right + 1, 0, window_end);
  }
  if (window_end <= start) return {0, 0, sink_end};  // an empty window
  if (start <= sink_end) return {0, 0, std::max(sink_end, window_end)};
  return {sink_end, start, window_end};
}

// The key length of batch item `batch`: key_lengths[batch] if given, else Lk.
inline int64_t KeyLength(const AttentionShape& shape,
                         const AttentionOptions& options, int64_t batch) {
  return options.key_lengths.empty() ? shape.key_len
                                     : options.key_lengths[batch];
}

// The keys query `query` of batch item `batch` sees, before any mask.
inline RowKeys VisibleKeys(const AttentionShape& shape,
                           const AttentionOptions& options, int64_t batch,
                           int64_t query) {
  return VisibleKeys(RulesOf(options), KeyLength(shape, options, batch),
                     shape.query_len, query);
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
