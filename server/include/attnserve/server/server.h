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
#include "absl/time/time.h"
#include "attnserve/core/attention_engine.h"

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
  // SDPA's path: kAuto is the fused kernel unless weights are asked for;
  // kUnfused always materialises the scores (for comparisons).
  AttentionKernel attention_kernel = AttentionKernel::kAuto;
  // The fused kernel's portable code even on an AVX-512 CPU.
  bool portable_kernels = false;
  // The most bytes of registered weights the server holds (PutWeights,
  // --weights_dir, demo). 0: a quarter of the memory limit (the cgroup's, or
  // physical memory), at most 4 GiB.
  int64_t max_weights_bytes = 0;
  // The memory that requests in flight may hold at once: a quarter for gRPC's
  // transport buffers (its ResourceQuota: connections and messages still
  // arriving), the rest for calls from their message's arrival through the
  // queue and the compute to their answer's send. Past it calls get
  // RESOURCE_EXHAUSTED at once. 0: three quarters of what the memory limit
  // leaves after the weights, the buffer pool and 256 MiB for the process.
  // Start refuses (FAILED_PRECONDITION) budgets that do not fit the limit.
  int64_t max_inflight_bytes = 0;
  // Memory kept between calls for requests' and responses' tensor bytes, so
  // that large tensors are read and written into pages already mapped; 0
  // keeps none.
  int64_t buffer_pool_bytes = int64_t{256} << 20;
  // Port of the Prometheus /metrics endpoint, on `address`; 0 picks a free one
  // (see AttnServer::metrics_port()); nullopt (the default here; the binary's
  // --metrics_port defaults to 9464) serves no metrics endpoint.
  std::optional<int> metrics_port;
  // Address of the /metrics endpoint; "" (the default): `address`. A scrape
  // needs no token, so a deployment may keep it on an internal interface.
  std::string metrics_address;
  // Compute executors: worker threads, each running one batch at a time with
  // `threads` OpenMP threads (0: the cores divided among the executors).
  int executors = 1;
  // Threads that poll gRPC and run the handlers (parse, validate, serialise,
  // and calls too small to hand to an executor). 0: one per 8 of the cores the
  // executors compute on, at least 1, at most 8. Each thread past the first
  // hands the poller over on every call (about 2.7 context switches a call
  // each, measured on 2 cores), so more only help when many large requests
  // arrive at once.
  int io_threads = 0;
  // How long the first io thread keeps polling without sleeping after each
  // event, while events come that close together, so that a client's next
  // call is taken without waking a thread (on the 2-vCPU VM measured, the
  // wake-up added ~55 µs to a tiny call's ~180 µs). Costs up to one core while
  // calls keep coming (attnserve_io_spin_seconds_total); zero never spins.
  absl::Duration io_spin = absl::Microseconds(200);
  // Requests waiting for an executor; past it new ones get RESOURCE_EXHAUSTED.
  int max_queue = 1024;
  // HTTP/2 streams one connection may have open at once (SETTINGS
  // MAX_CONCURRENT_STREAMS; gRPC 1.51 advertises no limit by default). A
  // client past it waits for a stream to end.
  int max_concurrent_streams = 256;
  // Calls one connection's client may cancel in one second before the server
  // shuts the connection down (the rapid-reset mitigation gRPC 1.51 lacks:
  // HEADERS + RST_STREAM floods cost the server a call each and the client
  // nothing). Calls whose deadline passed do not count. 0: no limit.
  int max_client_resets_per_second = 200;
  // Whether requests compressed with gzip or deflate are taken. Off: they get
  // UNIMPLEMENTED before anything is inflated. On: gRPC's decompression is
  // turned off (gRPC 1.51 inflates a whole message before it applies
  // max_message_bytes) and the handlers inflate with a bound (inflate.h).
  bool accept_compressed_requests = false;
  // How long a unary call's request may take to arrive after its headers;
  // past it the call is cancelled, so a client that stops sending cannot make
  // the server hold a partial message.
  absl::Duration message_timeout = absl::Seconds(30);
  // How long an AttendStream may wait for its next whole message while a read
  // is pending (its answers all written or being written); past it the
  // stream is cancelled, so an idle or stalled stream cannot be held open
  // forever.
  absl::Duration stream_idle_timeout = absl::Minutes(5);
  // Dynamic batching: Attend requests alike but for B run together, up to
  // max_batch of them; the first waits up to max_queue_delay for partners (0:
  // takes what is already queued).
  int max_batch = 1;
  absl::Duration max_queue_delay = absl::ZeroDuration();
  // Per-request limits, checked before anything is allocated: elements of any
  // one tensor, and the memory a request's compute would allocate (outputs,
  // weights, conversions, scratch).
  int64_t max_elements = int64_t{1} << 28;
  int64_t max_request_memory_bytes = int64_t{4} << 30;
  // On Shutdown: how long the server keeps taking calls after health turns
  // NOT_SERVING, so that load balancers stop sending first; then new calls get
  // UNAVAILABLE while queued and running work finishes.
  absl::Duration drain_grace = absl::ZeroDuration();
  // TLS: PEM files of the server's certificate chain and key; with a client CA,
  // clients must present a certificate it signed (mutual TLS). Empty:
  // plaintext.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  // A file holding the bearer token every call but health checks must carry;
  // empty: none.
  std::string auth_token_file;
  // A folder of weight sets to register at start-up (format in
  // weights_loader.h); empty: none.
  std::string weights_dir;
};

// A running server. Thread-safe.
class AttnServer {
 public:
  // Builds the engine and starts serving. Returns INVALID_ARGUMENT for bad
  // options, FAILED_PRECONDITION for memory budgets that do not fit the
  // memory limit, and UNAVAILABLE if the address cannot be bound.
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

  // Drains and stops: health turns NOT_SERVING at once; after drain_grace new
  // calls get UNAVAILABLE; queued and running work finishes and every accepted
  // call is answered (up to 30 s more); then the server stops. Idempotent. The
  // destructor calls it.
  virtual void Shutdown() = 0;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_SERVER_H_
