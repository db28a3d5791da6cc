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
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
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
// - an address whose connections are more than a sixteenth of that may not
//   take the count past seven eighths, so that the last eighth stays for
//   other clients (the memory budget's rule for calls in flight);
// - a connection those two would refuse takes the place of the newest
//   connection of the address holding the most, when that address holds at
//   least two more than its own: that connection is shut down (its client
//   sees it end, as if the network dropped it, and reconnects). So a few
//   addresses filling the tally between them cannot keep another client (a
//   probe, a new replica) out; only as many addresses as there are places,
//   one each, can.
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
    // Admitted in the place of another address's newest connection, which
    // was shut down.
    kDisplaced,
    // max_connections are open.
    kFull,
    // The connections from the address hold more than a sixteenth, and seven
    // eighths are open.
    kAddressShare,
  };

  // `max_connections` > 0; Admit sweeps at most once per `sweep_interval`.
  explicit ConnectionTally(
      int64_t max_connections,
      absl::Duration sweep_interval = absl::Milliseconds(100));
  ConnectionTally(const ConnectionTally&) = delete;
  ConnectionTally& operator=(const ConnectionTally&) = delete;

  // Counts socket `fd` (open in this process) as a connection from `address`,
  // displacing another's if the rule above says so (sweeping first when the
  // counts would refuse it; the address it shut down in `displaced` if not
  // null), or says why not.
  Verdict Admit(int fd, const std::string& address,
                std::string* displaced = nullptr) ABSL_LOCKS_EXCLUDED(mutex_);
  // Forgets the connections whose descriptors were closed.
  void Sweep() ABSL_LOCKS_EXCLUDED(mutex_);

  int64_t max_connections() const { return max_connections_; }
  // Connections counted open (as of the last Sweep).
  int64_t open() const ABSL_LOCKS_EXCLUDED(mutex_);
  int64_t open_from(const std::string& address) const
      ABSL_LOCKS_EXCLUDED(mutex_);
  // Connections refused (kFull, kAddressShare) or shut down for another
  // (kDisplaced) so far.
  int64_t count(Verdict verdict) const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  struct Connection {
    uint64_t device = 0;  // The socket's st_dev and st_ino.
    uint64_t inode = 0;
    uint64_t admitted = 0;  // Its place in the order of admission.
    std::string address;
  };
  // An address's connections, by order of admission.
  using Admissions = std::map<uint64_t, int>;

  // Whether the counts admit a connection from `address`, or why not.
  Verdict Judge(const std::string& address) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  int64_t OpenFrom(const std::string& address) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Shuts down the newest connection of the address holding the most, if it
  // holds at least two more than `address` (named in `displaced` if not
  // null); false if none qualifies.
  bool Displace(const std::string& address, std::string* displaced)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void SweepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Counts `fd` open, or forgets it (it must be counted).
  void Add(int fd, Connection connection) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void Forget(int fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  const int64_t max_connections_;
  const absl::Duration sweep_interval_;
  mutable absl::Mutex mutex_;
  // Each open connection, by descriptor.
  absl::flat_hash_map<int, Connection> connections_ ABSL_GUARDED_BY(mutex_);
  // Each address's open connections.
  absl::flat_hash_map<std::string, Admissions> addresses_
      ABSL_GUARDED_BY(mutex_);
  // The addresses by how many they have open, the most last.
  std::set<std::pair<int64_t, std::string>> by_count_ ABSL_GUARDED_BY(mutex_);
  uint64_t admissions_ ABSL_GUARDED_BY(mutex_) = 0;
  absl::Time swept_ ABSL_GUARDED_BY(mutex_) = absl::InfinitePast();
  int64_t full_ ABSL_GUARDED_BY(mutex_) = 0;
  int64_t address_share_ ABSL_GUARDED_BY(mutex_) = 0;
  int64_t displaced_ ABSL_GUARDED_BY(mutex_) = 0;
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
  // Logs a connection refused or displaced by the tally's rule (from
  // `address`; `displaced`'s shut down), at most once per ten seconds, with
  // how many were so since. On the acceptor's thread.
  void LogRefusal(ConnectionTally::Verdict verdict, const std::string& address,
                  const std::string& displaced);

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
