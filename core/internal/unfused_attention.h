// Attention as two oneDNN matmuls around our score pass: scores = scale · Q Kᵀ,
// then masks and softmax (internal/score_pass.h), then output = P V. It
// materialises the scores one slab at a time, so it serves until the fused
// kernel lands, and later where the weights are asked for.
#ifndef ATTNSERVE_CORE_INTERNAL_UNFUSED_ATTENTION_H_
#define ATTNSERVE_CORE_INTERNAL_UNFUSED_ATTENTION_H_

#include <array>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "attnserve/core/attention_types.h"
#include "internal/plan_cache.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::internal {

// Element strides of a 4-D tensor indexed [batch, head, position, feature].
using Strides4 = std::array<int64_t, 4>;

// Strides of a packed row-major [batch, heads, length, dim] tensor.
Strides4 PackedStrides(int64_t heads, int64_t length, int64_t dim);

// Copies the [d0, d1, d2, d3] tensor at `src` with element strides `from` to
// `dst` with strides `to` (both with unit stride along d3), on the calling
// thread's OpenMP team.
void CopyTensor4(const float* src, const Strides4& from, float* dst,
                 const Strides4& to, const std::array<int64_t, 4>& dims);

// Where one batch entry's tensors start, for a call whose batch entries lie
// apart (a dynamically batched call reads each request in place). `lse` is null
// when lse is not asked for.
struct BatchTensors {
  const float* query = nullptr;
  const float* key = nullptr;
  const float* value = nullptr;
  float* output = nullptr;
  float* lse = nullptr;
};

// One SDPA call, with its tensors anywhere in memory: MHA passes views into its
// projection buffers ([B, L, heads·D] read as [B, heads, L, D]) so that no
// transpose is ever copied.
struct SdpaProblem {
  AttentionShape shape;
  const AttentionOptions* options = nullptr;
  float scale = 1.0f;
  const float* query = nullptr;
  Strides4 query_strides{};
  const float* key = nullptr;
  Strides4 key_strides{};
  const float* value = nullptr;
  Strides4 value_strides{};
  float* output = nullptr;
  Strides4 output_strides{};
  absl::Span<float> weights;
  absl::Span<float> lse;
  // If not empty, batch entry b's tensors start at batches[b] (strides[0] and
  // the pointers above unused, lse among them; weights not allowed). The fused
  // kernel only.
  absl::Span<const BatchTensors> batches;
};

// The first element of batch entry `b` of each tensor of `p`.
inline const float* QueryOf(const SdpaProblem& p, int64_t b) {
  return p.batches.empty() ? p.query + b * p.query_strides[0]
                           : p.batches[static_cast<size_t>(b)].query;
}
inline const float* KeyOf(const SdpaProblem& p, int64_t b) {
  return p.batches.empty() ? p.key + b * p.key_strides[0]
                           : p.batches[static_cast<size_t>(b)].key;
}
inline const float* ValueOf(const SdpaProblem& p, int64_t b) {
  return p.batches.empty() ? p.value + b * p.value_strides[0]
                           : p.batches[static_cast<size_t>(b)].value;
}
inline float* OutputOf(const SdpaProblem& p, int64_t b) {
  return p.batches.empty() ? p.output + b * p.output_strides[0]
                           : p.batches[static_cast<size_t>(b)].output;
}
// Where row (b, h, i)'s lse goes, or null if lse is not asked for.
inline float* LseOf(const SdpaProblem& p, int64_t b, int64_t h, int64_t i) {
  const AttentionShape& s = p.shape;
  if (p.batches.empty()) {
    return p.lse.empty() ? nullptr
                         : p.lse.data() + (b * s.heads + h) * s.query_len + i;
  }
  float* lse = p.batches[static_cast<size_t>(b)].lse;
  return lse == nullptr ? nullptr : lse + h * s.query_len + i;
}

// The matmuls of one slab extent (scores = scale · Q Kᵀ, output = P V), reused
// for every slab of that extent and, through the cache, across calls and
// threads. So their scratchpad is the caller's (scratchpad_mode::user), one per
// execution, scratchpad_md bytes: oneDNN's own is a buffer of the thread that
// built the primitive, which two threads executing cached primitives at once
// would share, and which that thread frees when it builds a primitive needing a
// larger one.
struct SlabPlan {
  dnnl::memory::desc query_md, key_t_md, value_md, scores_md, probabilities_md,
      output_md, scratchpad_md;
  dnnl::matmul scores;
  dnnl::matmul context;
};
using SlabPlanCache = PlanCache<SlabPlan>;

// The scratch bytes RunUnfusedAttention allocates for `shape` at `precision`
// with a slab budget, or nullopt on overflow: at least one kv-head group's
// scores, more as the budget allows; plus packed copies of Q, K, V and the
// output when the problem's tensors are strided views (`packed` false).
std::optional<int64_t> UnfusedWorkspaceBytes(const AttentionShape& shape,
                                             Precision precision,
                                             int64_t slab_budget_bytes,
                                             bool packed = true);

// Computes `problem`, whose shape and options the caller has validated. Strided
// views (MHA's projections) are first packed: oneDNN 2.6 runs 5-D strided
// matmul operands on its slow gemm:jit kernel, packed ones on brgemm. Returns
// INTERNAL or RESOURCE_EXHAUSTED if oneDNN fails.
absl::Status RunUnfusedAttention(const dnnl::engine& engine,
                                 dnnl::stream& stream,
                                 const SdpaProblem& problem,
                                 int64_t slab_budget_bytes,
                                 SlabPlanCache& cache);

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_UNFUSED_ATTENTION_H_
