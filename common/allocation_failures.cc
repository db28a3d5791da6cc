#include "attnserve/common/allocation_failures.h"

#include <atomic>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

std::atomic<int64_t> failures{0};

}  // namespace

absl::Status AllocationFailed(absl::string_view doing, int64_t calls) {
  failures.fetch_add(calls, std::memory_order_relaxed);
  return absl::ResourceExhaustedError(absl::StrCat(
      "the server could not allocate the memory to ", doing,
      ": it has less free memory than its budgets (max_inflight_bytes, "
      "kv_cache_bytes) allow for; retry after a backoff or on another "
      "replica"));
}

int64_t AllocationFailures() {
  return failures.load(std::memory_order_relaxed);
}

}  // namespace attnserve
