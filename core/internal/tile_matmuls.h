// The oneDNN matmuls of the fused kernel's tiles: a TilePlan per tile shape,
// built once for a single thread and shared through the engine's cache, and
// each thread's handles for running one inside the kernel's own parallel loop.
// The handles go through oneDNN's C API, whose calls report errors as
// statuses: the tile loop runs inside an OpenMP region, where nothing may
// throw.
#ifndef ATTNSERVE_CORE_INTERNAL_TILE_MATMULS_H_
#define ATTNSERVE_CORE_INTERNAL_TILE_MATMULS_H_

#include <cstdint>
#include <string>

#include "attnserve/core/attention_types.h"
#include "internal/matmul.h"
#include "internal/plan_cache.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::internal {

// The two matmuls of one tile shape: scores [M, n] = Q [M, Dk] · K_blockᵀ, and
// output [M, Dv] += P [M, n] · V_block [n, Dv].
struct TilePlan {
  dnnl::memory::desc query_md, key_t_md, scores_md, probabilities_md, value_md,
      output_md;
  dnnl::matmul scores;
  dnnl::matmul context;
  dnnl::memory::desc scores_scratchpad_md, context_scratchpad_md;
};
using TilePlanCache = PlanCache<TilePlan>;

namespace fused {

// The cache key of the plan of an [m, n] tile of `s` reading `input`.
std::string TileKey(int64_t m, int64_t n, const AttentionShape& s,
                    MatmulInput input);

// Built for one thread: the caller holds omp_set_num_threads(1) around this,
// so oneDNN plans no parallelism inside the tile. Throws dnnl::error (callers
// run it inside CallDnnl).
TilePlan MakeTilePlan(const dnnl::engine& engine, int64_t m, int64_t n,
                      const AttentionShape& s, MatmulInput input);

// A oneDNN memory object held through the C API.
class MemoryHandle {
 public:
  MemoryHandle() = default;
  MemoryHandle(const MemoryHandle&) = delete;
  MemoryHandle& operator=(const MemoryHandle&) = delete;
  ~MemoryHandle() {
    if (handle_ != nullptr) dnnl_memory_destroy(handle_);
  }

  dnnl_status_t Create(const dnnl::memory::desc& md, dnnl_engine_t engine,
                       void* data) {
    return dnnl_memory_create(&handle_, &md.data, engine, data);
  }
  dnnl_memory_t get() const { return handle_; }

 private:
  dnnl_memory_t handle_ = nullptr;
};

// One thread's handles on a tile plan, made on first use: memory objects
// whose data pointers move from block to block.
struct TileBinding {
  const TilePlan* plan = nullptr;
  MemoryHandle query, key_t, scores, probabilities, value, output,
      scores_scratchpad, context_scratchpad;

  // Creates the handles of `tile_plan` on `engine`, the scratchpads' at
  // `scratchpad`. Returns a oneDNN status.
  dnnl_status_t Bind(const TilePlan& tile_plan, dnnl_engine_t engine,
                     char* scratchpad);
};

// Runs `matmul` on `stream` with these arguments. Returns a oneDNN status.
inline dnnl_status_t Execute(const dnnl::matmul& matmul,
                             const dnnl::stream& stream, dnnl_memory_t src,
                             dnnl_memory_t weights, dnnl_memory_t dst,
                             dnnl_memory_t scratchpad) {
  dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, src},
                             {DNNL_ARG_WEIGHTS, weights},
                             {DNNL_ARG_DST, dst},
                             {DNNL_ARG_SCRATCHPAD, scratchpad}};
  return dnnl_primitive_execute(matmul.get(), stream.get(), 4, args);
}

}  // namespace fused
}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_TILE_MATMULS_H_
