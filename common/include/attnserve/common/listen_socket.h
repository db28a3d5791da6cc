// Listening TCP sockets that survive running out of file descriptors.
//
// A server whose process has used its last descriptor cannot accept: each
// accept4 fails with EMFILE while the connection stays queued, so a loop that
// waits for the listener to be readable spins, and one that gives up on the
// error (gRPC 1.51's own listener does) never accepts again. ConnectionShedder
// keeps one spare descriptor for that moment: it frees it, takes the queued
// connection, closes it (its client sees the connection closed, not a wait) and
// opens the spare again. It also closes at once each connection that would
// leave fewer than `reserve` descriptors free for the rest of the process
// (files, logs, other listeners): the kernel gives the lowest free number, so
// a connection numbered past the soft limit less the reserve means that every
// lower number is taken.
#ifndef ATTNSERVE_COMMON_LISTEN_SOCKET_H_
#define ATTNSERVE_COMMON_LISTEN_SOCKET_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace attnserve {

// Listening, non-blocking, close-on-exec TCP sockets on `host`:`port`, as gRPC
// binds an address: the wildcard ("", "0.0.0.0" or "::") as one IPv6 socket
// that takes IPv4 too (IPv4 alone without IPv6); a name or address, on each of
// the addresses it resolves to that is on this machine (localhost: ::1 and
// 127.0.0.1), all on one port (port 0: the one the system picks for the
// first). UNAVAILABLE with the system's reason when none binds or the port is
// in use.
absl::StatusOr<std::vector<int>> ListenTcpAll(const std::string& host,
                                              int port);

// The first of ListenTcpAll's sockets (the others closed).
absl::StatusOr<int> ListenTcp(const std::string& host, int port);

// The port `socket` is bound to.
int BoundPort(int socket);

// Raises the soft limit on open descriptors to the hard one; returns the soft
// limit in force afterwards (-1: unlimited).
int64_t RaiseDescriptorLimit();

class ConnectionShedder {
 public:
  // `reserve`: descriptors left free for the rest of the process (at most an
  // eighth of the soft limit, as it stands now: construct it after the limit
  // is set).
  explicit ConnectionShedder(int reserve);
  ~ConnectionShedder();
  ConnectionShedder(const ConnectionShedder&) = delete;
  ConnectionShedder& operator=(const ConnectionShedder&) = delete;

  // The next connection waiting on non-blocking `listener` (non-blocking and
  // close-on-exec itself), those shed on the way closed; or -1 with errno
  // EAGAIN when none waits, EMFILE or ENFILE when the process is out of
  // descriptors (the kernel says so before it looks at the queue, so also
  // once the waiting ones are shed), in which case the caller should wait a
  // moment before trying again, or another accept4 error.
  int Accept(int listener);

  // Connections closed at once since construction.
  int64_t shed() const { return shed_.load(std::memory_order_relaxed); }

 private:
  // Closes one waiting connection with the spare descriptor's help; false if
  // none could be taken.
  bool ShedWithSpare(int listener);

  // Descriptors numbered from here on are shed: every lower one is taken.
  const int64_t ceiling_;
  int spare_ = -1;
  std::atomic<int64_t> shed_{0};
};

}  // namespace attnserve

#endif  // ATTNSERVE_COMMON_LISTEN_SOCKET_H_
