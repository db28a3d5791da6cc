// Scheduler: the bounded queue between the gRPC handlers and the compute, with
// dynamic batching.
//
// Handlers validate a request and Submit a Job. Worker threads (the executors)
// take jobs in turns among the clients that have jobs queued (start-time fair
// queueing: each client's jobs in arrival order, one client's backlog never
// ahead of another's next job), and a full queue gives the newest place of the
// client holding the most to a client holding fewer. A job with a batch key
// waits up to max_queue_delay for queued jobs with the same key and runs with
// up to max_batch - 1 of them in one call. A job small enough to run inline
// runs on the submitting thread when an executor is idle and nothing waits:
// handing it to a sleeping executor would cost more than its compute (waking a
// thread is tens of µs on a virtual machine). Either way at most `executors`
// jobs run at once. Thread-safe.
#ifndef ATTNSERVE_SERVER_ATTENTION_SCHEDULER_H_
#define ATTNSERVE_SERVER_ATTENTION_SCHEDULER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace attnserve {

// One request's compute.
class Job {
 public:
  virtual ~Job() = default;

  // Jobs with the same non-empty key may run together; empty: always alone.
  virtual const std::string& batch_key() const { return no_key_; }

  // The client the job is for (QueueClient: its address and identity):
  // the queue shares its turns and places among clients. Empty is a client
  // too.
  virtual const std::string& client() const { return no_key_; }

  // Whether the job may run on the submitting thread: a compute too short to
  // be worth a hand-over, on that thread alone (no OpenMP team).
  virtual bool runs_inline() const { return false; }

  // Runs `batch` (this job first; every job shares its key) and answers each of
  // them. Called once per batch, on a worker thread or, for a job that
  // runs_inline(), on the thread that submitted it.
  virtual void Run(absl::Span<Job* const> batch) = 0;

  // Whether the job's caller has given it up (cancelled, or its deadline
  // passed), for good. Thread-safe and lock-free: the scheduler asks it with
  // its lock held.
  virtual bool Abandoned() const { return false; }

  // Answers an abandoned job without running it; instead of Run.
  virtual void Drop() {}

  // Answers a queued job without running it, instead of Run, with `why`
  // (RESOURCE_EXHAUSTED): a full queue gave its place to another client's.
  virtual void Displace(const absl::Status& /*why*/) { Drop(); }

  // When the job entered the queue.
  absl::Time enqueued() const { return enqueued_; }

 private:
  friend class Scheduler;
  static const std::string no_key_;
  absl::Time enqueued_;
  uint64_t turn_ = 0;  // Its start tag: the queue runs the least first.
};

// A job that runs a function, alone.
class FunctionJob final : public Job {
 public:
  explicit FunctionJob(absl::AnyInvocable<void() &&> function)
      : function_(std::move(function)) {}
  void Run(absl::Span<Job* const> /*batch*/) override {
    std::move(function_)();
  }

 private:
  absl::AnyInvocable<void() &&> function_;
};

struct SchedulerOptions {
  int executors = 1;     // Worker threads, each running one batch at a time.
  int max_queue = 1024;  // Jobs waiting to run; past it Submit refuses.
  int max_batch = 1;     // Most jobs in one batch; 1 turns batching off.
  // How long the first job of a possible batch waits for more; 0 takes what is
  // queued.
  absl::Duration max_queue_delay = absl::ZeroDuration();
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerOptions& options);
  // Runs every job already queued, then joins the workers.
  ~Scheduler();

  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues `job`, or runs it before returning if it runs_inline(), nothing is
  // queued and fewer than `executors` jobs run. When max_queue jobs already
  // wait, the abandoned ones dropped: if another client holds at least two
  // places more than the job's client, its newest job is displaced (answered
  // RESOURCE_EXHAUSTED, on this thread) for this one; otherwise
  // RESOURCE_EXHAUSTED naming max_queue.
  absl::Status Submit(std::unique_ptr<Job> job);

  // Takes the queued jobs whose callers gave them up off the queue and drops
  // them (on this thread), so that their places, and what their calls hold,
  // are free at once rather than when an executor would reach them; a job
  // waiting for batch partners is among them. Returns how many.
  int DropAbandoned();

  // Blocks until no job is queued or running, or `timeout` passes; returns
  // whether idle.
  bool WaitIdle(absl::Duration timeout);

  const SchedulerOptions& options() const { return options_; }

  // Whether a job waits or runs on an executor: its compute then wants the
  // cores its threads were given. Lock-free, for the transport's spinning
  // thread to ask before each poll.
  bool busy() const {
    return executor_jobs_.load(std::memory_order_acquire) > 0;
  }

 private:
  void Work();
  // Takes the next batch off the queue, waiting for partners as the options
  // allow. Empty when stopping with nothing left.
  std::vector<std::unique_ptr<Job>> NextBatch()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Moves the abandoned queued jobs into `dropped`, to be dropped unlocked.
  void TakeAbandoned(std::vector<std::unique_ptr<Job>>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Queues `job` at its turn.
  void Enqueue(std::unique_ptr<Job> job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Counts `job` out of its client's queued jobs, as it leaves the queue.
  void LeftQueue(const Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // With the queue full: takes the newest job of the client holding the most
  // places, if that is at least two more than `client` holds, into
  // `displaced` with the status to answer it with; whether it did.
  bool DisplaceFor(
      const std::string& client,
      std::vector<std::pair<std::unique_ptr<Job>, absl::Status>>* displaced)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  const SchedulerOptions options_;
  absl::Mutex mutex_;
  // By turn, then arrival.
  std::deque<std::unique_ptr<Job>> queue_ ABSL_GUARDED_BY(mutex_);
  // Each client with jobs queued: how many, and its last job's turn. A job's
  // turn is one past the later of its client's last and the turn of the job
  // last taken (virtual_time_), so a client's backlog goes one job per round.
  struct ClientTurns {
    int64_t queued = 0;
    uint64_t last_turn = 0;
  };
  absl::flat_hash_map<std::string, ClientTurns> clients_
      ABSL_GUARDED_BY(mutex_);
  uint64_t virtual_time_ ABSL_GUARDED_BY(mutex_) = 0;
  int64_t submitted_ ABSL_GUARDED_BY(mutex_) = 0;
  // Batches running, on executors or inline; never more than `executors`.
  int running_ ABSL_GUARDED_BY(mutex_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  // Jobs queued, or taken by an executor and not yet finished (inline jobs
  // not counted: they run on the transport's own thread).
  std::atomic<int> executor_jobs_{0};
  std::vector<std::thread> workers_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_SCHEDULER_H_
