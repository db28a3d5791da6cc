// Attention as two oneDNN matmuls around our score pass: scores = scale · Q Kᵀ,
// then masks and softmax (internal/score_pass.h), then output = P V. It
// materialises the scores one slab at a time, so the engine runs it where a
// call asks for the attention weights (which are those scores' softmax), and
// for every call of an engine made with AttentionKernel::kUnfused (the
// baseline of benchmarks and tests).
#ifndef ATTNSERVE_CORE_INTERNAL_UNFUSED_ATTENTION_H_
#define ATTNSERVE_CORE_INTERNAL_UNFUSED_ATTENTION_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "attnserve/core/attention_types.h"
#include "internal/plan_cache.h"
#include "internal/sdpa_problem.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::internal {

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
// INTERNAL or RESOURCE_EXHAUSTED if oneDNN fails. With `problem.output` null
// it gives the weights and lse only, skipping the product P·V.
absl::Status RunUnfusedAttention(const dnnl::engine& engine,
                                 dnnl::stream& stream,
                                 const SdpaProblem& problem,
                                 int64_t slab_budget_bytes,
                                 SlabPlanCache& cache);

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_UNFUSED_ATTENTION_H_
