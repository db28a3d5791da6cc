// The time left before a deadline, for calls that share one. Internal to the
// client library.
#ifndef ATTNSERVE_CLIENT_DEADLINE_H_
#define ATTNSERVE_CLIENT_DEADLINE_H_

#include <algorithm>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attnserve::internal {

// What is left of `deadline`, zero once it has passed.
inline absl::Duration Remaining(absl::Time deadline) {
  return std::max(deadline - absl::Now(), absl::ZeroDuration());
}

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CLIENT_DEADLINE_H_
