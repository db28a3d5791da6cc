#include "attnserve/server/attention/compute_job.h"

#include <array>
#include <atomic>
#include <new>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnserve/common/allocation_failures.h"
#include "attnserve/common/flops.h"
#include "attnserve/server/attention/attend_batch.h"
#include "attnserve/server/attention/attention_compute.h"
#include "attnserve/server/rpc/memory_budget.h"

namespace attnserve {

std::string QueueClient(const std::string& identity, const std::string& peer) {
  if (identity.empty()) return PeerAddress(peer);
  return absl::StrCat(identity, " at ", PeerAddress(peer));
}

ComputeJob::ComputeJob(const ComputeContext& context, Rpc rpc,
                       std::shared_ptr<ComputeCaller> caller,
                       absl::Time call_started, double flops,
                       v1::ServerTiming* timing)
    : context_(context),
      rpc_(rpc),
      caller_(std::move(caller)),
      call_started_(call_started),
      flops_(flops),
      timing_(timing),
      client_(caller_->client()) {}

std::unique_ptr<ComputeJob> ComputeJob::ForAttend(
    const ComputeContext& context, Rpc rpc,
    std::shared_ptr<ComputeCaller> caller, absl::Time call_started,
    AttendWork work, const v1::AttendRequest* request,
    v1::AttendResponse* response) {
  const double flops = AttentionFlops(
      work.shape.Dims(), work.plan.options.causal,
      work.plan.options.causal_alignment == CausalAlignment::kBottomRight);
  std::unique_ptr<ComputeJob> job(
      new ComputeJob(context, rpc, std::move(caller), call_started, flops,
                     response->mutable_timing()));
  const SchedulerOptions& scheduling = context.scheduler->options();
  const bool batching = scheduling.max_batch > 1;
  if (batching)
    job->batch_key_ = AttendBatchKey(*context.engine, *request, work);
  // A call the engine runs on one thread anyway runs on the submitting thread
  // when an executor is idle, unless it should wait for batch partners.
  job->runs_inline_ =
      context.engine->AttendRunsOnCallingThread(work.shape) &&
      (!batching || scheduling.max_queue_delay <= absl::ZeroDuration());
  job->attend_work_ = std::move(work);
  job->attend_request_ = request;
  job->attend_response_ = response;
  ComputeJob* const raw = job.get();
  job->compute_ = [raw](const StopCheck& stop, double*) {
    return ComputeAttend(*raw->context_.engine, *raw->attend_work_,
                         *raw->attend_request_, stop, raw->attend_response_);
  };
  return job;
}

std::unique_ptr<ComputeJob> ComputeJob::Alone(
    const ComputeContext& context, Rpc rpc,
    std::shared_ptr<ComputeCaller> caller, absl::Time call_started,
    double flops, v1::ServerTiming* timing, AloneCompute compute) {
  std::unique_ptr<ComputeJob> job(new ComputeJob(
      context, rpc, std::move(caller), call_started, flops, timing));
  job->compute_ = std::move(compute);
  return job;
}

void ComputeJob::Submit(std::unique_ptr<ComputeJob> job) {
  const ComputeContext context = job->context_;
  // A refused job is gone once the scheduler returns; its caller is not.
  const std::shared_ptr<ComputeCaller> caller = job->caller_;
  context.metrics->Enqueued();
  const absl::Status queued = context.scheduler->Submit(std::move(job));
  if (!queued.ok()) {
    // Not a wait of 0: refusals would pull the wait's quantiles (what an
    // autoscaler reads) down just when the queue is full.
    context.metrics->NotQueued();
    caller->Computed(queued);
  }
}

absl::Status ComputeJob::Dequeue(absl::Time now) {
  const absl::Duration waited = now - enqueued();
  context_.metrics->Dequeued(rpc_, waited);
  timing_->set_queue_us(absl::ToInt64Microseconds(waited));
  return caller_->StillWanted();
}

void ComputeJob::Drop() {
  absl::Status wanted = Dequeue(absl::Now());
  // Abandoned for good: a cancel or a passed deadline does not undo itself.
  if (wanted.ok()) wanted = absl::CancelledError("the call was given up");
  caller_->Computed(wanted);
}

void ComputeJob::Displace(const absl::Status& why) {
  // Refused, as by a full queue at Submit: no wait to observe.
  context_.metrics->NotQueued();
  caller_->Computed(why);
}

absl::Status ComputeJob::RunAlone() {
  std::atomic<bool> stopped{false};
  const ComputeCaller* const caller = caller_.get();
  const StopCheck stop = [caller, &stopped]() -> absl::Status {
    const absl::Status wanted = caller->StillWanted();
    if (wanted.ok()) return wanted;
    stopped.store(true, std::memory_order_relaxed);
    return absl::Status(
        wanted.code(),
        wanted.code() == absl::StatusCode::kDeadlineExceeded
            ? "the deadline passed while the compute ran: it stopped"
            : absl::StrCat("the compute stopped: ", wanted.message()));
  };
  const absl::Status status = std::move(compute_)(stop, &flops_);
  if (stopped.load() && !status.ok()) {
    context_.metrics->ComputeStopped(rpc_, status.code());
  }
  return status;
}

void ComputeJob::Run(absl::Span<Job* const> batch) {
  std::vector<ComputeJob*> live;
  std::vector<AttendBatchItem> items;
  const absl::Time dequeued = absl::Now();
  for (Job* job : batch) {
    auto* compute = static_cast<ComputeJob*>(job);
    const absl::Status wanted = compute->Dequeue(dequeued);
    if (!wanted.ok()) {
      compute->caller_->Computed(wanted);
      continue;
    }
    live.push_back(compute);
    if (compute->attend_work_) {
      items.push_back({&*compute->attend_work_, compute->attend_request_,
                       compute->attend_response_});
    }
  }
  if (live.empty()) return;
  const absl::Time started = absl::Now();
  // Only Attends share a key, so a batch of several is all Attends. A batch
  // (of calls small enough to batch) runs to its end.
  absl::Status status;
  try {
    status = live.size() == 1 ? live[0]->RunAlone()
                              : ComputeAttendBatch(*context_.engine, items);
  } catch (const std::bad_alloc&) {
    // What the compute made of the answers is dropped with them.
    status = AllocationFailed("compute the answer",
                              static_cast<int64_t>(live.size()));
  }
  const absl::Duration elapsed = absl::Now() - started;
  // A batch may mix unary and streamed Attends: each RPC records its share.
  std::array<double, kRpcCount> flops{};
  std::array<bool, kRpcCount> present{};
  for (const ComputeJob* job : live) {
    present[static_cast<int>(job->rpc_)] = true;
    flops[static_cast<int>(job->rpc_)] += job->flops_;
  }
  ServerMetrics& metrics = *context_.metrics;
  metrics.Batched(static_cast<int>(live.size()));
  for (int rpc = 0; rpc < kRpcCount; ++rpc) {
    if (!present[rpc]) continue;
    metrics.Computed(static_cast<Rpc>(rpc), elapsed,
                     status.ok() ? flops[rpc] : 0.0);
  }
  const absl::Time ended = absl::Now();
  for (ComputeJob* job : live) {
    job->timing_->set_compute_us(absl::ToInt64Microseconds(elapsed));
    job->timing_->set_server_us(
        absl::ToInt64Microseconds(ended - job->call_started_));
    job->caller_->Computed(status);
  }
}

}  // namespace attnserve
