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

  // Listens on `host`:`port` (port 0: one the system picks); UNAVAILABLE with
  // the system's reason when it cannot.
  static absl::StatusOr<std::unique_ptr<ConnectionAcceptor>> Listen(
      const std::string& host, int port);

  ~ConnectionAcceptor();
  ConnectionAcceptor(const ConnectionAcceptor&) = delete;
  ConnectionAcceptor& operator=(const ConnectionAcceptor&) = delete;

  int port() const { return port_; }

  // Hands each new connection to `server` from a thread of its own until Stop.
  // `server` (from the started grpc::Server's builder) outlives this.
  void Start(grpc::experimental::ExternalConnectionAcceptor* server);

  // Closes the listening socket, after which connections are refused, and
  // ends the thread. Idempotent.
  void Stop();

  // Connections closed unserved for want of descriptors.
  int64_t shed() const { return shedder_.shed(); }

 private:
  ConnectionAcceptor(int listener, int wake, int epoll);
  void Loop(grpc::experimental::ExternalConnectionAcceptor* server);

  const int port_;
  int listener_;
  const int wake_;
  const int epoll_;
  ConnectionShedder shedder_{kDescriptorReserve};
  absl::Mutex mutex_;
  bool stopped_ ABSL_GUARDED_BY(mutex_) = false;
  std::thread thread_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_CONNECTION_ACCEPTOR_H_
