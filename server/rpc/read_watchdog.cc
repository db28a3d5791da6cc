#include "attnserve/server/rpc/read_watchdog.h"

#include <algorithm>

namespace attnserve {

ReadWatchdog::ReadWatchdog(absl::Duration timeout)
    : timeout_(timeout), thread_([this] { CancelExpired(); }) {}

ReadWatchdog::~ReadWatchdog() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  thread_.join();
}

ReadWatchdog::Ticket ReadWatchdog::Watch(grpc::ServerContextBase* context) {
  absl::MutexLock lock(&mutex_);
  const Ticket ticket = next_++;
  watched_.emplace(ticket, Watched{context, absl::Now() + timeout_});
  return ticket;
}

void ReadWatchdog::Unwatch(Ticket ticket) {
  absl::MutexLock lock(&mutex_);
  watched_.erase(ticket);
}

int64_t ReadWatchdog::cancelled() const {
  absl::MutexLock lock(&mutex_);
  return cancelled_;
}

void ReadWatchdog::CancelExpired() {
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
      // Under the mutex: the call cannot finish its read (and Unwatch) first.
      it->second.context->TryCancel();
      ++cancelled_;
      it = watched_.erase(it);
    }
  }
}

}  // namespace attnserve
