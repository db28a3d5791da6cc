// ComputeJob: the one path from the queue to the engine for every request that
// computes: Attend, MultiHeadAttention and the Attends of AttendStream.
//
// On its way out of the queue a job records its wait, asks its caller whether
// the compute is still wanted (the deadline, the client), runs — alone, or
// batched with alike Attends — times the compute, records the
// metrics and the response's timing, and hands the status back to its caller.
// A job run alone keeps asking while it computes (the engine polls between
// its tiles): once the caller's deadline passes or the client goes, the
// compute stops, frees its scratch and the executor takes the next job.
#ifndef ATTNSERVE_SERVER_ATTENTION_COMPUTE_JOB_H_
#define ATTNSERVE_SERVER_ATTENTION_COMPUTE_JOB_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "attnserve/core/attention_engine.h"
#include "attnserve/server/attention/request_validator.h"
#include "attnserve/server/attention/scheduler.h"
#include "attnserve/server/metrics/metrics.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// The call a compute job answers: a unary call, or one message of a stream.
class ComputeCaller {
 public:
  virtual ~ComputeCaller() = default;

  // Why the compute should no longer start, or go on (the deadline passed,
  // the client went away), or OK. Called from the computing threads,
  // concurrently: must be thread-safe.
  virtual absl::Status StillWanted() const = 0;

  // The compute's outcome, or why it never ran; with OK the response is
  // filled. The job touches neither the caller nor the response after this.
  virtual void Computed(const absl::Status& status) = 0;

  // Who the caller is to the queue (QueueClient), among whom it shares its
  // turns and places; asked once, as the job is made.
  virtual std::string client() const { return std::string(); }
};

// The name a caller's requests take their turns and places in the queue
// under: its address (PeerAddress of `peer`), and its identity
// (CallGate::Identity: a bearer token's or a client certificate's) when it has
// one. So callers with identities of their own are apart behind one proxy or
// NAT, and callers sharing one token are apart at their own addresses, as
// callers without one are (keyed by identity alone, one holder of a shared
// token filled the queue for every other, a review found).
std::string QueueClient(const std::string& identity, const std::string& peer);

// What every job computes with and records into; must outlive the jobs.
struct ComputeContext {
  ServerMetrics* metrics;
  AttentionEngine* engine;
  Scheduler* scheduler;
};

class ComputeJob final : public Job {
 public:
  // An Attend validated into `work`. With batching on (max_batch > 1) it may
  // share a batch with alike Attends; a compute the engine runs on
  // one thread anyway may run on the submitting thread (Scheduler::Submit).
  // `request` and `response` must outlive the job's answer.
  static std::unique_ptr<ComputeJob> ForAttend(
      const ComputeContext& context, Rpc rpc,
      std::shared_ptr<ComputeCaller> caller, absl::Time call_started,
      AttendWork work, const v1::AttendRequest* request,
      v1::AttendResponse* response);

  // Any other compute, run alone: `compute(stop, &flops)` fills the response
  // that `timing` belongs to, handing `stop` to the engine, and does `flops`
  // (which it lowers if it computed less, as a Step whose steps failed).
  using AloneCompute =
      absl::AnyInvocable<absl::Status(const StopCheck&, double*) &&>;
  static std::unique_ptr<ComputeJob> Alone(
      const ComputeContext& context, Rpc rpc,
      std::shared_ptr<ComputeCaller> caller, absl::Time call_started,
      double flops, v1::ServerTiming* timing, AloneCompute compute);

  const std::string& batch_key() const override { return batch_key_; }
  const std::string& client() const override { return client_; }
  bool runs_inline() const override { return runs_inline_; }
  void Run(absl::Span<Job* const> batch) override;
  bool Abandoned() const override { return !caller_->StillWanted().ok(); }
  void Drop() override;
  void Displace(const absl::Status& why) override;

  // Queues the job; if the queue is full, the caller gets RESOURCE_EXHAUSTED
  // at once.
  static void Submit(std::unique_ptr<ComputeJob> job);

 private:
  ComputeJob(const ComputeContext& context, Rpc rpc,
             std::shared_ptr<ComputeCaller> caller, absl::Time call_started,
             double flops, v1::ServerTiming* timing);

  // Records the wait; the caller's verdict on whether to compute.
  absl::Status Dequeue(absl::Time now);

  // Runs the job alone, its caller polled while it computes; counts a stop.
  absl::Status RunAlone();

  const ComputeContext context_;
  const Rpc rpc_;
  const std::shared_ptr<ComputeCaller> caller_;
  const absl::Time call_started_;  // For the timing's server_us.
  double flops_;                   // Set by an alone compute when it runs.
  v1::ServerTiming* const timing_;
  // The compute when the job runs alone.
  AloneCompute compute_;
  // An Attend's, to run it in a batch; unset for other computes.
  std::optional<AttendWork> attend_work_;
  const v1::AttendRequest* attend_request_ = nullptr;
  v1::AttendResponse* attend_response_ = nullptr;
  std::string batch_key_;
  const std::string client_;
  bool runs_inline_ = false;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_COMPUTE_JOB_H_
