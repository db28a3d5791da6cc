// ReadWatchdog: cancels calls whose request stops arriving. A unary call's
// message is buffered by gRPC until its last byte arrives; a client that
// declares a large message and stops sending would hold those bytes for as
// long as the connection stays open. Each watched call gets `timeout` from its
// headers to its whole message; past it the call is cancelled, which frees what
// was buffered (the client sees its stream reset).
//
//   ReadWatchdog watchdog(absl::Seconds(30));
//   const ReadWatchdog::Ticket ticket = watchdog.Watch(&context);  // OnStart
//   ...
//   watchdog.Unwatch(ticket);  // first thing in OnReadDone
//
// Thread-safe. Owns one thread, joined by the destructor. A watched context
// must stay valid until Unwatch returns; after it returns the watchdog never
// touches the context again.
#ifndef ATTNSERVE_SERVER_RPC_READ_WATCHDOG_H_
#define ATTNSERVE_SERVER_RPC_READ_WATCHDOG_H_

#include <cstdint>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"

namespace attnserve {

class ReadWatchdog {
 public:
  using Ticket = uint64_t;

  explicit ReadWatchdog(absl::Duration timeout);
  ReadWatchdog(const ReadWatchdog&) = delete;
  ReadWatchdog& operator=(const ReadWatchdog&) = delete;
  ~ReadWatchdog();

  // Starts the clock of a call whose request is being read.
  Ticket Watch(grpc::ServerContextBase* context) ABSL_LOCKS_EXCLUDED(mutex_);
  // Stops it (the read completed, or failed).
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

#endif  // ATTNSERVE_SERVER_RPC_READ_WATCHDOG_H_
