// Attention as three oneDNN primitives: scores = scale · Q Kᵀ (matmul), softmax
// over keys, output = scores V (matmul). It materialises the scores, so it
// serves as the baseline path until the fused kernel lands, and later where the
// attention weights themselves are asked for.
#ifndef ATTNSERVE_CORE_INTERNAL_UNFUSED_ATTENTION_H_
#define ATTNSERVE_CORE_INTERNAL_UNFUSED_ATTENTION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "attnserve/core/attention_engine.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::internal {

// The scores of one kv-head group: the H / Hkv query heads that share a kv
// head, stacked, times the keys. The smallest unit of work of the unfused path,
// and so the least workspace it needs.
int64_t GroupScoreElements(const AttentionShape& shape);

// Computes attention for a validated `shape`. Works through the (batch, kv
// head) groups in slabs whose scores fit in max(slab_workspace_bytes, one
// group's scores). Returns INTERNAL or RESOURCE_EXHAUSTED if oneDNN fails.
absl::Status RunUnfusedAttention(const dnnl::engine& engine,
                                 dnnl::stream& stream,
                                 const AttentionShape& shape, float scale,
                                 const float* query, const float* key,
                                 const float* value, float* output,
                                 int64_t slab_workspace_bytes);

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_UNFUSED_ATTENTION_H_
