// The AttendStream handler: many Attend requests on one bidirectional stream.
//
// Each request is validated as it arrives and computed on the executor; answers
// are written in the order the requests came, each carrying its index and
// either the response or its error, so one bad request fails only its own
// answer. At most kMaxPendingPerStream requests are held per stream: past that
// the call stops reading until answers drain (flow control reaches the
// client). The stream ends OK once the client has closed its side and every
// answer is written; once the server drains (OpenStreams::EndAll), it ends
// UNAVAILABLE as soon as the answers to the messages it took are written,
// whether or not the client is sending.
#ifndef ATTNSERVE_SERVER_ATTENTION_ATTEND_STREAM_H_
#define ATTNSERVE_SERVER_ATTENTION_ATTEND_STREAM_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/core/attention_types.h"
#include "attnserve/server/attention/compute_job.h"
#include "attnserve/server/attention/request_validator.h"
#include "attnserve/server/attention/scheduler.h"
#include "attnserve/server/metrics/metrics.h"
#include "attnserve/server/rpc/access_log.h"
#include "attnserve/server/rpc/call_gate.h"
#include "attnserve/server/rpc/call_loop.h"
#include "attnserve/server/rpc/memory_budget.h"
#include "attnserve/server/rpc/transfer_watchdog.h"
#include "attnserve/server/rpc/transport_options.h"
#include "attnserve/v1/attention.grpc.pb.h"

namespace attnserve {

inline constexpr int kMaxPendingPerStream = 32;

// The AttendStreams open, so that a drain can end them: gRPC's shutdown waits
// for every call, and a stream waiting for its client's next message held it
// to the shutdown's deadline (30 s), when the transport went. Thread-safe.
class OpenStreams {
 public:
  // What a stream does when told to end: stops taking messages, and ends once
  // the answers to those it took are written.
  class Stream {
   public:
    virtual void End(const std::string& reason) = 0;

   protected:
    ~Stream() = default;
  };

  // A stream adds itself once admitted and removes itself before it is
  // deleted; one added after EndAll is ended at once.
  void Add(Stream* stream) ABSL_LOCKS_EXCLUDED(mutex_);
  void Remove(Stream* stream) ABSL_LOCKS_EXCLUDED(mutex_);
  // Ends every stream open and any added later.
  void EndAll() ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  absl::Mutex mutex_;
  bool ended_ ABSL_GUARDED_BY(mutex_) = false;
  absl::flat_hash_set<Stream*> streams_ ABSL_GUARDED_BY(mutex_);
};

// What a stream needs from the service; all must outlive every stream.
struct StreamDependencies {
  ComputeContext compute;
  const CallGate* gate;
  // Each message held (from its arrival to its answer's write) is charged to
  // it; one it has no room for is answered RESOURCE_EXHAUSTED.
  MemoryBudget* budget;
  RequestChecks checks;
  TransportOptions transport;
  // Cancels a stream whose next message has not arrived within
  // transport.stream_idle_timeout of the read's start, or whose answer has not
  // been taken within it (and SendAllowance) of the write's.
  TransferWatchdog* watchdog;
  // One line per request when not null (--access_log).
  AccessLog* access_log = nullptr;
  // Where the stream registers while open, so that a drain ends it.
  OpenStreams* open_streams = nullptr;
};

// The handler of one AttendStream call, whose messages are AttendRequests and
// AttendStreamResponses on the wire: a message that is not a valid
// AttendRequest gets an INVALID_ARGUMENT answer of its own, like any malformed
// request.
std::unique_ptr<ServerCall> MakeAttendStreamCall(
    const StreamDependencies& dependencies);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_ATTEND_STREAM_H_
