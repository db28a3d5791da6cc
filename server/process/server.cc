#include "attnserve/server/server.h"

#include <malloc.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/common/allocation_failures.h"
#include "attnserve/common/log.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/core/attention_engine.h"
#include "attnserve/server/attention/attention_service.h"
#include "attnserve/server/attention/scheduler.h"
#include "attnserve/server/metrics/metrics.h"
#include "attnserve/server/metrics/metrics_endpoint.h"
#include "attnserve/server/rpc/access_log.h"
#include "attnserve/server/rpc/call_gate.h"
#include "attnserve/server/rpc/call_loop.h"
#include "attnserve/server/rpc/connection_acceptor.h"
#include "attnserve/server/rpc/credentials.h"
#include "attnserve/server/rpc/grpc_log.h"
#include "attnserve/server/rpc/health_service.h"
#include "attnserve/server/rpc/memory_budget.h"
#include "attnserve/server/rpc/reflection_service.h"
#include "attnserve/server/sessions/session_store.h"
#include "attnserve/server/weights/weights_dir_watcher.h"
#include "attnserve/server/weights/weights_loader.h"
#include "attnserve/server/weights/weights_registry.h"
#include "grpc/support/log.h"
#include "grpcpp/grpcpp.h"
#include "inference/grpc_service.grpc.pb.h"
#include "prometheus/registry.h"

namespace attnserve {
namespace {

// How long Shutdown waits for calls in flight before cancelling them.
constexpr absl::Duration kShutdownGrace = absl::Seconds(30);

// At the end of a drain: how long refusals are held so that the clients still
// calling are all waiting on one, and, once gRPC's shutdown has stopped taking
// streams, how long its GOAWAYs are given to go out before they are answered
// (waiting at most kStopTakingCallsWait for it to stop: on a loaded machine
// the shutdown's thread may take longer than any fixed delay to run).
constexpr absl::Duration kRefusalsHeld = absl::Milliseconds(200);
constexpr absl::Duration kGoawayDelay = absl::Milliseconds(100);
constexpr absl::Duration kStopTakingCallsWait = absl::Seconds(5);
// At the end of a drain: how long no refusal must come, once the work is
// done, for the server to conclude that no client is calling (a client calling
// in a loop sends its next call as soon as it has its answer; the last answers
// may still be on their way out, or the clients' threads waiting for a core).
constexpr absl::Duration kQuietWait = absl::Milliseconds(100);
// At the end of a drain with no client calling: how long the calls still
// open (answers being sent, health watches ending) are given to finish.
constexpr absl::Duration kSettleWait = absl::Seconds(1);

// How often the server gives freed memory back to the system, if calls ended.
constexpr absl::Duration kTrimPeriod = absl::Seconds(1);
// How soon TLS files refused for the first time are read again.
constexpr absl::Duration kTlsSettle = absl::Seconds(1);

// Threads polling the call loop: --io_threads, or one per 8 of the cores the
// compute spans (which follow OMP_NUM_THREADS, and so a container's CPU limit
// through the image's entrypoint), 1 to 8.
int IoThreads(const ServerOptions& options, const RuntimeInfo& runtime) {
  if (options.transport.io_threads > 0) return options.transport.io_threads;
  return std::clamp(runtime.threads * options.scheduling.executors / 8, 1, 8);
}

const std::string& MetricsAddress(const ServerOptions& options) {
  return options.metrics_address.empty() ? options.address
                                         : options.metrics_address;
}

SessionOptions SessionsWithBudget(SessionOptions options,
                                  const MemoryPlan& memory) {
  options.kv_cache_bytes = memory.kv_cache_bytes;
  return options;
}

// "host:port", with an IPv6 literal in brackets.
std::string HostPort(const std::string& host, int port) {
  return absl::StrContains(host, ':') ? absl::StrCat("[", host, "]:", port)
                                      : absl::StrCat(host, ":", port);
}

class AttnServerImpl final : public AttnServer {
 public:
  // `options` carry the budgets `memory` planned.
  AttnServerImpl(std::unique_ptr<AttentionEngine> engine,
                 const ServerOptions& options, const MemoryPlan& memory,
                 std::vector<std::string> bearer_tokens,
                 std::vector<std::string> admin_tokens,
                 std::unique_ptr<AccessLog> access_log)
      : options_(options),
        memory_(memory),
        engine_(std::move(engine)),
        access_log_(std::move(access_log)),
        metrics_(ATTNSERVE_VERSION, engine_->runtime_info()),
        budget_(memory.calls_bytes()),
        registry_(memory.max_weights_bytes),
        io_threads_(IoThreads(options, engine_->runtime_info())),
        sessions_(SessionsWithBudget(options.sessions, memory), &metrics_),
        gate_(std::move(bearer_tokens), std::move(admin_tokens)),
        scheduler_(options.scheduling),
        service_(&metrics_, engine_.get(), &scheduler_, &registry_, &sessions_,
                 &gate_, &budget_,
                 {options.limits, options.transport.max_message_bytes,
                  engine_.get()},
                 options.transport,
                 std::make_shared<BytesPool>(memory.buffer_pool_bytes),
                 access_log_.get()) {}

  // Registers the demo weights (unless off) and those of weights_dir.
  absl::Status LoadWeights(const ServerOptions& options) {
    if (options.demo_weights) {
      ATTNSERVE_RETURN_IF_ERROR(
          PutWeightsInto(registry_, DemoWeights()).status());
      startup_weights_.push_back(kDemoWeightsName);
    }
    if (options.weights_dir.empty()) return absl::OkStatus();
    watcher_ = std::make_unique<WeightsDirWatcher>(
        options.weights_dir, memory_.max_weights_bytes, &registry_,
        [this](const WeightsDirWatcher::Changes& changes) {
          metrics_.WeightsDirChanged(changes.registered, changes.removed,
                                     changes.failed);
          service_.RecordWeightsHeld();
        });
    ATTNSERVE_ASSIGN_OR_RETURN(std::vector<std::string> names,
                               watcher_->LoadAll());
    for (const std::string& name : names) {
      // A folder named demo replaces the built-in set; list it once.
      if (name != kDemoWeightsName || !options.demo_weights) {
        startup_weights_.push_back(name);
      }
    }
    return absl::OkStatus();
  }

  // Serves /metrics, if asked, on a thread that polls every connection
  // (metrics_endpoint.h): connections held open idle or half-sent cost a
  // slot, not a thread (civetweb's thread per connection let 16 of them hold
  // a scrape past Prometheus's timeout).
  absl::Status ExposeMetrics(const ServerOptions& options) {
    service_.RecordWeightsHeld();
    // The budget's gauges from the first scrape on (the trimmer samples them
    // each second after): a utilisation over a limit of 0 would be NaN.
    metrics_.SetInflightMemory(budget_.held(), budget_.limit(),
                               budget_.refused());
    metrics_.SetConnections(0, memory_.max_connections, 0, 0);
    if (!options.metrics_port) return absl::OkStatus();
    absl::StatusOr<std::unique_ptr<MetricsEndpoint>> endpoint =
        MetricsEndpoint::Start(MetricsAddress(options), *options.metrics_port,
                               metrics_.registry(), {});
    if (!endpoint.ok()) {
      return absl::UnavailableError(
          absl::StrCat("could not serve metrics on ",
                       HostPort(MetricsAddress(options), *options.metrics_port),
                       ": ", endpoint.status().message(),
                       "; expected metrics_address (or, if empty, `address`) "
                       "to be one of this machine, and metrics_port one no "
                       "other process listens on"));
    }
    metrics_endpoint_ = *std::move(endpoint);
    metrics_port_ = metrics_endpoint_->port();
    return absl::OkStatus();
  }

  int metrics_port() const override { return metrics_port_; }

  std::string Describe() const override {
    return absl::StrCat(
        "attnserve ", ATTNSERVE_VERSION, " listening on ",
        HostPort(options_.address, port_), ", metrics ",
        metrics_port_ > 0
            ? absl::StrCat("on ",
                           HostPort(MetricsAddress(options_), metrics_port_),
                           "/metrics")
            : "off",
        "; ", engine_->runtime_info().Description(), ", ",
        DescribeOptions(options_, memory_, io_threads_));
  }

  const std::vector<std::string>& startup_weights() const override {
    return startup_weights_;
  }

  ~AttnServerImpl() override { Shutdown(); }

  absl::Status Listen(const ServerOptions& options) {
    ATTNSERVE_ASSIGN_OR_RETURN(tls_, TlsCredentials::Open(options.tls));
    metrics_.SetTlsCertificateExpiry(tls_->not_after());
    const std::shared_ptr<grpc::ServerCredentials> credentials =
        tls_->credentials();
    // The port is ours (connection_acceptor.h): bound here, without
    // SO_REUSEPORT, so that a second server on a busy port fails instead of
    // silently taking half the connections.
    absl::StatusOr<std::unique_ptr<ConnectionAcceptor>> acceptor =
        ConnectionAcceptor::Listen(options.address, options.port,
                                   memory_.max_connections);
    if (!acceptor.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "could not listen on ", HostPort(options.address, options.port), ": ",
          acceptor.status().message(),
          "; expected `address` to be one of this machine, and `port` one no "
          "other process listens on"));
    }
    acceptor_ = *std::move(acceptor);
    port_ = acceptor_->port();
    grpc::ServerBuilder builder;
    std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> handoff =
        builder.experimental().AddExternalConnectionAcceptor(
            grpc::ServerBuilder::experimental_type::ExternalConnectionType::
                FROM_FD,
            credentials);
    const TransportOptions& transport = options.transport;
    builder.SetMaxReceiveMessageSize(
        static_cast<int>(transport.max_message_bytes));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                               transport.max_concurrent_streams);
    builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                               static_cast<int>(absl::ToInt64Milliseconds(
                                   transport.handshake_timeout)));
    if (transport.max_connection_idle > absl::ZeroDuration()) {
      builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                                 static_cast<int>(absl::ToInt64Milliseconds(
                                     transport.max_connection_idle)));
    }
    const bool compresses =
        transport.response_compression != GRPC_COMPRESS_NONE;
    if (!transport.accept_compressed_requests) {
      // Identity only: a compressed request is refused unread. gRPC compresses
      // responses only with an algorithm enabled here, which also lets
      // requests in with it: the handlers refuse those (AdmitMessage).
      builder.AddChannelArgument(
          GRPC_COMPRESSION_CHANNEL_ENABLED_ALGORITHMS_BITSET,
          (1 << GRPC_COMPRESS_NONE) |
              (compresses ? 1 << transport.response_compression : 0));
    }
    if (transport.accept_compressed_requests || compresses) {
      // gRPC 1.51 would inflate a whole message before applying the size
      // limit: the handlers inflate instead, with a bound (inflate.h).
      builder.AddChannelArgument(GRPC_ARG_ENABLE_PER_MESSAGE_DECOMPRESSION, 0);
    }
    if (compresses) {
      builder.SetDefaultCompressionAlgorithm(transport.response_compression);
    }
    builder.SetMaxSendMessageSize(
        static_cast<int>(transport.max_message_bytes));
    // The transport's share of the in-flight budget: under its pressure gRPC
    // shrinks the flow-control windows it grants and resets new streams
    // (ENHANCE_YOUR_CALM, which clients see as RESOURCE_EXHAUSTED), so that
    // messages still arriving cannot grow without bound.
    grpc::ResourceQuota quota("attnserve");
    quota.Resize(static_cast<size_t>(memory_.transport_bytes));
    builder.SetResourceQuota(quota);
    loop_.SetBudget(&budget_);
    loop_.SetResetGuard(&reset_guard_);
    loop_.SetComputeBusy([this] { return scheduler_.busy(); });
    service_.AddTo(loop_);
    health_.AddTo(loop_);
    reflection_.AddTo(loop_);
    loop_.AddTo(builder);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("could not start the gRPC server on ",
                       HostPort(options.address, options.port)));
    }
    handoff_ = std::move(handoff);
    acceptor_->Start(handoff_.get());
    loop_.Start(io_threads_, transport.io_spin,
                [this](absl::Duration spun) { metrics_.IoSpun(spun); });
    trimmer_ = std::thread([this] { TrimMemory(); });
    if (tls_->tls() && options.tls.reload_interval > absl::ZeroDuration()) {
      tls_reloader_ =
          std::thread([this, interval = options.tls.reload_interval] {
            ReloadTlsEvery(interval);
          });
    }
    if (watcher_ != nullptr &&
        options.weights_reload_interval > absl::ZeroDuration()) {
      watcher_->Start(options.weights_reload_interval);
    }
    health_.SetServing(true);
    return absl::OkStatus();
  }

  int port() const override { return port_; }

  void Shutdown() override {
    absl::MutexLock lock(&shutdown_mutex_);
    if (server_ == nullptr || shut_down_) return;
    shut_down_ = true;
    // Not ready before health says NOT_SERVING: a client that heard the
    // watch must find readiness false too (the other order failed a test
    // under a loaded build).
    service_.StopReady();
    health_.SetServing(false);
    // New sessions go to other replicas at once; the steps of the sessions
    // held here are served through the grace period.
    sessions_.StopCreating();
    absl::SleepFor(options_.drain_grace);
    gate_.Close();
    // Streams waiting for their client's next message would hold gRPC's
    // shutdown to its deadline.
    service_.EndStreams();
    const absl::Time deadline = absl::Now() + kShutdownGrace;
    scheduler_.WaitIdle(kShutdownGrace);
    health_.Shutdown();  // Ends health watches, which would hold the server.
    // The clients still calling get their next refusal only once gRPC has
    // stopped taking streams (call_gate.h): the refusals are held for a
    // moment, gRPC's shutdown starts (it waits for the held calls), then they
    // are answered.
    // Without calls refused since the gate closed, through kQuietWait after the
    // work is done, no client is calling: the end of the work is no proof of
    // that, as every client may be waiting for an answer still on its way
    // (attnctl_drain_test saw a shutdown that began then cut the clients' next
    // calls, CANCELLED). Then, once the last answers (and the health watches'
    // ends) are out, no call is left to lose, and gRPC's shutdown is told to
    // disconnect at once.
    // Otherwise it sends GOAWAY and waits for each idle client to answer its
    // ping, which an idle gRPC client's backup poller does only every 5 s (a
    // drain took 5-15 s past its grace with idle clients attached).
    const absl::Time quiet_until = absl::Now() + kQuietWait;
    const absl::Time settle_by = absl::Now() + kSettleWait;
    while (gate_.refused_closed() == 0 &&
           (absl::Now() < quiet_until ||
            (loop_.live_calls() > 0 && absl::Now() < settle_by))) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    // gRPC's Shutdown would close its own listener first: ours closes here.
    acceptor_->Stop();
    if (gate_.refused_closed() == 0) {
      server_->Shutdown(
          absl::ToChronoTime(loop_.live_calls() == 0 ? absl::Now() : deadline));
    } else {
      gate_.HoldRefusals();
      absl::SleepFor(kRefusalsHeld);
      std::thread stopping([this, deadline] {
        server_->Shutdown(absl::ToChronoTime(deadline));
      });
      const absl::Time stop_by = absl::Now() + kStopTakingCallsWait;
      while (!loop_.stopped_taking_calls() && absl::Now() < stop_by) {
        absl::SleepFor(absl::Milliseconds(5));
      }
      absl::SleepFor(kGoawayDelay);
      gate_.ReleaseHeld();
      stopping.join();
    }
    loop_.Shutdown();
    // Sessions live in memory only: with every step answered, they go.
    sessions_.Clear();
    {
      absl::MutexLock trim_lock(&trim_mutex_);
      stop_trimming_ = true;
    }
    if (trimmer_.joinable()) trimmer_.join();
    stop_reloading_tls_.Notify();
    if (tls_reloader_.joinable()) tls_reloader_.join();
  }

 private:
  // Every kTrimPeriod in which calls ended, gives the memory malloc keeps free
  // back to the system. Most allocations happen on the few io threads, and
  // glibc keeps what a burst freed in their arenas (a storm of expired calls
  // left 170 MB held, 34 MB in use): RSS should show what the server holds,
  // for the container's memory limit and for leak checks. The attnserve binary
  // also has malloc keep freed memory in one arena between trims (main.cc).
  void TrimMemory() {
    int64_t trimmed_at = 0;
    while (true) {
      {
        absl::MutexLock lock(&trim_mutex_);
        if (trim_mutex_.AwaitWithTimeout(absl::Condition(&stop_trimming_),
                                         kTrimPeriod)) {
          return;
        }
      }
      metrics_.SetInflightMemory(budget_.held(), budget_.limit(),
                                 budget_.refused());
      metrics_.SetResetClosures(reset_guard_.closed());
      metrics_.SetConnectionsShed(acceptor_->shed());
      ConnectionTally& connections = acceptor_->tally();
      connections.Sweep();
      metrics_.SetConnections(
          connections.open(), connections.max_connections(),
          connections.refused(ConnectionTally::Verdict::kFull),
          connections.refused(ConnectionTally::Verdict::kAddressShare));
      metrics_.SetAllocationFailures(AllocationFailures());
      metrics_.SetIoStandbyEvents(loop_.standby_events());
      if (access_log_ != nullptr) {
        metrics_.SetAccessLogDropped(access_log_->dropped());
      }
      // Idle sessions expire on time even when no call comes.
      sessions_.ExpireIdle(absl::Now());
      const int64_t ended = loop_.calls_ended();
      if (ended == trimmed_at) continue;
      trimmed_at = ended;
      malloc_trim(0);
    }
  }

  // Reads the TLS files every `interval` on a thread of their own: a file
  // system that hangs a read holds the reloads up, not the trimmer's sampling
  // and the sessions' expiry (they shared its thread until 2026-12-07). Files
  // refused for the first time are read again after kTlsSettle: a pair
  // rewritten in place, the key before its certificate, is caught half
  // written by one reload in a few, and is then served a moment later
  // instead of an interval later.
  void ReloadTlsEvery(absl::Duration interval) {
    bool refused_before = false;
    absl::Duration wait = interval;
    while (!stop_reloading_tls_.WaitForNotificationWithTimeout(wait)) {
      // A refusal the next read may clear is logged once that read fails.
      const bool refused =
          !ReloadTls(/*log_refusal=*/refused_before || interval <= kTlsSettle);
      wait = refused && !refused_before ? std::min(interval, kTlsSettle)
                                        : interval;
      refused_before = refused;
    }
  }

  // Reads the TLS files again (TlsCredentials::Reload): a renewed set is
  // served to new connections from now on; files that fail a check are
  // logged (once while they stay as they are) and the served set stays.
  // False if they were refused.
  bool ReloadTls(bool log_refusal) {
    const absl::StatusOr<bool> reloaded = tls_->Reload();
    const std::string served_until = absl::FormatTime(
        absl::RFC3339_sec, tls_->not_after(), absl::UTCTimeZone());
    if (reloaded.ok()) {
      tls_refusal_.clear();
      if (!*reloaded) return true;
      metrics_.TlsReloaded(true);
      metrics_.SetTlsCertificateExpiry(tls_->not_after());
      Log(LogLevel::kInfo,
          absl::StrCat("attnserve: TLS files changed: new connections get "
                       "the certificate of ",
                       options_.tls.cert_file, ", valid until ", served_until));
      return true;
    }
    metrics_.TlsReloaded(false);
    // The options' names as the operator set them.
    const std::string why =
        absl::StrReplaceAll(reloaded.status().message(),
                            {{"tls.cert_file", "--tls_cert"},
                             {"tls.key_file", "--tls_key"},
                             {"tls.client_ca_file", "--tls_client_ca"}});
    if (!log_refusal || why == tls_refusal_) return false;
    tls_refusal_ = why;
    Log(LogLevel::kWarning,
        absl::StrCat("attnserve: warning: TLS files changed but are not "
                     "served (new connections keep the certificate valid "
                     "until ",
                     served_until, "): ", why));
    return false;
  }

  // Declared in the order they are built; destroyed in reverse: the metrics
  // endpoint, the gRPC server and the loop (after Shutdown has answered every
  // call), the services, the scheduler (its queue empty by then), the registry,
  // the engine.
  const ServerOptions options_;
  const MemoryPlan memory_;
  std::unique_ptr<AttentionEngine> engine_;
  std::unique_ptr<AccessLog> access_log_;  // Null without --access_log.
  ServerMetrics metrics_;
  MemoryBudget budget_;  // Calls in flight; outlives the loop and services.
  ResetGuard reset_guard_{options_.transport.max_client_resets_per_second};
  WeightsRegistry registry_;
  const int io_threads_;
  SessionStore sessions_;
  std::vector<std::string> startup_weights_;
  CallGate gate_;
  Scheduler scheduler_;
  AttentionServiceImpl service_;
  HealthService health_{{v1::AttentionService::service_full_name(),
                         inference::GRPCInferenceService::service_full_name()}};
  ReflectionService reflection_{
      &gate_,
      {v1::AttentionService::service_full_name(),
       inference::GRPCInferenceService::service_full_name(),
       "grpc.health.v1.Health"}};
  int port_ = 0;
  CallLoop loop_;
  // Destroyed after the server, which hands connections to handoff_ no more
  // once shut down; the acceptor is stopped by then.
  std::unique_ptr<ConnectionAcceptor> acceptor_;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> handoff_;
  // The server's credentials read their copies of the TLS files until the
  // server is gone: destroyed after it.
  std::unique_ptr<TlsCredentials> tls_;
  std::string tls_refusal_;  // The last logged; tls_reloader_'s only.
  std::unique_ptr<grpc::Server> server_;
  // Scrapes read metrics_.
  std::unique_ptr<MetricsEndpoint> metrics_endpoint_;
  // Keeps weights_dir's sets registered; stopped first, while the registry,
  // the metrics and the service it updates stand.
  std::unique_ptr<WeightsDirWatcher> watcher_;
  int metrics_port_ = 0;
  std::thread trimmer_;
  std::thread tls_reloader_;  // Without TLS or reloads, none.
  absl::Notification stop_reloading_tls_;
  absl::Mutex trim_mutex_;
  bool stop_trimming_ ABSL_GUARDED_BY(trim_mutex_) = false;
  absl::Mutex shutdown_mutex_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mutex_) = false;
};

// Below this many messages of max_message_bytes in gRPC's quota, start-up
// warns.
constexpr int64_t kQuotaMessages = 4;

// The options checked and the memory planned: what Start and Check share.
absl::StatusOr<MemoryPlan> CheckedMemoryPlan(const ServerOptions& requested) {
  ATTNSERVE_RETURN_IF_ERROR(ValidateServerOptions(requested));
  return PlanMemory(requested.memory, ReadMemoryLimit());
}

}  // namespace

absl::Status AttnServer::Check(const ServerOptions& options) {
  return CheckedMemoryPlan(options).status();
}

absl::StatusOr<std::unique_ptr<AttnServer>> AttnServer::Start(
    const ServerOptions& requested) {
  ATTNSERVE_ASSIGN_OR_RETURN(const MemoryPlan memory,
                             CheckedMemoryPlan(requested));
  SetLogLevel(requested.log_level);
  RouteGrpcLogs();
  if (requested.log_level == LogLevel::kDebug) {
    gpr_set_log_verbosity(GPR_LOG_SEVERITY_DEBUG);
  }
  // A small memory limit plans budgets too small for the largest message:
  // such a request is refused for the budget, every time.
  const int64_t per_connection = memory.calls_bytes() / 2;
  if (per_connection < requested.transport.max_message_bytes) {
    Log(LogLevel::kWarning,
        absl::StrCat(
            "attnserve: warning: one connection may hold ", per_connection,
            " bytes of calls in flight (half of max_inflight_bytes ",
            memory.max_inflight_bytes,
            " less gRPC's quarter), less than a message of max_message_bytes ",
            requested.transport.max_message_bytes,
            ": requests that large are refused RESOURCE_EXHAUSTED; lower "
            "--max_message_bytes, or raise --max_inflight_bytes or the "
            "memory limit"));
  } else if (memory.transport_bytes <
             kQuotaMessages * requested.transport.max_message_bytes) {
    // gRPC's quota fills with messages still arriving, which the budget
    // counts only once whole; under its pressure gRPC resets other clients'
    // streams and closes idle connections. An audit of 2026-12-07: one client
    // sending 24 messages at once, with the quota under three of them, failed
    // a fifth of another client's calls; with it over twenty, none.
    Log(LogLevel::kWarning,
        absl::StrCat(
            "attnserve: warning: gRPC's transport buffers may hold ",
            memory.transport_bytes, " bytes (a quarter of max_inflight_bytes ",
            memory.max_inflight_bytes, "), fewer than ", kQuotaMessages,
            " messages of max_message_bytes ",
            requested.transport.max_message_bytes,
            ": one client sending several messages that large at once can "
            "have gRPC reset or close other clients' calls; lower "
            "--max_message_bytes, or raise --max_inflight_bytes or the "
            "memory limit"));
  }
  if (requested.memory.max_connections == 0 &&
      memory.max_connections < kLeastDerivedConnections) {
    Log(LogLevel::kWarning,
        absl::StrCat("attnserve: warning: the memory budgets set leave room "
                     "for ",
                     memory.max_connections, " connections of ",
                     kConnectionBytes,
                     " bytes: more clients are closed as soon as they "
                     "connect; set --max_connections, or lower a budget"));
  }
  // A caller's share past the whole: the cap never binds, and one caller may
  // fill the cache (as without one), which its setter cannot have meant.
  const SessionOptions& sessions = requested.sessions;
  if (sessions.kv_cache_bytes_per_identity > memory.kv_cache_bytes) {
    Log(LogLevel::kWarning,
        absl::StrCat("attnserve: warning: kv_cache_bytes_per_identity ",
                     sessions.kv_cache_bytes_per_identity,
                     " is more than the whole KV cache (kv_cache_bytes ",
                     memory.kv_cache_bytes,
                     "): it never binds, and one caller may fill the cache; "
                     "lower it (0: no share)"));
  }
  if (sessions.max_sessions_per_identity > sessions.max_sessions) {
    Log(LogLevel::kWarning,
        absl::StrCat("attnserve: warning: max_sessions_per_identity ",
                     sessions.max_sessions_per_identity,
                     " is more than max_sessions ", sessions.max_sessions,
                     ": it never binds; lower it (0: no cap)"));
  }
  ServerOptions options = requested;
  // Executors share the compute threads (those the process may use, or
  // OMP_NUM_THREADS: a container's CPU limit through the entrypoint) unless
  // told otherwise.
  const int executors = options.scheduling.executors;
  if (options.engine.num_threads == 0 && executors > 1) {
    options.engine.num_threads =
        std::max(1, DefaultComputeThreads() / executors);
  }
  ATTNSERVE_ASSIGN_OR_RETURN(std::unique_ptr<AttentionEngine> engine,
                             AttentionEngine::Create(options.engine));
  ATTNSERVE_ASSIGN_OR_RETURN(
      std::vector<std::string> tokens,
      BearerTokensFor("auth_token_file", options.auth_token_file));
  ATTNSERVE_ASSIGN_OR_RETURN(std::vector<std::string> admin_tokens,
                             BearerTokensFor("weights_admin_token_file",
                                             options.weights_admin_token_file));
  // Several tokens are several callers; without admin tokens each may
  // replace or delete the weight sets the others use (an audit of tenant
  // isolation, 2026-12-07, did so).
  if (tokens.size() > 1 && admin_tokens.empty()) {
    Log(LogLevel::kWarning,
        absl::StrCat("attnserve: warning: auth_token_file holds ",
                     tokens.size(),
                     " tokens and no weights_admin_token_file is set: any of "
                     "them may put or delete any weight set, another's "
                     "included; set --weights_admin_token_file to keep weight "
                     "changes to its tokens' holders"));
  }
  std::unique_ptr<AccessLog> access_log;
  if (!options.access_log.empty()) {
    ATTNSERVE_ASSIGN_OR_RETURN(access_log, AccessLog::Open(options.access_log));
  }
  auto server = std::make_unique<AttnServerImpl>(
      std::move(engine), options, memory, std::move(tokens),
      std::move(admin_tokens), std::move(access_log));
  ATTNSERVE_RETURN_IF_ERROR(server->LoadWeights(options));
  // The metrics port first: a start-up that fails there has served no call,
  // and leaves without a drain.
  ATTNSERVE_RETURN_IF_ERROR(server->ExposeMetrics(options));
  ATTNSERVE_RETURN_IF_ERROR(server->Listen(options));
  return server;
}

}  // namespace attnserve
