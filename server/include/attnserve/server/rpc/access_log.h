// AccessLog: one JSON line per call (--access_log), for the operator who asks
// "who called, what did it cost, how did it end". No tensor data and no
// token: the RPC, its status, the bytes each way, the server's times, the
// peer and the caller's identity (a hash: CallGate::Identity), and the weights
// and session it named.
//
//   {"time":"2026-12-02T05:40:01.123456Z","rpc":"MultiHeadAttention",
//    "code":"OK","peer":"ipv4:10.0.3.7:53312",
//    "identity":"token:1f0c…","request_bytes":1048612,
//    "response_bytes":524321,"server_us":2140,"queue_us":35,
//    "compute_us":1960,"weights":"llama-l0","weights_version":3}
//
// A failed call adds "message" (the status message, whose client text is
// already bounded); a request on an AttendStream adds "stream_index", a Step
// "steps" (its "session" is the first step's), a ForkSession
// "created_session" (the child; "session" is the parent). Client
// names are cut to kMaxEchoBytes and every string is escaped to valid JSON.
//
// Writing never blocks a call: Write formats the line and queues it for the
// log's own thread. Past kMaxPendingBytes queued (a disk or pipe that does not
// keep up), lines are dropped and counted (dropped()), so a flood of calls
// cannot grow the server's memory.
#ifndef ATTNSERVE_SERVER_RPC_ACCESS_LOG_H_
#define ATTNSERVE_SERVER_RPC_ACCESS_LOG_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attnserve {

// What one line says of one call.
struct AccessRecord {
  absl::Time time;        // when the call was answered
  absl::string_view rpc;  // "Attend", "Step", ...
  absl::Status status;
  std::string peer;  // gRPC's peer string: "ipv4:127.0.0.1:53312"
  // CallGate::Identity ("token:…", "x509:…"); empty: none (no credentials).
  std::string identity;
  int64_t request_bytes = 0;
  int64_t response_bytes = 0;  // 0 for a failed call
  absl::Duration server;       // from the request's arrival to the answer
  // From the response's ServerTiming, for a call that computed.
  std::optional<int64_t> queue_us;
  std::optional<int64_t> compute_us;
  std::string weights;          // a weight set's name, when the call named one
  int64_t weights_version = 0;  // its version; 0: none
  std::string session;          // a session's id, when the call named one
  std::string created_session;  // the id ForkSession gave the child
  int64_t steps = 0;            // a Step call's steps (session: the first's)
  int64_t stream_index = -1;    // the request's index on its AttendStream
};

// `record` as one JSON object and a newline.
std::string AccessLogLine(const AccessRecord& record);

class AccessLog {
 public:
  // The most bytes of lines queued for writing; past it lines are dropped.
  static constexpr int64_t kMaxPendingBytes = int64_t{4} << 20;

  // A log to `destination`: "stdout", "stderr", or a file appended to
  // (created with mode 0640; not reopened, so rotate it with copytruncate).
  // INVALID_ARGUMENT for an empty destination; the open's error for a file
  // that cannot be opened.
  static absl::StatusOr<std::unique_ptr<AccessLog>> Open(
      const std::string& destination);

  AccessLog(const AccessLog&) = delete;
  AccessLog& operator=(const AccessLog&) = delete;
  // Writes the lines still queued, then closes the file.
  ~AccessLog();

  // Queues `record`'s line, or drops it when kMaxPendingBytes are queued.
  void Write(const AccessRecord& record) ABSL_LOCKS_EXCLUDED(mutex_);

  // Lines dropped since the start, and lines that could not be written (a
  // full disk, a closed pipe).
  int64_t dropped() const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  AccessLog(int fd, bool owns_fd);
  void WriteLoop() ABSL_LOCKS_EXCLUDED(mutex_);

  const int fd_;
  const bool owns_fd_;
  mutable absl::Mutex mutex_;
  std::string pending_ ABSL_GUARDED_BY(mutex_);
  int64_t dropped_ ABSL_GUARDED_BY(mutex_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::thread writer_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_ACCESS_LOG_H_
