// A call's StopCheck (attention_types.h) as the threads of its computation
// poll it.
#ifndef ATTNSERVE_CORE_INTERNAL_STOPPER_H_
#define ATTNSERVE_CORE_INTERNAL_STOPPER_H_

#include <atomic>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/core/attention_types.h"

namespace attnserve::internal {

// Once one thread's poll sees an error, every later poll says stop at the
// cost of an atomic load, without calling the check again. Thread-safe.
class Stopper {
 public:
  // `check` (possibly empty: never stops) must outlive the stopper.
  explicit Stopper(const StopCheck& check) : check_(check) {}

  Stopper(const Stopper&) = delete;
  Stopper& operator=(const Stopper&) = delete;

  // Whether the computation should stop now.
  bool ShouldStop() {
    if (stopped_.load(std::memory_order_acquire)) return true;
    if (!check_) return false;
    absl::Status status = check_();
    if (status.ok()) return false;
    absl::MutexLock lock(&mutex_);
    if (status_.ok()) status_ = std::move(status);
    stopped_.store(true, std::memory_order_release);
    return true;
  }

  // Whether a poll has said stop.
  bool stopped() const { return stopped_.load(std::memory_order_acquire); }

  // The first error a poll saw, or OK.
  absl::Status status() const {
    absl::MutexLock lock(&mutex_);
    return status_;
  }

 private:
  const StopCheck& check_;
  std::atomic<bool> stopped_{false};
  mutable absl::Mutex mutex_;
  absl::Status status_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_STOPPER_H_
