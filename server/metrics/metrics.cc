#include "attnserve/server/metrics/metrics.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace attnserve {
namespace {

// 50 µs to ~26 s in doublings, then 30 s: latency of tiny and of huge requests
// alike.
prometheus::Histogram::BucketBoundaries DurationBuckets() {
  prometheus::Histogram::BucketBoundaries buckets;
  for (double bound = 50e-6; bound < 30.0; bound *= 2) buckets.push_back(bound);
  buckets.push_back(30.0);
  return buckets;
}

const char* StatusCodeName(int code) {
  static const char* const kNames[kStatusCodeCount] = {"OK",
                                                       "CANCELLED",
                                                       "UNKNOWN",
                                                       "INVALID_ARGUMENT",
                                                       "DEADLINE_EXCEEDED",
                                                       "NOT_FOUND",
                                                       "ALREADY_EXISTS",
                                                       "PERMISSION_DENIED",
                                                       "RESOURCE_EXHAUSTED",
                                                       "FAILED_PRECONDITION",
                                                       "ABORTED",
                                                       "OUT_OF_RANGE",
                                                       "UNIMPLEMENTED",
                                                       "INTERNAL",
                                                       "UNAVAILABLE",
                                                       "DATA_LOSS",
                                                       "UNAUTHENTICATED"};
  return kNames[code];
}

// The `reason` label values, by SessionRemoval.
constexpr const char* kRemovalReasons[kSessionRemovalCount] = {
    "evicted", "expired", "deleted", "drained"};

}  // namespace

bool IsComputeRpc(Rpc rpc) {
  return rpc == Rpc::kAttend || rpc == Rpc::kAttendStream ||
         rpc == Rpc::kMultiHeadAttention || rpc == Rpc::kStep ||
         rpc == Rpc::kModelInfer;
}

const char* RpcName(Rpc rpc) {
  static const char* const kNames[kRpcCount] = {"Attend",
                                                "AttendStream",
                                                "MultiHeadAttention",
                                                "PutWeights",
                                                "ListWeights",
                                                "DeleteWeights",
                                                "CreateSession",
                                                "Step",
                                                "ForkSession",
                                                "TruncateSession",
                                                "DeleteSession",
                                                "GetSession",
                                                "ListSessions",
                                                "ServerLive",
                                                "ServerReady",
                                                "ModelReady",
                                                "ServerMetadata",
                                                "ModelMetadata",
                                                "ModelConfig",
                                                "ModelStatistics",
                                                "ModelInfer"};
  return kNames[static_cast<int>(rpc)];
}

ServerMetrics::ServerMetrics(const std::string& version,
                             const RuntimeInfo& runtime)
    : registry_(std::make_shared<prometheus::Registry>()) {
  auto& requests = prometheus::BuildCounter()
                       .Name("attnserve_requests_total")
                       .Help(
                           "Calls of attnserve.v1.AttentionService and "
                           "inference.GRPCInferenceService finished, by RPC "
                           "and gRPC status code.")
                       .Register(*registry_);
  auto& request_duration = prometheus::BuildHistogram()
                               .Name("attnserve_request_duration_seconds")
                               .Help(
                                   "Time from a call's arrival in its handler "
                                   "to its answer, by RPC.")
                               .Register(*registry_);
  auto& queue_wait =
      prometheus::BuildHistogram()
          .Name("attnserve_queue_wait_seconds")
          .Help("Time a validated request waited for a compute executor.")
          .Register(*registry_);
  auto& compute = prometheus::BuildHistogram()
                      .Name("attnserve_compute_seconds")
                      .Help("Time a request's attention compute took.")
                      .Register(*registry_);
  auto& flops = prometheus::BuildCounter()
                    .Name("attnserve_floating_point_operations_total")
                    .Help(
                        "Floating-point operations computed (FlashAttention "
                        "convention, plus "
                        "2 per multiply-add of the projections).")
                    .Register(*registry_);
  auto& stopped =
      prometheus::BuildCounter()
          .Name("attnserve_computes_stopped_total")
          .Help(
              "Computes stopped while they ran, by RPC and reason: deadline "
              "(the call's deadline passed), cancelled (its client went).")
          .Register(*registry_);
  auto& request_bytes =
      prometheus::BuildCounter()
          .Name("attnserve_request_bytes_total")
          .Help("Serialised bytes of requests received, by RPC.")
          .Register(*registry_);
  auto& response_bytes =
      prometheus::BuildCounter()
          .Name("attnserve_response_bytes_total")
          .Help("Serialised bytes of successful responses sent, by RPC.")
          .Register(*registry_);
  auto& not_delivered =
      prometheus::BuildCounter()
          .Name("attnserve_answers_not_delivered_total")
          .Help(
              "OK answers (counted in attnserve_requests_total and "
              "attnserve_response_bytes_total when handed to gRPC) whose "
              "call then ended cancelled before they reached the client: it "
              "stopped reading, reset the call, or its deadline passed.")
          .Register(*registry_);
  for (int r = 0; r < kRpcCount; ++r) {
    const Rpc rpc = static_cast<Rpc>(r);
    PerRpc& per = rpcs_[r];
    per.not_delivered = &not_delivered.Add({{"rpc", RpcName(rpc)}});
    for (int code = 0; code < kStatusCodeCount; ++code) {
      per.requests[code] = &requests.Add(
          {{"rpc", RpcName(rpc)}, {"code", StatusCodeName(code)}});
    }
    per.request_duration =
        &request_duration.Add({{"rpc", RpcName(rpc)}}, DurationBuckets());
    per.request_bytes = &request_bytes.Add({{"rpc", RpcName(rpc)}});
    per.response_bytes = &response_bytes.Add({{"rpc", RpcName(rpc)}});
    if (IsComputeRpc(rpc)) {
      per.queue_wait =
          &queue_wait.Add({{"rpc", RpcName(rpc)}}, DurationBuckets());
      per.compute = &compute.Add({{"rpc", RpcName(rpc)}}, DurationBuckets());
      per.flops = &flops.Add({{"rpc", RpcName(rpc)}});
      per.stopped[0] =
          &stopped.Add({{"rpc", RpcName(rpc)}, {"reason", "deadline"}});
      per.stopped[1] =
          &stopped.Add({{"rpc", RpcName(rpc)}, {"reason", "cancelled"}});
    }
  }
  batch_size_ = &prometheus::BuildHistogram()
                     .Name("attnserve_batch_size")
                     .Help("Requests run together in one compute call.")
                     .Register(*registry_)
                     .Add({}, prometheus::Histogram::BucketBoundaries{
                                  1, 2, 4, 8, 16, 32, 64, 128});
  queue_depth_ =
      &prometheus::BuildGauge()
           .Name("attnserve_queue_depth")
           .Help("Validated requests waiting for a compute executor.")
           .Register(*registry_)
           .Add({});
  in_flight_ = &prometheus::BuildGauge()
                    .Name("attnserve_requests_in_flight")
                    .Help("Calls received and not yet answered.")
                    .Register(*registry_)
                    .Add({});
  weight_sets_ = &prometheus::BuildGauge()
                      .Name("attnserve_weight_sets")
                      .Help("Weight sets held by the registry.")
                      .Register(*registry_)
                      .Add({});
  weights_bytes_ = &prometheus::BuildGauge()
                        .Name("attnserve_weights_bytes")
                        .Help("Bytes of weights held by the registry.")
                        .Register(*registry_)
                        .Add({});
  auto& weights_dir_changes =
      prometheus::BuildCounter()
          .Name("attnserve_weights_dir_changes_total")
          .Help(
              "Weight sets --weights_dir's reloads registered at a new "
              "version, removed with their folder, or failed to load (the "
              "last good version kept), by change.")
          .Register(*registry_);
  weights_dir_changes_ = {&weights_dir_changes.Add({{"change", "registered"}}),
                          &weights_dir_changes.Add({{"change", "removed"}}),
                          &weights_dir_changes.Add({{"change", "failed"}})};
  buffer_pool_bytes_ =
      &prometheus::BuildGauge()
           .Name("attnserve_buffer_pool_bytes")
           .Help(
               "Bytes of tensor buffers kept for reuse between calls "
               "(buffer_pool_bytes), as of the last call answered.")
           .Register(*registry_)
           .Add({});
  inflight_bytes_ =
      &prometheus::BuildGauge()
           .Name("attnserve_inflight_bytes")
           .Help(
               "Bytes of memory that calls in flight hold of their budget "
               "(messages, compute memory, answers not yet sent), sampled "
               "each second.")
           .Register(*registry_)
           .Add({});
  inflight_limit_bytes_ =
      &prometheus::BuildGauge()
           .Name("attnserve_inflight_limit_bytes")
           .Help(
               "The budget calls in flight may hold: max_inflight_bytes less "
               "the quarter given to gRPC's transport buffers.")
           .Register(*registry_)
           .Add({});
  inflight_refused_ =
      &prometheus::BuildCounter()
           .Name("attnserve_inflight_refused_total")
           .Help(
               "Calls and messages refused with RESOURCE_EXHAUSTED because "
               "the memory budget of calls in flight had no room for them.")
           .Register(*registry_)
           .Add({});
  reset_closures_ =
      &prometheus::BuildCounter()
           .Name("attnserve_reset_connections_closed_total")
           .Help(
               "Connections shut down because their client cancelled more "
               "calls in a second than max_client_resets_per_second plus the "
               "answers it was sent in that second, or four times it "
               "(rapid-reset floods).")
           .Register(*registry_)
           .Add({});
  connections_shed_ =
      &prometheus::BuildCounter()
           .Name("attnserve_connections_shed_total")
           .Help(
               "Connections to the gRPC port closed as soon as accepted "
               "because the process was out of file descriptors, or would "
               "have kept fewer than 64 free (or an eighth of ulimit -n).")
           .Register(*registry_)
           .Add({});
  connections_open_ =
      &prometheus::BuildGauge()
           .Name("attnserve_connections")
           .Help("Connections to the gRPC port open now (sampled each second).")
           .Register(*registry_)
           .Add({});
  connections_limit_ =
      &prometheus::BuildGauge()
           .Name("attnserve_connections_limit")
           .Help("The most connections the gRPC port holds (max_connections).")
           .Register(*registry_)
           .Add({});
  {
    prometheus::Family<prometheus::Counter>& refused =
        prometheus::BuildCounter()
            .Name("attnserve_connections_refused_total")
            .Help(
                "Connections to the gRPC port closed as soon as accepted: "
                "reason=\"max_connections\" when that many were open, "
                "\"address_share\" when past seven eighths of them were open "
                "and the client's address held too many for the places left: "
                "4 F^2 / max_connections or more with F free.")
            .Register(*registry_);
    connections_refused_[0] = &refused.Add({{"reason", "max_connections"}});
    connections_refused_[1] = &refused.Add({{"reason", "address_share"}});
  }
  allocation_failures_ =
      &prometheus::BuildCounter()
           .Name("attnserve_allocation_failures_total")
           .Help(
               "Calls answered RESOURCE_EXHAUSTED because an allocation "
               "failed although the memory budgets let them in: the machine "
               "has less memory than max_inflight_bytes and kv_cache_bytes "
               "assume.")
           .Register(*registry_)
           .Add({});
  io_standby_events_ =
      &prometheus::BuildCounter()
           .Name("attnserve_io_standby_events_total")
           .Help(
               "Events the standby thread handled because every io thread "
               "had been busy in one turn for 20 ms (gRPC reading one "
               "connection's flood, or a long handler).")
           .Register(*registry_)
           .Add({});
  access_log_dropped_ =
      &prometheus::BuildCounter()
           .Name("attnserve_access_log_dropped_lines_total")
           .Help(
               "Access-log lines (--access_log) not written: dropped while "
               "4 MiB of lines waited for a slow disk or pipe, or lost to a "
               "failed write.")
           .Register(*registry_)
           .Add({});
  tls_expiry_ =
      &prometheus::BuildGauge()
           .Name("attnserve_tls_certificate_expiry_timestamp_seconds")
           .Help(
               "When the served TLS certificate (--tls_cert) expires, in "
               "seconds since 1970; 0 without TLS. Renewed files are read "
               "every --tls_reload_seconds.")
           .Register(*registry_)
           .Add({});
  auto& tls_reloads =
      prometheus::BuildCounter()
          .Name("attnserve_tls_reloads_total")
          .Help(
              "Changed TLS files read again: replaced (served to new "
              "connections from then on) or refused (a check failed; the "
              "last good set stays served, and the log says why).")
          .Register(*registry_);
  tls_reloads_ = {&tls_reloads.Add({{"result", "replaced"}}),
                  &tls_reloads.Add({{"result", "refused"}})};
  io_spin_seconds_ =
      &prometheus::BuildCounter()
           .Name("attnserve_io_spin_seconds_total")
           .Help(
               "CPU time the first io thread spent polling for the next event "
               "instead of sleeping (io_spin): the price of answering "
               "a client's next call without a wake-up.")
           .Register(*registry_)
           .Add({});
  auto kv_gauge = [this](const char* name, const char* help) {
    return &prometheus::BuildGauge()
                .Name(name)
                .Help(help)
                .Register(*registry_)
                .Add({});
  };
  sessions_ =
      kv_gauge("attnserve_sessions", "KV-cache sessions the server holds.");
  kv_pages_ = kv_gauge("attnserve_kv_pages",
                       "KV-cache pages allocated (held by sessions or read "
                       "by steps in flight).");
  kv_used_bytes_ = kv_gauge("attnserve_kv_cache_bytes",
                            "Bytes of KV-cache pages allocated; never above "
                            "attnserve_kv_cache_budget_bytes.");
  kv_shared_bytes_ = kv_gauge(
      "attnserve_kv_cache_shared_bytes",
      "Bytes of KV-cache pages held by more than one session (forks).");
  kv_budget_bytes_ = kv_gauge("attnserve_kv_cache_budget_bytes",
                              "The KV-cache budget (kv_cache_bytes).");
  auto& removals =
      prometheus::BuildCounter()
          .Name("attnserve_session_removals_total")
          .Help(
              "Sessions removed, by reason: evicted (least recently used, "
              "past the budget or max_sessions), expired (idle past their "
              "TTL), deleted (DeleteSession), drained (shutdown).")
          .Register(*registry_);
  for (size_t i = 0; i < session_removals_.size(); ++i) {
    session_removals_[i] = &removals.Add({{"reason", kRemovalReasons[i]}});
  }
  tokens_appended_ = &prometheus::BuildCounter()
                          .Name("attnserve_session_tokens_appended_total")
                          .Help("Tokens appended to sessions' layers by Step.")
                          .Register(*registry_)
                          .Add({});
  steps_per_call_ =
      &prometheus::BuildHistogram()
           .Name("attnserve_steps_per_call")
           .Help("Session steps carried by one Step call.")
           .Register(*registry_)
           .Add({}, prometheus::Histogram::BucketBoundaries{
                        1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024});
  prometheus::BuildGauge()
      .Name("attnserve_build_info")
      .Help(
          "Always 1; the labels say what this server runs: attnserve and "
          "oneDNN versions, the "
          "CPU ISA oneDNN uses, its threading runtime and the compute threads.")
      .Register(*registry_)
      .Add({{"version", version},
            {"onednn_version", runtime.onednn_version},
            {"cpu_isa", runtime.cpu_isa},
            {"threading", runtime.threading},
            {"threads", absl::StrCat(runtime.threads)}})
      .Set(1);
}

ServerMetrics::~ServerMetrics() = default;

void ServerMetrics::CallStarted(Rpc rpc, int64_t request_bytes) {
  in_flight_->Increment();
  rpcs_[static_cast<int>(rpc)].request_bytes->Increment(
      static_cast<double>(request_bytes));
}

void ServerMetrics::CallFinished(Rpc rpc, absl::StatusCode code,
                                 absl::Duration elapsed,
                                 int64_t response_bytes) {
  PerRpc& per = rpcs_[static_cast<int>(rpc)];
  const int index = static_cast<int>(code);
  per.requests[index >= 0 && index < kStatusCodeCount ? index : 2]
      ->Increment();  // 2: UNKNOWN
  per.request_duration->Observe(absl::ToDoubleSeconds(elapsed));
  per.response_bytes->Increment(static_cast<double>(response_bytes));
  in_flight_->Decrement();
}

void ServerMetrics::Enqueued() { queue_depth_->Increment(); }

void ServerMetrics::Dequeued(Rpc rpc, absl::Duration wait) {
  queue_depth_->Decrement();
  rpcs_[static_cast<int>(rpc)].queue_wait->Observe(absl::ToDoubleSeconds(wait));
}

void ServerMetrics::NotQueued() { queue_depth_->Decrement(); }

void ServerMetrics::Batched(int requests) { batch_size_->Observe(requests); }

void ServerMetrics::Computed(Rpc rpc, absl::Duration elapsed, double flops) {
  PerRpc& per = rpcs_[static_cast<int>(rpc)];
  per.compute->Observe(absl::ToDoubleSeconds(elapsed));
  per.flops->Increment(flops);
}

void ServerMetrics::AnswerNotDelivered(Rpc rpc) {
  rpcs_[static_cast<int>(rpc)].not_delivered->Increment();
}

void ServerMetrics::ComputeStopped(Rpc rpc, absl::StatusCode code) {
  PerRpc& per = rpcs_[static_cast<int>(rpc)];
  if (per.stopped[0] == nullptr) return;
  per.stopped[code == absl::StatusCode::kDeadlineExceeded ? 0 : 1]->Increment();
}

namespace {

// Brings `counter` up to `total`, a count kept elsewhere since the start, of
// which `seen` had been added.
void CatchUp(prometheus::Counter* counter, int64_t total, int64_t* seen) {
  if (total <= *seen) return;
  counter->Increment(static_cast<double>(total - *seen));
  *seen = total;
}

}  // namespace

void ServerMetrics::SetInflightMemory(int64_t held, int64_t limit,
                                      int64_t refused) {
  inflight_bytes_->Set(static_cast<double>(held));
  inflight_limit_bytes_->Set(static_cast<double>(limit));
  absl::MutexLock lock(&sampled_mutex_);
  CatchUp(inflight_refused_, refused, &inflight_refused_seen_);
}

void ServerMetrics::SetResetClosures(int64_t closed) {
  absl::MutexLock lock(&sampled_mutex_);
  CatchUp(reset_closures_, closed, &reset_closures_seen_);
}

void ServerMetrics::SetConnectionsShed(int64_t shed) {
  absl::MutexLock lock(&sampled_mutex_);
  CatchUp(connections_shed_, shed, &connections_shed_seen_);
}

void ServerMetrics::SetConnections(int64_t open, int64_t max,
                                   int64_t refused_full,
                                   int64_t refused_share) {
  connections_open_->Set(static_cast<double>(open));
  connections_limit_->Set(static_cast<double>(max));
  absl::MutexLock lock(&sampled_mutex_);
  CatchUp(connections_refused_[0], refused_full, &connections_refused_seen_[0]);
  CatchUp(connections_refused_[1], refused_share,
          &connections_refused_seen_[1]);
}

void ServerMetrics::SetAllocationFailures(int64_t failures) {
  absl::MutexLock lock(&sampled_mutex_);
  CatchUp(allocation_failures_, failures, &allocation_failures_seen_);
}

void ServerMetrics::SetIoStandbyEvents(int64_t events) {
  absl::MutexLock lock(&sampled_mutex_);
  CatchUp(io_standby_events_, events, &io_standby_events_seen_);
}

void ServerMetrics::SetAccessLogDropped(int64_t dropped) {
  absl::MutexLock lock(&sampled_mutex_);
  CatchUp(access_log_dropped_, dropped, &access_log_dropped_seen_);
}

void ServerMetrics::SetTlsCertificateExpiry(absl::Time not_after) {
  tls_expiry_->Set(not_after == absl::InfinitePast()
                       ? 0.0
                       : absl::ToDoubleSeconds(not_after - absl::UnixEpoch()));
}

void ServerMetrics::TlsReloaded(bool replaced) {
  tls_reloads_[replaced ? 0 : 1]->Increment();
}

void ServerMetrics::SetBufferPoolBytes(int64_t bytes) {
  buffer_pool_bytes_->Set(static_cast<double>(bytes));
}

void ServerMetrics::IoSpun(absl::Duration spun) {
  io_spin_seconds_->Increment(absl::ToDoubleSeconds(spun));
}

void ServerMetrics::SetKvCache(int64_t sessions, int64_t pages, int64_t used,
                               int64_t shared, int64_t budget) {
  sessions_->Set(static_cast<double>(sessions));
  kv_pages_->Set(static_cast<double>(pages));
  kv_used_bytes_->Set(static_cast<double>(used));
  kv_shared_bytes_->Set(static_cast<double>(shared));
  kv_budget_bytes_->Set(static_cast<double>(budget));
}

void ServerMetrics::SessionRemoved(SessionRemoval reason) {
  session_removals_[static_cast<size_t>(reason)]->Increment();
}

void ServerMetrics::TokensAppended(int64_t tokens) {
  tokens_appended_->Increment(static_cast<double>(tokens));
}

void ServerMetrics::StepsPerCall(int64_t steps) {
  steps_per_call_->Observe(static_cast<double>(steps));
}

void ServerMetrics::SetWeightsHeld(int64_t sets, int64_t bytes) {
  weight_sets_->Set(static_cast<double>(sets));
  weights_bytes_->Set(static_cast<double>(bytes));
}

void ServerMetrics::WeightsDirChanged(int64_t registered, int64_t removed,
                                      int64_t failed) {
  weights_dir_changes_[0]->Increment(static_cast<double>(registered));
  weights_dir_changes_[1]->Increment(static_cast<double>(removed));
  weights_dir_changes_[2]->Increment(static_cast<double>(failed));
}

}  // namespace attnserve
