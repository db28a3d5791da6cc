// The gRPC port's listener, ours rather than gRPC's: gRPC 1.51 stops accepting
// for good after one accept4 error other than EAGAIN, so a burst of
// connections past the process's descriptor limit left the port deaf (every
// later client waiting in the kernel's queue) while the connections already
// open and /metrics looked healthy. This thread accepts instead, sheds what no
// descriptor can take (ConnectionShedder) and hands each connection to the
// gRPC server (ServerBuilder::experimental().AddExternalConnectionAcceptor),
// which then serves it as one of its own, once ConnectionTally admits it.
#ifndef ATTNSERVE_SERVER_RPC_CONNECTION_ACCEPTOR_H_
#define ATTNSERVE_SERVER_RPC_CONNECTION_ACCEPTOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnserve/common/listen_socket.h"
#include "grpcpp/server_builder.h"

namespace attnserve {

// The gRPC port's open connections, each counted for the client address it
// comes from, and the rule a new one passes. An idle HTTP/2 connection holds
// 15 KiB of gRPC's memory and a few of the kernel's, in no other budget: one
// client with 65,000 ports (or a few addresses) could otherwise take a
// gigabyte. So:
// - at most `max_connections` are open;
// - up to seven eighths open, any address takes a place (one client alone,
//   or a proxy, may hold that many);
// - past it, an address takes one of the F places still free only while it
//   holds fewer than 4 F² / max_connections: a sixteenth at seven eighths,
//   fewer as the places run out, and the last ones (F at most half the square
//   root of the limit) only for addresses holding none (a health probe, a
//   new client). Filling the limit so takes about as many addresses as the
//   square root of the limit (43 for 2,048), not the three that a flat share
//   of a sixteenth would need.
// Clients behind one proxy or NAT share an address.
//
// A connection is gRPC's once admitted, and gRPC closes it: the tally knows
// each by its descriptor and the socket's inode, and a connection whose
// descriptor was closed (it names nothing now, or another file) is forgotten
// at the next Sweep. Thread-safe.
class ConnectionTally {
 public:
  enum class Verdict {
    kAdmitted,
    // max_connections are open.
    kFull,
    // Past seven eighths open, the connections from the address are too many
    // for the places still free.
    kAddressShare,
  };

  // `max_connections` > 0; Admit sweeps at most once per `sweep_interval`.
  explicit ConnectionTally(
      int64_t max_connections,
      absl::Duration sweep_interval = absl::Milliseconds(100));
  ConnectionTally(const ConnectionTally&) = delete;
  ConnectionTally& operator=(const ConnectionTally&) = delete;

  // Counts socket `fd` (open in this process) as a connection from `address`,
  // or says why not (sweeping first when the counts would refuse it).
  Verdict Admit(int fd, const std::string& address) ABSL_LOCKS_EXCLUDED(mutex_);
  // Forgets the connections whose descriptors were closed.
  void Sweep() ABSL_LOCKS_EXCLUDED(mutex_);

  int64_t max_connections() const { return max_connections_; }
  // Connections counted open (as of the last Sweep).
  int64_t open() const ABSL_LOCKS_EXCLUDED(mutex_);
  int64_t open_from(const std::string& address) const
      ABSL_LOCKS_EXCLUDED(mutex_);
  // Connections refused so far, for `why` (kFull or kAddressShare).
  int64_t refused(Verdict why) const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  struct Connection {
    uint64_t device = 0;  // The socket's st_dev and st_ino.
    uint64_t inode = 0;
    std::string address;
  };

  // Whether the counts admit a connection from `address`, or why not.
  Verdict Judge(const std::string& address) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  int64_t OpenFrom(const std::string& address) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void SweepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void Forget(int fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  const int64_t max_connections_;
  const absl::Duration sweep_interval_;
  mutable absl::Mutex mutex_;
  // Each open connection, by descriptor.
  absl::flat_hash_map<int, Connection> connections_ ABSL_GUARDED_BY(mutex_);
  // How many each address has open.
  absl::flat_hash_map<std::string, int64_t> addresses_ ABSL_GUARDED_BY(mutex_);
  absl::Time swept_ ABSL_GUARDED_BY(mutex_) = absl::InfinitePast();
  int64_t refused_full_ ABSL_GUARDED_BY(mutex_) = 0;
  int64_t refused_share_ ABSL_GUARDED_BY(mutex_) = 0;
};

// The client address of connected socket `fd` as gRPC names its peer without
// the port ("ipv4:10.0.0.7", "ipv6:[2001:db8::7]"; an IPv4 address mapped
// into IPv6 as IPv4), or "unknown".
std::string SocketPeerAddress(int fd);

class ConnectionAcceptor {
 public:
  // Descriptors the gRPC port's connections leave free for the rest of the
  // process: files, logs, /metrics (which leaves 16 itself), gRPC's own.
  static constexpr int kDescriptorReserve = 64;

  // Listens on `host`:`port` as ListenTcpAll does (the wildcard on IPv6 and
  // IPv4, a name on each of its addresses; port 0: one the system picks),
  // to serve at most `max_connections` (> 0) at once as ConnectionTally
  // rules; UNAVAILABLE with the system's reason when it cannot.
  static absl::StatusOr<std::unique_ptr<ConnectionAcceptor>> Listen(
      const std::string& host, int port, int64_t max_connections);

  ~ConnectionAcceptor();
  ConnectionAcceptor(const ConnectionAcceptor&) = delete;
  ConnectionAcceptor& operator=(const ConnectionAcceptor&) = delete;

  int port() const { return port_; }

  // Hands each new connection to `server` from a thread of its own until Stop.
  // `server` (from the started grpc::Server's builder) outlives this.
  void Start(grpc::experimental::ExternalConnectionAcceptor* server);

  // Closes the listening sockets, after which connections are refused, and
  // ends the thread. Idempotent.
  void Stop();

  // Connections closed unserved for want of descriptors.
  int64_t shed() const { return shedder_.shed(); }
  // The connections open, and those closed unserved for its rule.
  ConnectionTally& tally() { return tally_; }

 private:
  ConnectionAcceptor(std::vector<int> listeners, int wake, int epoll,
                     int64_t max_connections);
  void Loop(grpc::experimental::ExternalConnectionAcceptor* server);
  // Adds the listeners to epoll_ (EPOLL_CTL_ADD) or takes them out (_DEL).
  void WatchListeners(int operation);
  // Hands `server` every connection waiting on `listener`; false when the
  // process is out of descriptors, or the kernel of memory for sockets.
  bool AcceptFrom(int listener,
                  grpc::experimental::ExternalConnectionAcceptor* server);
  // Logs a connection from `address` closed for the tally's rule, at most
  // once per ten seconds (with how many were closed so since). On the
  // acceptor's thread.
  void LogRefusal(ConnectionTally::Verdict verdict, const std::string& address);

  const int port_;
  std::vector<int> listeners_;
  const int wake_;
  const int epoll_;
  ConnectionShedder shedder_{kDescriptorReserve};
  ConnectionTally tally_;
  // LogRefusal's; the acceptor's thread alone touches them.
  absl::Time refusal_logged_ = absl::InfinitePast();
  int64_t refusals_unlogged_ = 0;
  absl::Mutex mutex_;
  bool stopped_ ABSL_GUARDED_BY(mutex_) = false;
  std::thread thread_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_CONNECTION_ACCEPTOR_H_
