// ServerOptions: everything AttnServer::Start takes, composed of each layer's
// own option struct, whose defaults are the server's (and the attnserve
// binary's flags' defaults, except where main.cc says otherwise).
#ifndef ATTNSERVE_SERVER_SERVER_OPTIONS_H_
#define ATTNSERVE_SERVER_SERVER_OPTIONS_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "attnserve/common/log.h"
#include "attnserve/core/attention_types.h"
#include "attnserve/server/attention/request_validator.h"
#include "attnserve/server/attention/scheduler.h"
#include "attnserve/server/process/memory_plan.h"
#include "attnserve/server/rpc/credentials.h"
#include "attnserve/server/rpc/transport_options.h"
#include "attnserve/server/sessions/session_store.h"

namespace attnserve {

struct ServerOptions {
  // Address to listen on: an IPv4 or IPv6 literal or a host name.
  std::string address = "0.0.0.0";
  // TCP port; 0 picks a free one (see AttnServer::port()).
  int port = 50051;

  // The engine each executor computes with. num_threads 0: every core the
  // process may use, divided among the executors.
  EngineOptions engine;
  // The queue between the handlers and the executors, and dynamic batching.
  SchedulerOptions scheduling;
  // Per-request limits, checked before anything is allocated.
  RequestLimits limits;
  // What the transport takes from clients, and its threads.
  TransportOptions transport;
  // The memory budgets; Start refuses (FAILED_PRECONDITION) budgets that do
  // not fit the memory limit.
  MemoryOptions memory;
  // KV-cache sessions: eviction, page size, limits. Their byte budget is
  // memory.kv_cache_bytes (sessions.kv_cache_bytes is ignored here).
  SessionOptions sessions;
  // TLS; no certificate file: plaintext.
  ServerTlsOptions tls;
  // A file holding the bearer tokens, one per line, of which every call but
  // health checks must carry one; each token is an identity of its own (for
  // session ownership). Empty: none.
  std::string auth_token_file;
  // A file of bearer tokens, one per line, of which PutWeights and
  // DeleteWeights must carry one (they are admitted to every call too).
  // Empty: any admitted caller may change weight sets.
  std::string weights_admin_token_file;

  // Port of the Prometheus /metrics endpoint, on `metrics_address`; 0 picks a
  // free one (see AttnServer::metrics_port()); nullopt (the default here; the
  // binary's --metrics_port defaults to 9464) serves no metrics endpoint.
  std::optional<int> metrics_port;
  // Address of the /metrics endpoint; "" (the default): `address`. A scrape
  // needs no token, so a deployment may keep it on an internal interface.
  std::string metrics_address;

  // On Shutdown: how long the server keeps taking calls after health turns
  // NOT_SERVING, so that load balancers stop sending first; then new calls get
  // UNAVAILABLE while queued and running work finishes.
  absl::Duration drain_grace = absl::ZeroDuration();

  // Whether the built-in `demo` weight set is registered at start-up.
  bool demo_weights = true;
  // A folder of weight sets to register at start-up, one sub-folder per set
  // (format in weights/weights_loader.h); empty: none.
  std::string weights_dir;
  // How often weights_dir is looked at again for sets added, changed or
  // removed (weights/weights_dir_watcher.h); zero: only at start-up.
  absl::Duration weights_reload_interval = absl::Seconds(10);

  // The server's own log lines below this level are not written (process-wide:
  // Start sets it). kDebug also turns on gRPC's debug logs.
  LogLevel log_level = LogLevel::kInfo;
  // Where one JSON line per call goes (rpc/access_log.h): "stdout", "stderr"
  // or a file appended to; empty (the default): no access log.
  std::string access_log;
};

// INVALID_ARGUMENT naming the first option out of range (by its name here,
// e.g. "scheduling.max_queue"; the memory budgets are PlanMemory's to check).
absl::Status ValidateServerOptions(const ServerOptions& options);

// The options as the start-up line shows them, with the budgets `memory`
// planned and the io threads chosen: "fused attention; max_message_bytes=...".
std::string DescribeOptions(const ServerOptions& options,
                            const MemoryPlan& memory, int io_threads);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_SERVER_OPTIONS_H_
