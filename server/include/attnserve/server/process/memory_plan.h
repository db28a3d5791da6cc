// The process's memory limit and the budgets that must fit in it: registered
// weights, the sessions' KV cache, the buffer pool, and what calls in flight
// may hold (the in-flight
// budget of rpc/memory_budget.h and gRPC's transport quota).
#ifndef ATTNSERVE_SERVER_PROCESS_MEMORY_PLAN_H_
#define ATTNSERVE_SERVER_PROCESS_MEMORY_PLAN_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace attnserve {

// MemoryOptions::buffer_pool_bytes when the pool is derived from the limit.
inline constexpr int64_t kDerivedBufferPool = -1;

// The memory budgets, as asked for (0: derived by PlanMemory).
struct MemoryOptions {
  // The most bytes of registered weights the server holds (PutWeights,
  // weights_dir, demo). 0: a quarter of what the memory limit (the cgroup's,
  // or physical memory) leaves after the process and the buffer pool, at most
  // 4 GiB.
  int64_t max_weights_bytes = 0;
  // The most bytes of KV-cache pages the sessions hold (the store's hard
  // budget). 0: a quarter of what the memory limit (the cgroup's, or physical
  // memory) leaves after the process and the buffer pool.
  int64_t kv_cache_bytes = 0;
  // The memory that requests in flight may hold at once: a quarter for gRPC's
  // transport buffers (its ResourceQuota: connections and messages still
  // arriving), the rest for calls from their message's arrival through the
  // queue and the compute to their answer's send. Past it calls get
  // RESOURCE_EXHAUSTED at once. 0: three quarters of what the memory limit
  // leaves after the weights, the KV cache, the buffer pool and 256 MiB for
  // the process.
  int64_t max_inflight_bytes = 0;
  // Memory kept between calls for requests' and responses' tensor bytes, so
  // that large tensors are read and written into pages already mapped; 0
  // keeps none. -1: an eighth of what the memory limit leaves after the
  // process, at most 256 MiB.
  int64_t buffer_pool_bytes = kDerivedBufferPool;
  // The most connections the gRPC port holds open at once (ConnectionTally's
  // rule), each planned at kConnectionBytes. 0: as many as a thirty-second of
  // what the memory limit leaves after the process pays for, at most what the
  // budgets set leave (PlanMemory), at least kLeastDerivedConnections where
  // they fit.
  int64_t max_connections = 0;
};

// What one open connection is planned to hold: gRPC's state for an idle
// HTTP/2 connection measured 15 KiB, the kernel's socket a few more, and its
// read buffers under traffic come from gRPC's quota (transport_bytes).
inline constexpr int64_t kConnectionBytes = int64_t{32} << 10;

// The fewest connections a plan derives where the budgets leave room for them.
inline constexpr int64_t kLeastDerivedConnections = 64;

// The memory the process may use, and where that figure comes from.
struct MemoryLimit {
  int64_t bytes = 0;
  // "cgroup /sys/fs/cgroup/memory.max", "physical memory" or
  // "RLIMIT_AS (ulimit -v)".
  std::string source;
};

// The tightest cgroup memory limit over the process's cgroup and its ancestors
// (cgroup v2's memory.max, or v1's memory.limit_in_bytes) under `cgroup_root`,
// as /proc/self/cgroup names them (`proc_self_cgroup`), or the machine's
// physical memory when none is set; or the process's own RLIMIT_AS or
// RLIMIT_DATA (ulimit -v, -d) where one is tighter still, less the address
// space the process has mapped but not touched (VmSize − VmRSS: thread
// stacks, allocator arenas), which those limits count.
MemoryLimit ReadMemoryLimit(
    const std::string& cgroup_root = "/sys/fs/cgroup",
    const std::string& proc_self_cgroup = "/proc/self/cgroup");

// Memory the process needs beyond its budgets: code, gRPC's and oneDNN's own
// state, thread stacks, the allocator's overhead.
inline constexpr int64_t kProcessOverheadBytes = int64_t{256} << 20;

// The least max_inflight_bytes a plan derives: a limit that leaves less for
// calls in flight stops start-up (a flag may set less, down to 1 MiB).
inline constexpr int64_t kLeastDerivedInflightBytes = int64_t{32} << 20;

// The budgets that must fit in the memory limit together.
struct MemoryPlan {
  int64_t max_weights_bytes = 0;
  int64_t kv_cache_bytes = 0;
  int64_t buffer_pool_bytes = 0;
  int64_t max_inflight_bytes = 0;
  // The part of max_inflight_bytes given to gRPC's ResourceQuota: the buffers
  // of connections and of messages still arriving.
  int64_t transport_bytes = 0;
  int64_t max_connections = 0;
  MemoryLimit limit;

  // What calls may hold (the in-flight budget less gRPC's part), of which
  // one connection may hold half.
  int64_t calls_bytes() const { return max_inflight_bytes - transport_bytes; }
};

// Fills in the budgets left to derive from `limit` and checks that they fit.
// From what the limit leaves after kProcessOverheadBytes ("left"):
// - buffer_pool_bytes kDerivedBufferPool: an eighth of left, at most 256 MiB;
// - max_weights_bytes 0: a quarter of left less the pool, at most 4 GiB;
// - kv_cache_bytes 0: a quarter of left less the pool;
// - max_connections 0: left / 32 / kConnectionBytes, but at most what the
//   other budgets set leave of the limit (an eighth of it when
//   max_inflight_bytes is derived too); at least kLeastDerivedConnections
//   where those fit, else as many as fit, at least one;
// - max_inflight_bytes 0: three quarters of what the limit leaves after the
//   weights, the KV cache, the buffer pool, the connections and
//   kProcessOverheadBytes (the last quarter is the allocator's slack and
//   gRPC's overshoot of its quota).
// A small limit thus gets small budgets, not a refusal: 512 MiB plans a pool
// of 32 MiB, 56 MiB each of weights and KV cache, 256 connections (8 MiB),
// 78 MiB in flight. FAILED_PRECONDITION, naming every term, when weights + KV
// cache + pool + connections + in-flight + kProcessOverheadBytes exceed the
// limit; INVALID_ARGUMENT for a negative budget.
absl::StatusOr<MemoryPlan> PlanMemory(const MemoryOptions& requested,
                                      const MemoryLimit& limit);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_PROCESS_MEMORY_PLAN_H_
