// ServerMetrics: attnserve's Prometheus metrics (docs/metrics.md lists them
// all).
//
// Every family and every series is created in the constructor, so recording
// never allocates or takes the registry's lock, and labels are bounded: rpc (13
// values), gRPC code (17 values) and session removal reason (4 values).
// Thread-safe.
#ifndef ATTNSERVE_SERVER_METRICS_METRICS_H_
#define ATTNSERVE_SERVER_METRICS_METRICS_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnserve/core/attention_types.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace attnserve {

// The RPCs of attnserve.v1.AttentionService, as the `rpc` label names them.
enum class Rpc {
  kAttend,
  kAttendStream,  // One per request on the stream.
  kMultiHeadAttention,
  kPutWeights,
  kListWeights,
  kDeleteWeights,
  kCreateSession,
  kStep,
  kForkSession,
  kTruncateSession,
  kDeleteSession,
  kGetSession,
  kListSessions,
  // inference.GRPCInferenceService (the Open Inference Protocol).
  kServerLive,
  kServerReady,
  kModelReady,
  kServerMetadata,
  kModelMetadata,
  kModelConfig,
  kModelStatistics,
  kModelInfer
};
inline constexpr int kRpcCount = 21;
inline constexpr int kStatusCodeCount = 17;  // OK .. UNAUTHENTICATED

// Why a session left the store, as the `reason` label names it.
enum class SessionRemoval { kEvicted, kExpired, kDeleted, kDrained };
inline constexpr int kSessionRemovalCount = 4;

// The `rpc` label value: "Attend", "MultiHeadAttention", ...
const char* RpcName(Rpc rpc);

// Whether `rpc` runs a compute (Attend, AttendStream, MultiHeadAttention,
// Step, ModelInfer).
bool IsComputeRpc(Rpc rpc);

class ServerMetrics {
 public:
  // `version` is attnserve's; `runtime` fills the build-info labels.
  ServerMetrics(const std::string& version, const RuntimeInfo& runtime);
  ~ServerMetrics();

  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // The registry to expose (or to serialise in tests).
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // A call arrived with a request of `request_bytes` serialised bytes.
  void CallStarted(Rpc rpc, int64_t request_bytes);
  // The call finished with `code` after `elapsed`; `response_bytes` is 0 for a
  // failed call.
  void CallFinished(Rpc rpc, absl::StatusCode code, absl::Duration elapsed,
                    int64_t response_bytes);

  // A compute task entered the executor's queue / left it after `wait`.
  void Enqueued();
  void Dequeued(Rpc rpc, absl::Duration wait);
  // A task counted by Enqueued was refused by the scheduler (queue full,
  // draining): it leaves the depth, and waited for nothing to be observed.
  void NotQueued();
  // A compute ran `requests` requests in one kernel call.
  void Batched(int requests);
  // A compute that ran `rpc`'s requests took `elapsed` and did `flops` for
  // them (recorded once per RPC in a batch).
  void Computed(Rpc rpc, absl::Duration elapsed, double flops);
  // A running compute of `rpc` stopped early with `code` (DEADLINE_EXCEEDED:
  // its deadline passed; CANCELLED: its client went).
  void ComputeStopped(Rpc rpc, absl::StatusCode code);
  // An OK answer of `rpc`, already counted, did not reach its client: the
  // call ended cancelled after it was handed to gRPC.
  void AnswerNotDelivered(Rpc rpc);

  // The registry now holds `sets` weight sets of `bytes` in all.
  void SetWeightsHeld(int64_t sets, int64_t bytes);
  // A look at --weights_dir registered, removed, and failed to load so many
  // sets.
  void WeightsDirChanged(int64_t registered, int64_t removed, int64_t failed);

  // The buffer pool keeps `bytes` for reuse.
  void SetBufferPoolBytes(int64_t bytes);

  // The memory budget of calls in flight: `held` of `limit` bytes, and calls
  // refused for want of it since the start (sampled each second).
  void SetInflightMemory(int64_t held, int64_t limit, int64_t refused);

  // Connections shut down for resetting too many calls, since the start
  // (sampled each second).
  void SetResetClosures(int64_t closed);
  // The gRPC port's connections closed unserved for want of file descriptors
  // (ConnectionAcceptor::shed), as a running total.
  void SetConnectionsShed(int64_t shed);
  // The gRPC port's connections: `open` of `max` (max_connections), and those
  // closed unserved for that limit (`refused_full`) or for their address's
  // share of it (`refused_share`) since the start (sampled each second).
  void SetConnections(int64_t open, int64_t max, int64_t refused_full,
                      int64_t refused_share);
  // Allocations that failed within the budgets (AllocationFailures), as a
  // running total.
  void SetAllocationFailures(int64_t failures);

  // Events the call loop's standby thread handled since the start (sampled
  // each second).
  void SetIoStandbyEvents(int64_t events);

  // Access-log lines dropped (its queue full, or a failed write) since the
  // start (sampled each second).
  void SetAccessLogDropped(int64_t dropped);

  // The served TLS certificate expires at `not_after` (InfinitePast: no
  // TLS).
  void SetTlsCertificateExpiry(absl::Time not_after);
  // Changed TLS files were read again: `replaced` the served set, or were
  // refused by a check.
  void TlsReloaded(bool replaced);

  // An io thread polled without an event for `spun` (--io_spin_us).
  void IoSpun(absl::Duration spun);

  // The KV cache: `sessions` held, `pages` alive, `used` bytes of pages of
  // the `budget`, `shared` of them held by more than one session.
  void SetKvCache(int64_t sessions, int64_t pages, int64_t used, int64_t shared,
                  int64_t budget);
  // A session left the store.
  void SessionRemoved(SessionRemoval reason);
  // Tokens appended to sessions' layers.
  void TokensAppended(int64_t tokens);
  // A Step call carried `steps` steps.
  void StepsPerCall(int64_t steps);

 private:
  struct PerRpc {
    std::array<prometheus::Counter*, kStatusCodeCount> requests{};
    prometheus::Histogram* request_duration = nullptr;
    prometheus::Histogram* queue_wait = nullptr;  // Compute RPCs only.
    prometheus::Histogram* compute = nullptr;     // Compute RPCs only.
    prometheus::Counter* flops = nullptr;         // Compute RPCs only.
    // Computes stopped early: [0] deadline, [1] cancelled. Compute RPCs only.
    std::array<prometheus::Counter*, 2> stopped{};
    prometheus::Counter* request_bytes = nullptr;
    prometheus::Counter* response_bytes = nullptr;
    prometheus::Counter* not_delivered = nullptr;
  };

  std::shared_ptr<prometheus::Registry> registry_;
  std::array<PerRpc, kRpcCount> rpcs_;
  prometheus::Histogram* batch_size_ = nullptr;
  prometheus::Gauge* queue_depth_ = nullptr;
  prometheus::Gauge* in_flight_ = nullptr;
  prometheus::Gauge* weight_sets_ = nullptr;
  prometheus::Gauge* weights_bytes_ = nullptr;
  // --weights_dir changes: registered, removed, failed.
  std::array<prometheus::Counter*, 3> weights_dir_changes_{};
  prometheus::Gauge* buffer_pool_bytes_ = nullptr;
  prometheus::Gauge* inflight_bytes_ = nullptr;
  prometheus::Gauge* inflight_limit_bytes_ = nullptr;
  prometheus::Counter* inflight_refused_ = nullptr;
  prometheus::Counter* reset_closures_ = nullptr;
  prometheus::Counter* connections_shed_ = nullptr;
  prometheus::Gauge* connections_open_ = nullptr;
  prometheus::Gauge* connections_limit_ = nullptr;
  // Refused for max_connections, and for the address's share of it.
  std::array<prometheus::Counter*, 2> connections_refused_{};
  prometheus::Counter* allocation_failures_ = nullptr;
  prometheus::Counter* io_standby_events_ = nullptr;
  prometheus::Counter* access_log_dropped_ = nullptr;
  prometheus::Gauge* tls_expiry_ = nullptr;
  // Changed TLS files: replaced, refused.
  std::array<prometheus::Counter*, 2> tls_reloads_{};
  // What the sampled counters have been brought up to.
  absl::Mutex sampled_mutex_;
  int64_t inflight_refused_seen_ ABSL_GUARDED_BY(sampled_mutex_) = 0;
  int64_t reset_closures_seen_ ABSL_GUARDED_BY(sampled_mutex_) = 0;
  int64_t connections_shed_seen_ ABSL_GUARDED_BY(sampled_mutex_) = 0;
  std::array<int64_t, 2> connections_refused_seen_
      ABSL_GUARDED_BY(sampled_mutex_) = {0, 0};
  int64_t allocation_failures_seen_ ABSL_GUARDED_BY(sampled_mutex_) = 0;
  int64_t io_standby_events_seen_ ABSL_GUARDED_BY(sampled_mutex_) = 0;
  int64_t access_log_dropped_seen_ ABSL_GUARDED_BY(sampled_mutex_) = 0;
  prometheus::Counter* io_spin_seconds_ = nullptr;
  prometheus::Gauge* sessions_ = nullptr;
  prometheus::Gauge* kv_pages_ = nullptr;
  prometheus::Gauge* kv_used_bytes_ = nullptr;
  prometheus::Gauge* kv_shared_bytes_ = nullptr;
  prometheus::Gauge* kv_budget_bytes_ = nullptr;
  // By SessionRemoval.
  std::array<prometheus::Counter*, kSessionRemovalCount> session_removals_{};
  prometheus::Counter* tokens_appended_ = nullptr;
  prometheus::Histogram* steps_per_call_ = nullptr;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_METRICS_METRICS_H_
