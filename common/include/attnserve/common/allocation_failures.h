// Allocations that fail although the memory budgets let their call in: the
// machine short of the memory the budgets assume, or a limit set below them.
// Each becomes RESOURCE_EXHAUSTED for the call (not std::bad_alloc ending the
// process), and is counted for the operator.
//
//   try {
//     ...
//   } catch (const std::bad_alloc&) {
//     return AllocationFailed("parse the request's 524288 bytes");
//   }
#ifndef ATTNSERVE_COMMON_ALLOCATION_FAILURES_H_
#define ATTNSERVE_COMMON_ALLOCATION_FAILURES_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace attnserve {

// RESOURCE_EXHAUSTED naming what could not be done, counted `calls` times in
// AllocationFailures (the calls it fails: a batch's are several).
absl::Status AllocationFailed(absl::string_view doing, int64_t calls = 1);

// How many calls AllocationFailed has failed in this process.
int64_t AllocationFailures();

}  // namespace attnserve

#endif  // ATTNSERVE_COMMON_ALLOCATION_FAILURES_H_
