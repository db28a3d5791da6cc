#include "attnserve/server/attention/scheduler.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attnserve {

const std::string Job::no_key_;

Scheduler::Scheduler(const SchedulerOptions& options) : options_(options) {
  for (int i = 0; i < options_.executors; ++i)
    workers_.emplace_back([this] { Work(); });
}

Scheduler::~Scheduler() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  for (std::thread& worker : workers_) worker.join();
}

absl::Status Scheduler::Submit(std::unique_ptr<Job> job) {
  std::vector<std::unique_ptr<Job>> dropped;
  std::vector<std::pair<std::unique_ptr<Job>, absl::Status>> displaced;
  // Answered once the lock is let go, whatever becomes of `job`.
  struct AnswerLater {
    std::vector<std::unique_ptr<Job>>* dropped;
    std::vector<std::pair<std::unique_ptr<Job>, absl::Status>>* displaced;
    ~AnswerLater() {
      for (const std::unique_ptr<Job>& gone : *dropped) gone->Drop();
      for (auto& [passed, why] : *displaced) passed->Displace(why);
    }
  } answer_later{&dropped, &displaced};
  {
    absl::MutexLock lock(&mutex_);
    if (static_cast<int>(queue_.size()) >= options_.max_queue) {
      TakeAbandoned(&dropped);
    }
    if (static_cast<int>(queue_.size()) >= options_.max_queue &&
        !DisplaceFor(job->client(), &displaced)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the compute queue is full: ", queue_.size(),
          " requests wait, the max_queue limit is ", options_.max_queue,
          "; every client's calls share it: retry after a backoff or on "
          "another replica"));
    }
    job->enqueued_ = absl::Now();
    ++submitted_;
    if (!job->runs_inline() || !queue_.empty() ||
        running_ >= options_.executors || stopping_) {
      Enqueue(std::move(job));
      executor_jobs_.fetch_add(1, std::memory_order_release);
      return absl::OkStatus();
    }
    ++running_;  // Takes an idle executor's turn.
  }
  Job* const jobs[] = {job.get()};
  job->Run(jobs);
  job.reset();
  absl::MutexLock lock(&mutex_);
  --running_;
  return absl::OkStatus();
}

void Scheduler::Enqueue(std::unique_ptr<Job> job) {
  ClientTurns& turns = clients_[job->client()];
  ++turns.queued;
  turns.last_turn = std::max(turns.last_turn, virtual_time_) + 1;
  job->turn_ = turns.last_turn;
  const auto at =
      std::upper_bound(queue_.begin(), queue_.end(), job->turn_,
                       [](uint64_t turn, const std::unique_ptr<Job>& queued) {
                         return turn < queued->turn_;
                       });
  queue_.insert(at, std::move(job));
}

void Scheduler::LeftQueue(const Job& job) {
  const auto found = clients_.find(job.client());
  if (found == clients_.end()) return;
  if (--found->second.queued <= 0) clients_.erase(found);
}

bool Scheduler::DisplaceFor(
    const std::string& client,
    std::vector<std::pair<std::unique_ptr<Job>, absl::Status>>* displaced) {
  const auto own = clients_.find(client);
  const int64_t holds = own == clients_.end() ? 0 : own->second.queued;
  const std::string* heaviest = nullptr;
  int64_t most = 0;
  for (const auto& [name, turns] : clients_) {
    if (turns.queued > most) {
      most = turns.queued;
      heaviest = &name;
    }
  }
  if (heaviest == nullptr || most < holds + 2) return false;
  // Its newest job: the last of its own in the queue.
  for (auto it = queue_.end(); it != queue_.begin();) {
    --it;
    if ((*it)->client() != *heaviest) continue;
    absl::Status why = absl::ResourceExhaustedError(absl::StrCat(
        "the compute queue is full (the max_queue limit is ",
        options_.max_queue,
        ") and this client's calls held the most of its places, ", most,
        ": this one, its newest, gave its place to another client's; retry "
        "after a backoff or on another replica"));
    std::unique_ptr<Job> job = std::move(*it);
    queue_.erase(it);
    LeftQueue(*job);  // May end `heaviest`.
    executor_jobs_.fetch_sub(1, std::memory_order_release);
    displaced->emplace_back(std::move(job), std::move(why));
    return true;
  }
  return false;
}

void Scheduler::TakeAbandoned(std::vector<std::unique_ptr<Job>>* dropped) {
  const size_t before = dropped->size();
  for (auto it = queue_.begin(); it != queue_.end();) {
    if ((*it)->Abandoned()) {
      LeftQueue(**it);
      dropped->push_back(std::move(*it));
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  executor_jobs_.fetch_sub(static_cast<int>(dropped->size() - before),
                           std::memory_order_release);
}

int Scheduler::DropAbandoned() {
  std::vector<std::unique_ptr<Job>> dropped;
  {
    absl::MutexLock lock(&mutex_);
    TakeAbandoned(&dropped);
  }
  for (const std::unique_ptr<Job>& job : dropped) job->Drop();
  return static_cast<int>(dropped.size());
}

bool Scheduler::WaitIdle(absl::Duration timeout) {
  absl::MutexLock lock(&mutex_);
  return mutex_.AwaitWithTimeout(
      absl::Condition(
          +[](Scheduler* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mutex_) {
            return self->queue_.empty() && self->running_ == 0;
          },
          this),
      timeout);
}

std::vector<std::unique_ptr<Job>> Scheduler::NextBatch() {
  while (true) {
    // A queued job waits for a free turn: an inline job may hold one while
    // this executor is idle.
    mutex_.Await(absl::Condition(
        +[](Scheduler* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mutex_) {
          return self->queue_.empty()
                     ? self->stopping_
                     : self->running_ < self->options_.executors;
        },
        this));
    if (queue_.empty()) return {};  // Stopping, nothing left.
    Job* head = queue_.front().get();
    const std::string& key = head->batch_key();
    if (options_.max_batch > 1 && !key.empty() && !stopping_) {
      // Wait for partners until the batch is full or any queued job has waited
      // long enough: the executor does not idle while a job is overdue (a job
      // whose turn comes before a waiting head's takes its place, and must not
      // restart the wait of the job it passed).
      absl::Time oldest = head->enqueued();
      for (const auto& job : queue_) oldest = std::min(oldest, job->enqueued());
      const absl::Time deadline = oldest + options_.max_queue_delay;
      // Stopping ends the wait: the batch runs with the partners it has (the
      // wait below would return at once, and spin, until the deadline).
      while (absl::Now() < deadline && !stopping_) {
        int compatible = 0;
        for (const auto& job : queue_)
          compatible += job->batch_key() == key ? 1 : 0;
        if (compatible >= options_.max_batch) break;
        const int64_t seen = submitted_;
        struct Arrival {
          Scheduler* self;
          int64_t seen;
          const Job* head;
        } arrival{this, seen, head};
        // A partner arrives, the scheduler stops, or the head is gone
        // (dropped, its caller having given it up).
        mutex_.AwaitWithDeadline(
            absl::Condition(
                +[](Arrival* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                  return a->self->submitted_ != a->seen || a->self->stopping_ ||
                         a->self->queue_.empty() ||
                         a->self->queue_.front().get() != a->head;
                },
                &arrival),
            deadline);
        if (queue_.empty() || queue_.front().get() != head)
          break;  // Another worker took it.
      }
      if (queue_.empty() || queue_.front().get() != head) continue;
    }
    std::vector<std::unique_ptr<Job>> batch;
    virtual_time_ = std::max(virtual_time_, head->turn_);
    LeftQueue(*head);
    batch.push_back(std::move(queue_.front()));
    queue_.pop_front();
    if (options_.max_batch > 1 && !key.empty()) {
      for (auto it = queue_.begin();
           it != queue_.end() &&
           static_cast<int>(batch.size()) < options_.max_batch;) {
        if ((*it)->batch_key() == batch.front()->batch_key()) {
          LeftQueue(**it);
          batch.push_back(std::move(*it));
          it = queue_.erase(it);
        } else {
          ++it;
        }
      }
    }
    return batch;
  }
}

void Scheduler::Work() {
  while (true) {
    std::vector<std::unique_ptr<Job>> batch;
    {
      absl::MutexLock lock(&mutex_);
      batch = NextBatch();
      if (batch.empty()) return;
      ++running_;
    }
    std::vector<Job*> jobs;
    for (const auto& job : batch) jobs.push_back(job.get());
    jobs.front()->Run(jobs);
    // Straight after the answers went out, before the jobs' memory is freed:
    // the transport's thread wakes to their events and asks busy() before it
    // spins for the next call.
    executor_jobs_.fetch_sub(static_cast<int>(batch.size()),
                             std::memory_order_release);
    batch.clear();
    absl::MutexLock lock(&mutex_);
    --running_;
  }
}

}  // namespace attnserve
