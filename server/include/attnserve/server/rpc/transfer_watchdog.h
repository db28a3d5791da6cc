// TransferWatchdog: cancels calls whose message stops moving. A unary call's
// request is buffered by gRPC until its last byte arrives; a client that
// declares a large message and stops sending would hold those bytes for as
// long as the connection stays open. Likewise an answer is held until the
// client has taken it (HTTP/2 flow control): a client that stops reading
// would hold it as long. Each watched transfer gets `timeout`, from the start
// of a read to its whole message or from the start of a write to its last
// byte taken; past it the call is cancelled, which frees what was held (the
// client sees its stream reset).
//
//   TransferWatchdog watchdog(absl::Seconds(30));
//   const TransferWatchdog::Ticket ticket = watchdog.Watch(&context);
//   StartRead(&message);  // or StartWrite, or Finish with a message
//   ...
//   watchdog.Unwatch(ticket);  // first thing in OnReadDone (OnWriteDone,
//                              // OnDone)
//
// Thread-safe. Owns one thread, joined by the destructor. A watched context
// must stay valid until Unwatch returns; after it returns the watchdog never
// touches the context again.
#ifndef ATTNSERVE_SERVER_RPC_TRANSFER_WATCHDOG_H_
#define ATTNSERVE_SERVER_RPC_TRANSFER_WATCHDOG_H_

#include <cstdint>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"

namespace attnserve {

class TransferWatchdog {
 public:
  using Ticket = uint64_t;

  explicit TransferWatchdog(absl::Duration timeout);
  TransferWatchdog(const TransferWatchdog&) = delete;
  TransferWatchdog& operator=(const TransferWatchdog&) = delete;
  ~TransferWatchdog();

  // Starts the clock of a call's read or write. A call may have several
  // transfers watched at once (a stream's read and write).
  Ticket Watch(grpc::ServerContextBase* context) ABSL_LOCKS_EXCLUDED(mutex_);
  // Stops it (the transfer completed, or failed).
  void Unwatch(Ticket ticket) ABSL_LOCKS_EXCLUDED(mutex_);

  // Calls cancelled so far.
  int64_t cancelled() const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  struct Watched {
    grpc::ServerContextBase* context;
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
