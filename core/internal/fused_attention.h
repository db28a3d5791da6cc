// Fused attention (FlashAttention-2 on the CPU): each tile of query rows walks
// the key blocks it may see, scores a block with one matmul, folds it into a
// running max and sum (internal/tile_kernels.h), rescales its f32 output
// accumulator and adds the block's probabilities times its values with a
// second matmul. The Lq×Lk scores never exist: memory is O(L) per thread.
//
// A tile holds the query rows of every head that shares one kv head (GQA reads
// each key block once for all of them). Tiles run in parallel over (batch, kv
// head, query block); when those are too few to occupy the threads (decode,
// Lq of a few rows), each tile's keys are also split into chunks whose partial
// (max, sum, output) are merged exactly afterwards. Causality and key_lengths
// bound the key loop, so blocks nobody may see are never computed; only the
// blocks that straddle a boundary are masked.
//
// The tile matmuls are oneDNN primitives built once per tile shape for a
// single thread, run inside our own parallel loop with per-thread scratchpads.
// Tiles of fewer than kSmallRows rows (decode) use our own vector code instead,
// which streams the keys and values at memory speed.
//
// Its parts: internal/fused_plan.h cuts a call into tiles and lays out each
// thread's buffers; internal/tile_matmuls.h builds and binds the tile matmuls;
// internal/fused_run.h is a call as it runs (fused_attention.cc prepares it
// and hands out the tiles, fused_tile.cc computes one tile).
#ifndef ATTNSERVE_CORE_INTERNAL_FUSED_ATTENTION_H_
#define ATTNSERVE_CORE_INTERNAL_FUSED_ATTENTION_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "attnserve/common/dtype.h"
#include "attnserve/core/attention_types.h"
#include "internal/scratch_pool.h"
#include "internal/sdpa_problem.h"
#include "internal/tile_kernels.h"
#include "internal/tile_matmuls.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::internal {

// The scratch bytes RunFusedAttention allocates for `shape` and `options` with
// `threads` threads or with one, whichever is more (a team's tiles may be
// smaller than one thread's), or nullopt on overflow. `key_value_packed`: key
// and value rows are contiguous, D elements apart (else the kernel packs them
// first). `source`: the inputs' dtype (SdpaProblem::input_dtype). `tiling`:
// the problem's (SdpaProblem::tiling), run on at most `threads`.
std::optional<int64_t> FusedWorkspaceBytes(const AttentionShape& shape,
                                           const AttentionOptions& options,
                                           int threads, bool key_value_packed,
                                           DataType source = DataType::kFloat32,
                                           Tiling tiling = {});

// True if `problem`'s key and value rows are contiguous and D elements apart.
bool KeyValuePacked(const SdpaProblem& problem);

// Computes `problem` (validated by the caller, weights not asked for) with
// `threads` OpenMP threads, its scratch from `pool`. Returns INTERNAL or
// RESOURCE_EXHAUSTED if oneDNN fails.
absl::Status RunFusedAttention(const dnnl::engine& engine,
                               const SdpaProblem& problem, int threads,
                               const TileKernels& kernels, TilePlanCache& cache,
                               ScratchPool& pool);

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_FUSED_ATTENTION_H_
