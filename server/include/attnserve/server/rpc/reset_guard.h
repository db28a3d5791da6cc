// ResetGuard: the rapid-reset mitigation gRPC 1.51 lacks. A client that opens
// streams and resets them at once (HEADERS + RST_STREAM, CVE-2023-44487) makes
// the server create and tear down a call for each, at no cost to itself and
// without a token. The guard counts, per connection and second, the calls its
// client cancelled before they were answered, and the answers it was sent
// (calls finished OK, stream messages) from its first cancellation in the
// second on. It shuts the connection's socket down, which ends every call on
// it, once the cancellations pass `max_per_second` plus those answers, or
// four times `max_per_second` whatever the answers. A busy client giving some
// calls up (hedged requests, streams closed early) keeps its connection; a
// flood that earns an answer for each reset (a health check each, say) is
// still cut off at four times the cap.
//
//   ResetGuard guard(200);
//   // When a call ends cancelled, its deadline not passed, with the peer it
//   // had on arrival (ServerCall::peer; gRPC forgets it once the call fails):
//   guard.ClientCancelled(peer);
//   // When a call ends having finished OK, and for each message a stream
//   // sends:
//   guard.Answered(peer);
//
// gRPC's public API cannot close a connection, so the socket is found among
// the process's file descriptors by its remote address (ShutDownConnection).
#ifndef ATTNSERVE_SERVER_RPC_RESET_GUARD_H_
#define ATTNSERVE_SERVER_RPC_RESET_GUARD_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attnserve {

// Thread-safe.
class ResetGuard {
 public:
  // `max_per_second` 0 turns the guard off.
  explicit ResetGuard(int max_per_second) : max_per_second_(max_per_second) {}

  // A call from `peer` (gRPC's name for the connection's remote end,
  // "ipv4:10.0.0.7:51234") ended cancelled by its client at `now`. Returns true
  // if that took the connection past the limit and it was shut down.
  bool ClientCancelled(const std::string& peer, absl::Time now = absl::Now())
      ABSL_LOCKS_EXCLUDED(mutex_);

  // `peer` was sent an answer (a call that finished OK, or a stream's message)
  // at `now`; refusals (UNIMPLEMENTED, UNAUTHENTICATED, the budget's) are not
  // answers: they cost a client nothing.
  // Counted only for a connection that has cancelled a call in the last
  // second: the others need no count, nor an entry.
  void Answered(const std::string& peer, absl::Time now = absl::Now())
      ABSL_LOCKS_EXCLUDED(mutex_);

  // Connections shut down so far.
  int64_t closed() const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  // One connection's second, from its first cancellation.
  struct Window {
    absl::Time start;
    int64_t cancelled = 0;
    int64_t answered = 0;
    bool closed = false;
  };

  const int max_per_second_;
  mutable absl::Mutex mutex_;
  absl::flat_hash_map<std::string, Window> windows_ ABSL_GUARDED_BY(mutex_);
  absl::Time last_sweep_ ABSL_GUARDED_BY(mutex_) = absl::InfinitePast();
  // When a call was last cancelled (Unix microseconds): no window is open a
  // second after it, and Answered takes no lock.
  std::atomic<int64_t> last_cancel_us_{0};
  int64_t closed_ ABSL_GUARDED_BY(mutex_) = 0;
};

// Shuts down (both directions) the TCP socket of this process whose remote end
// is `peer` ("ipv4:A.B.C.D:PORT" or "ipv6:[...]:PORT", as gRPC names peers),
// found through /proc/self/net/tcp{,6} and /proc/self/fd. NOT_FOUND if no such
// socket is open; INVALID_ARGUMENT for a peer of another form (a Unix socket).
absl::Status ShutDownConnection(const std::string& peer);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_RESET_GUARD_H_
