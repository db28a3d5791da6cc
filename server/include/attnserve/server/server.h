// AttnServer: the attnserve gRPC server — attention service, health, reflection
// — in a process.
//
// clang-format off
//   ServerOptions options;
//   options.port = 0;  // Any free port.
//   ATTNSERVE_ASSIGN_OR_RETURN(std::unique_ptr<AttnServer> server,
//                              AttnServer::Start(options));
//   std::cout << "listening on port " << server->port() << "\n";
//   ...
//   server->Shutdown();
// clang-format on
#ifndef ATTNSERVE_SERVER_SERVER_H_
#define ATTNSERVE_SERVER_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attnserve/server/server_options.h"

namespace attnserve {

// A running server. Thread-safe.
class AttnServer {
 public:
  // Builds the engine and starts serving. Returns INVALID_ARGUMENT for bad
  // options, FAILED_PRECONDITION for memory budgets that do not fit the
  // memory limit, and UNAVAILABLE if the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<AttnServer>> Start(
      const ServerOptions& options);

  // The checks Start makes before it builds or opens anything (the options'
  // values and the memory plan), with the same errors: for a dry run
  // (attnserve --only_check_args).
  static absl::Status Check(const ServerOptions& options);

  virtual ~AttnServer() = default;

  // The port the server listens on.
  virtual int port() const = 0;

  // The port /metrics is served on, or 0 if metrics are off.
  virtual int metrics_port() const = 0;

  // One line with the effective configuration and runtime, for the start-up
  // log.
  virtual std::string Describe() const = 0;

  // Names of the weight sets registered at start-up: "demo" (unless
  // demo_weights is off), then weights_dir's, sorted.
  virtual const std::vector<std::string>& startup_weights() const = 0;

  // Drains and stops: health turns NOT_SERVING at once; after drain_grace new
  // calls get UNAVAILABLE; queued and running work finishes and every accepted
  // call is answered (up to 30 s more); then the server stops. Idempotent. The
  // destructor calls it.
  virtual void Shutdown() = 0;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_SERVER_H_
