// AttnServer: the attnserve gRPC server — attention service, health, reflection
// — in a process.
//
//   ATTNSERVE_ASSIGN_OR_RETURN(std::unique_ptr<AttnServer> server,
//   AttnServer::Start(options)); std::cout << "listening on port " <<
//   server->port();
//   ...
//   server->Shutdown();
#ifndef ATTNSERVE_SERVER_SERVER_H_
#define ATTNSERVE_SERVER_SERVER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace attnserve {

struct ServerOptions {
  // Address to listen on: an IPv4 or IPv6 literal or a host name.
  std::string address = "0.0.0.0";
  // TCP port; 0 picks a free one (see AttnServer::port()).
  int port = 50051;
  // OpenMP threads the compute runs on. 0: every core the process may use.
  int threads = 0;
  // The largest request or response message, in bytes; at most 2^31 - 1 (gRPC's
  // limit).
  int64_t max_message_bytes = int64_t{64} << 20;
  // The most scratch memory one request's compute may allocate.
  int64_t max_workspace_bytes = int64_t{1} << 30;
  // The most bytes of registered weights the server holds (PutWeights,
  // --weights_dir, demo).
  int64_t max_weights_bytes = int64_t{4} << 30;
  // Port of the Prometheus /metrics endpoint, on `address`; 0 picks a free one
  // (see AttnServer::metrics_port()); nullopt (the default here; the binary's
  // --metrics_port defaults to 9464) serves no metrics endpoint.
  std::optional<int> metrics_port;
  // A folder of weight sets to register at start-up (format in
  // weights_loader.h); empty: none.
  std::string weights_dir;
};

// A running server. Thread-safe.
class AttnServer {
 public:
  // Builds the engine and starts serving. Returns INVALID_ARGUMENT for bad
  // options and UNAVAILABLE if the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<AttnServer>> Start(
      const ServerOptions& options);

  virtual ~AttnServer() = default;

  // The port the server listens on.
  virtual int port() const = 0;

  // The port /metrics is served on, or 0 if metrics are off.
  virtual int metrics_port() const = 0;

  // One line with the effective configuration and runtime, for the start-up
  // log.
  virtual std::string Describe() const = 0;

  // Names of the weight sets registered at start-up: "demo", then
  // --weights_dir's, sorted.
  virtual const std::vector<std::string>& startup_weights() const = 0;

  // Stops accepting calls, lets calls in flight finish (up to a grace period),
  // and returns. Idempotent. The destructor calls it.
  virtual void Shutdown() = 0;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_SERVER_H_
