// TransferWatchdog: cancels calls whose message stops moving. A unary call's
// request is buffered by gRPC until its last byte arrives; a client that
// declares a large message and stops sending would hold those bytes for as
// long as the connection stays open. Likewise an answer is held until the
// client has taken it (HTTP/2 flow control): a client that stops reading
// would hold it as long. Each watched transfer gets `timeout` (and an answer a
// second more per MiB: SendAllowance), from the start of a read to its whole
// message or from the start of a write to its last byte taken; past it the
// call is cancelled, which frees what was held (the client sees CANCELLED or
// its stream reset).
//
//   TransferWatchdog watchdog(absl::Seconds(30));
//   const TransferWatchdog::Ticket ticket = watchdog.Watch(this);
//   StartRead(&message);  // or StartWrite, or Finish with a message
//   ...
//   watchdog.Unwatch(ticket);  // first thing in OnReadDone (OnWriteDone,
//                              // OnDone)
//
// A stalled call is cancelled with ServerCall::CancelStalled, which its
// client's reset count (ResetGuard) does not see. Thread-safe. Owns one
// thread, joined by the destructor. A watched call must stay valid until
// Unwatch returns; after it returns the watchdog never touches the call again.
#ifndef ATTNSERVE_SERVER_RPC_TRANSFER_WATCHDOG_H_
#define ATTNSERVE_SERVER_RPC_TRANSFER_WATCHDOG_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnserve/server/rpc/call_loop.h"

namespace attnserve {

// The time an answer of `bytes` may take beyond the timeout to be taken: a
// second per MiB, so that a client reading at 1 MiB/s or more is never cut
// off however large the answer (--max_message_bytes).
inline absl::Duration SendAllowance(size_t bytes) {
  return absl::Seconds(static_cast<double>(bytes) / (1 << 20));
}

class TransferWatchdog {
 public:
  using Ticket = uint64_t;

  explicit TransferWatchdog(absl::Duration timeout);
  TransferWatchdog(const TransferWatchdog&) = delete;
  TransferWatchdog& operator=(const TransferWatchdog&) = delete;
  ~TransferWatchdog();

  // Starts the clock of a call's read or write: `timeout` plus `extra` (an
  // answer's allowance for its size). A call may have several transfers
  // watched at once (a stream's read and write).
  Ticket Watch(ServerCall* call, absl::Duration extra = absl::ZeroDuration())
      ABSL_LOCKS_EXCLUDED(mutex_);
  // Stops it (the transfer completed, or failed).
  void Unwatch(Ticket ticket) ABSL_LOCKS_EXCLUDED(mutex_);

  // Calls cancelled so far.
  int64_t cancelled() const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  struct Watched {
    ServerCall* call;
    absl::Time deadline;
  };

  void CancelExpired();

  const absl::Duration timeout_;
  mutable absl::Mutex mutex_;
  Ticket next_ ABSL_GUARDED_BY(mutex_) = 0;
  std::map<Ticket, Watched> watched_ ABSL_GUARDED_BY(mutex_);
  int64_t cancelled_ ABSL_GUARDED_BY(mutex_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::thread thread_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_TRANSFER_WATCHDOG_H_
