#include "attnserve/server/rpc/transfer_watchdog.h"

#include <algorithm>

namespace attnserve {

TransferWatchdog::TransferWatchdog(absl::Duration timeout)
    : timeout_(timeout), thread_([this] { CancelExpired(); }) {}

TransferWatchdog::~TransferWatchdog() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  thread_.join();
}

TransferWatchdog::Ticket TransferWatchdog::Watch(ServerCall* call,
                                                 absl::Duration extra) {
  absl::MutexLock lock(&mutex_);
  const Ticket ticket = next_++;
  watched_.emplace(ticket, Watched{call, absl::Now() + timeout_ + extra});
  return ticket;
}

void TransferWatchdog::Unwatch(Ticket ticket) {
  absl::MutexLock lock(&mutex_);
  watched_.erase(ticket);
}

int64_t TransferWatchdog::cancelled() const {
  absl::MutexLock lock(&mutex_);
  return cancelled_;
}

void TransferWatchdog::CancelExpired() {
  // Checks a few times per timeout, at most every 100 ms.
  const absl::Duration period =
      std::clamp(timeout_ / 4, absl::Milliseconds(10), absl::Milliseconds(100));
  absl::MutexLock lock(&mutex_);
  while (!mutex_.AwaitWithTimeout(absl::Condition(&stopping_), period)) {
    const absl::Time now = absl::Now();
    for (auto it = watched_.begin(); it != watched_.end();) {
      if (it->second.deadline > now) {
        ++it;
        continue;
      }
      // Under the mutex: the call cannot finish its transfer (and Unwatch)
      // first.
      it->second.call->CancelStalled();
      ++cancelled_;
      it = watched_.erase(it);
    }
  }
}

}  // namespace attnserve
