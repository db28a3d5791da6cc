// The gRPC port's listener, ours rather than gRPC's: gRPC 1.51 stops accepting
// for good after one accept4 error other than EAGAIN, so a burst of
// connections past the process's descriptor limit left the port deaf (every
// later client waiting in the kernel's queue) while the connections already
// open and /metrics looked healthy. This thread accepts instead, sheds what no
// descriptor can take (ConnectionShedder) and hands each connection to the
// gRPC server (ServerBuilder::experimental().AddExternalConnectionAcceptor),
// which then serves it as one of its own.
#ifndef ATTNSERVE_SERVER_RPC_CONNECTION_ACCEPTOR_H_
#define ATTNSERVE_SERVER_RPC_CONNECTION_ACCEPTOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/common/listen_socket.h"
#include "grpcpp/server_builder.h"

namespace attnserve {

class ConnectionAcceptor {
 public:
  // Descriptors the gRPC port's connections leave free for the rest of the
  // process: files, logs, /metrics (which leaves 16 itself), gRPC's own.
  static constexpr int kDescriptorReserve = 64;

  // Listens on `host`:`port` as ListenTcpAll does (the wildcard on IPv6 and
  // IPv4, a name on each of its addresses; port 0: one the system picks);
  // UNAVAILABLE with the system's reason when it cannot.
  static absl::StatusOr<std::unique_ptr<ConnectionAcceptor>> Listen(
      const std::string& host, int port);

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

 private:
  ConnectionAcceptor(std::vector<int> listeners, int wake, int epoll);
  void Loop(grpc::experimental::ExternalConnectionAcceptor* server);
  // Adds the listeners to epoll_ (EPOLL_CTL_ADD) or takes them out (_DEL).
  void WatchListeners(int operation);
  // Hands `server` every connection waiting on `listener`; false when the
  // process is out of descriptors, or the kernel of memory for sockets.
  bool AcceptFrom(int listener,
                  grpc::experimental::ExternalConnectionAcceptor* server);

  const int port_;
  std::vector<int> listeners_;
  const int wake_;
  const int epoll_;
  ConnectionShedder shedder_{kDescriptorReserve};
  absl::Mutex mutex_;
  bool stopped_ ABSL_GUARDED_BY(mutex_) = false;
  std::thread thread_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_CONNECTION_ACCEPTOR_H_
