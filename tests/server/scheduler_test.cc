#include "attnserve/server/attention/scheduler.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "attnserve/common/refusals.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::ElementsAre;

// Records the batches it runs in: each run appends the ids of its batch.
class RecordingJob final : public Job {
 public:
  RecordingJob(int id, std::string key, std::vector<std::vector<int>>* batches,
               absl::Mutex* mutex, absl::Notification* gate = nullptr)
      : id_(id),
        key_(std::move(key)),
        batches_(batches),
        mutex_(mutex),
        gate_(gate) {}

  const std::string& batch_key() const override { return key_; }

  void Run(absl::Span<Job* const> batch) override {
    if (gate_ != nullptr) gate_->WaitForNotification();
    std::vector<int> ids;
    for (Job* job : batch) ids.push_back(static_cast<RecordingJob*>(job)->id_);
    absl::MutexLock lock(mutex_);
    batches_->push_back(ids);
  }

 private:
  const int id_;
  const std::string key_;
  std::vector<std::vector<int>>* const batches_;
  absl::Mutex* const mutex_;
  absl::Notification* const gate_;
};

TEST(SchedulerTest, RunsJobsInArrivalOrderWithoutBatching) {
  absl::Mutex mutex;
  std::vector<std::vector<int>> batches;
  {
    Scheduler scheduler(SchedulerOptions{});
    for (int id = 0; id < 5; ++id) {
      ASSERT_TRUE(
          scheduler
              .Submit(std::make_unique<RecordingJob>(id, "k", &batches, &mutex))
              .ok());
    }
  }
  EXPECT_THAT(batches,
              ElementsAre(ElementsAre(0), ElementsAre(1), ElementsAre(2),
                          ElementsAre(3), ElementsAre(4)));
}

TEST(SchedulerTest, BatchesQueuedJobsWithTheSameKeyUpToMaxBatch) {
  absl::Mutex mutex;
  std::vector<std::vector<int>> batches;
  absl::Notification release;
  SchedulerOptions options;
  options.max_batch = 3;
  {
    Scheduler scheduler(options);
    // Job 0 holds the only executor while the rest queue up behind it.
    ASSERT_TRUE(scheduler
                    .Submit(std::make_unique<RecordingJob>(0, "", &batches,
                                                           &mutex, &release))
                    .ok());
    absl::SleepFor(absl::Milliseconds(50));
    const char* keys[] = {"a", "b", "a", "a", "a", ""};
    for (int id = 1; id <= 6; ++id) {
      ASSERT_TRUE(scheduler
                      .Submit(std::make_unique<RecordingJob>(id, keys[id - 1],
                                                             &batches, &mutex))
                      .ok());
    }
    release.Notify();
  }
  // "a" jobs 1, 3, 4 form a batch (max 3); then b alone; then a's 5; then the
  // keyless 6.
  EXPECT_THAT(batches,
              ElementsAre(ElementsAre(0), ElementsAre(1, 3, 4), ElementsAre(2),
                          ElementsAre(5), ElementsAre(6)));
}

TEST(SchedulerTest, WaitsUpToTheQueueDelayForPartners) {
  absl::Mutex mutex;
  std::vector<std::vector<int>> batches;
  SchedulerOptions options;
  options.max_batch = 4;
  options.max_queue_delay = absl::Milliseconds(300);
  {
    Scheduler scheduler(options);
    ASSERT_TRUE(
        scheduler
            .Submit(std::make_unique<RecordingJob>(0, "a", &batches, &mutex))
            .ok());
    absl::SleepFor(absl::Milliseconds(20));
    ASSERT_TRUE(
        scheduler
            .Submit(std::make_unique<RecordingJob>(1, "a", &batches, &mutex))
            .ok());
  }
  EXPECT_THAT(batches, ElementsAre(ElementsAre(0, 1)));
}

TEST(SchedulerTest, RefusesJobsPastMaxQueueNamingTheLimit) {
  absl::Mutex mutex;
  std::vector<std::vector<int>> batches;
  absl::Notification release;
  SchedulerOptions options;
  options.max_queue = 2;
  Scheduler scheduler(options);
  ASSERT_TRUE(scheduler
                  .Submit(std::make_unique<RecordingJob>(0, "", &batches,
                                                         &mutex, &release))
                  .ok());
  absl::SleepFor(absl::Milliseconds(50));  // Job 0 is running, not queued.
  ASSERT_TRUE(
      scheduler.Submit(std::make_unique<RecordingJob>(1, "", &batches, &mutex))
          .ok());
  ASSERT_TRUE(
      scheduler.Submit(std::make_unique<RecordingJob>(2, "", &batches, &mutex))
          .ok());
  const absl::Status full =
      scheduler.Submit(std::make_unique<RecordingJob>(3, "", &batches, &mutex));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(full.message()),
              ::testing::HasSubstr("max_queue limit is 2; every client's calls "
                                   "share it: retry after a backoff"));
  EXPECT_FALSE(IsPermanent(full));  // Room comes as the queue drains.
  EXPECT_FALSE(scheduler.WaitIdle(absl::Milliseconds(10)));
  release.Notify();
  EXPECT_TRUE(scheduler.WaitIdle(absl::Seconds(10)));
}

// A job of a client's: Run records the ids of its batch and when, Displace
// the id; `started`, if given, is notified as it starts running, before it
// waits for `gate`.
class ClientJob final : public Job {
 public:
  struct Log {
    absl::Mutex mutex;
    std::vector<std::string> events;
    std::vector<absl::Time> times;
  };
  ClientJob(std::string client, int id, Log* log,
            absl::Notification* gate = nullptr,
            absl::Notification* started = nullptr, std::string key = "")
      : client_(std::move(client)),
        id_(id),
        log_(log),
        gate_(gate),
        started_(started),
        key_(std::move(key)) {}

  const std::string& client() const override { return client_; }
  const std::string& batch_key() const override { return key_; }
  void Run(absl::Span<Job* const> batch) override {
    if (started_ != nullptr) started_->Notify();
    if (gate_ != nullptr) gate_->WaitForNotification();
    absl::MutexLock lock(&log_->mutex);
    for (Job* job : batch) {
      log_->events.push_back(static_cast<ClientJob*>(job)->name());
      log_->times.push_back(absl::Now());
    }
  }
  void Displace(const absl::Status& why) override {
    EXPECT_EQ(why.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(std::string(why.message()),
                ::testing::HasSubstr("this client's calls held the most of "
                                     "its places"));
    absl::MutexLock lock(&log_->mutex);
    log_->events.push_back("displaced " + name());
    log_->times.push_back(absl::Now());
  }

 private:
  std::string name() const { return client_ + std::to_string(id_); }

  const std::string client_;
  const int id_;
  Log* const log_;
  absl::Notification* const gate_;
  absl::Notification* const started_;
  const std::string key_;
};

// Submits `client`'s job 0, which holds the executor until `gate` is
// notified, and returns once it runs (`started` notified).
void HoldTheExecutor(Scheduler& scheduler, const std::string& client,
                     ClientJob::Log* log, absl::Notification* gate,
                     absl::Notification* started) {
  ASSERT_TRUE(
      scheduler
          .Submit(std::make_unique<ClientJob>(client, 0, log, gate, started))
          .ok());
  started->WaitForNotification();
}

// One client's backlog does not hold another's calls behind it: the queue
// takes the clients' jobs in turns, each client's in arrival order (until
// 2026-12-07 it was one FIFO: an audit's small calls waited 0.42 s behind a
// flood of 46).
TEST(SchedulerTest, ClientsTakeTurns) {
  ClientJob::Log log;
  absl::Notification gate;
  absl::Notification started;
  {
    Scheduler scheduler(SchedulerOptions{});
    ASSERT_NO_FATAL_FAILURE(
        HoldTheExecutor(scheduler, "a", &log, &gate, &started));
    for (int id = 1; id <= 5; ++id) {
      ASSERT_TRUE(
          scheduler.Submit(std::make_unique<ClientJob>("a", id, &log)).ok());
    }
    for (int id = 0; id < 2; ++id) {
      ASSERT_TRUE(
          scheduler.Submit(std::make_unique<ClientJob>("b", id, &log)).ok());
    }
    gate.Notify();
  }
  EXPECT_THAT(log.events,
              ElementsAre("a0", "a1", "b0", "a2", "b1", "a3", "a4", "a5"));
}

// A full queue gives the newest place of the client holding the most to a
// client holding at least two fewer; the one holding the most is refused.
TEST(SchedulerTest, AFullQueueGivesTheHeaviestClientsNewestPlaceAway) {
  ClientJob::Log log;
  absl::Notification gate;
  absl::Notification started;
  SchedulerOptions options;
  options.max_queue = 4;
  {
    Scheduler scheduler(options);
    ASSERT_NO_FATAL_FAILURE(
        HoldTheExecutor(scheduler, "a", &log, &gate, &started));
    for (int id = 1; id <= 4; ++id) {
      ASSERT_TRUE(
          scheduler.Submit(std::make_unique<ClientJob>("a", id, &log)).ok());
    }
    // a holds 4, b none: a4 gives way.
    ASSERT_TRUE(
        scheduler.Submit(std::make_unique<ClientJob>("b", 0, &log)).ok());
    // a, holding the most, is refused as a full queue refuses.
    const absl::Status refused =
        scheduler.Submit(std::make_unique<ClientJob>("a", 5, &log));
    EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(std::string(refused.message()),
                ::testing::HasSubstr("the compute queue is full: 4 requests "
                                     "wait, the max_queue limit is 4"));
    // a holds 3, b 1: a3 gives way; then 2 each: b is refused.
    ASSERT_TRUE(
        scheduler.Submit(std::make_unique<ClientJob>("b", 1, &log)).ok());
    EXPECT_EQ(
        scheduler.Submit(std::make_unique<ClientJob>("b", 2, &log)).code(),
        absl::StatusCode::kResourceExhausted);
    gate.Notify();
  }
  EXPECT_THAT(log.events, ElementsAre("displaced a4", "displaced a3", "a0",
                                      "a1", "b0", "a2", "b1"));
}

// A job whose turn comes before a head waiting for batch partners takes its
// place, and waits only as long as the head had left: the executor does not
// idle while a queued job is past max_queue_delay (a review of 2026-12-07:
// the new head restarted the wait, and the job it passed waited half again).
TEST(SchedulerTest, AJobTakingAWaitingHeadsPlaceDoesNotRestartItsWait) {
  ClientJob::Log log;
  absl::Notification gate;
  absl::Notification started;
  SchedulerOptions options;
  options.max_batch = 2;
  options.max_queue_delay = absl::Seconds(3);
  Scheduler scheduler(options);
  ASSERT_NO_FATAL_FAILURE(
      HoldTheExecutor(scheduler, "g", &log, &gate, &started));
  // a0 and a1 fill a batch; a2, of its own key, then waits for a partner.
  for (int id = 0; id < 2; ++id) {
    ASSERT_TRUE(scheduler
                    .Submit(std::make_unique<ClientJob>("a", id, &log, nullptr,
                                                        nullptr, "k"))
                    .ok());
  }
  const absl::Time submitted = absl::Now();
  ASSERT_TRUE(scheduler
                  .Submit(std::make_unique<ClientJob>("a", 2, &log, nullptr,
                                                      nullptr, "k2"))
                  .ok());
  gate.Notify();
  absl::SleepFor(absl::Milliseconds(1500));
  // b's turn comes before a2's (a's last job's is later): b0 becomes the head.
  ASSERT_TRUE(scheduler
                  .Submit(std::make_unique<ClientJob>("b", 0, &log, nullptr,
                                                      nullptr, "k3"))
                  .ok());
  ASSERT_TRUE(scheduler.WaitIdle(absl::Seconds(30)));
  absl::MutexLock lock(&log.mutex);
  ASSERT_THAT(log.events, ElementsAre("g0", "a0", "a1", "b0", "a2"));
  // 3 s after it was queued; b0's own wait would have made it 4.5 s.
  EXPECT_LT(log.times[4] - submitted, absl::Seconds(4))
      << absl::FormatDuration(log.times[4] - submitted);
}

// A job its caller can give up: Run records its id, Drop records −id.
class AbandonableJob final : public Job {
 public:
  AbandonableJob(int id, std::string key, std::vector<int>* events,
                 absl::Mutex* mutex, absl::Notification* gate = nullptr)
      : id_(id),
        key_(std::move(key)),
        events_(events),
        mutex_(mutex),
        gate_(gate) {}

  const std::string& batch_key() const override { return key_; }
  bool Abandoned() const override { return abandoned_.load(); }
  void GiveUp() { abandoned_.store(true); }

  void Run(absl::Span<Job* const> batch) override {
    if (gate_ != nullptr) gate_->WaitForNotification();
    absl::MutexLock lock(mutex_);
    for (Job* job : batch) {
      events_->push_back(static_cast<AbandonableJob*>(job)->id_);
    }
  }
  void Drop() override {
    absl::MutexLock lock(mutex_);
    events_->push_back(-id_);
  }

 private:
  const int id_;
  const std::string key_;
  std::vector<int>* const events_;
  absl::Mutex* const mutex_;
  absl::Notification* const gate_;
  std::atomic<bool> abandoned_{false};
};

// Given-up jobs leave the queue when asked, or when the queue is full, and
// are dropped, never run; the rest run in order.
TEST(SchedulerTest, DropsAbandonedJobsInsteadOfRunningThem) {
  absl::Mutex mutex;
  std::vector<int> events;
  absl::Notification release;
  SchedulerOptions options;
  options.max_queue = 2;
  Scheduler scheduler(options);
  ASSERT_TRUE(scheduler
                  .Submit(std::make_unique<AbandonableJob>(1, "", &events,
                                                           &mutex, &release))
                  .ok());
  absl::SleepFor(absl::Milliseconds(50));  // Job 1 runs; 2 and 3 queue.
  auto second = std::make_unique<AbandonableJob>(2, "", &events, &mutex);
  auto third = std::make_unique<AbandonableJob>(3, "", &events, &mutex);
  AbandonableJob* const job2 = second.get();
  AbandonableJob* const job3 = third.get();
  ASSERT_TRUE(scheduler.Submit(std::move(second)).ok());
  ASSERT_TRUE(scheduler.Submit(std::move(third)).ok());
  EXPECT_EQ(scheduler.DropAbandoned(), 0);
  job2->GiveUp();
  // The queue is full but for a given-up job: 4 takes its place.
  ASSERT_TRUE(
      scheduler.Submit(std::make_unique<AbandonableJob>(4, "", &events, &mutex))
          .ok());
  job3->GiveUp();
  EXPECT_EQ(scheduler.DropAbandoned(), 1);
  EXPECT_TRUE(scheduler.busy());  // Job 1 still runs.
  release.Notify();
  EXPECT_TRUE(scheduler.WaitIdle(absl::Seconds(10)));
  absl::MutexLock lock(&mutex);
  EXPECT_THAT(events, ElementsAre(-2, -3, 1, 4));
}

// A head waiting for batch partners and given up is dropped at once: the job
// behind it does not wait out the head's queue delay.
TEST(SchedulerTest, AHeadWaitingForPartnersIsDroppedAtOnce) {
  absl::Mutex mutex;
  std::vector<int> events;
  SchedulerOptions options;
  options.max_batch = 4;
  options.max_queue_delay = absl::Seconds(600);
  Scheduler scheduler(options);
  auto head = std::make_unique<AbandonableJob>(1, "a", &events, &mutex);
  AbandonableJob* const waiting = head.get();
  ASSERT_TRUE(scheduler.Submit(std::move(head)).ok());
  ASSERT_TRUE(
      scheduler.Submit(std::make_unique<AbandonableJob>(2, "", &events, &mutex))
          .ok());
  absl::SleepFor(absl::Milliseconds(50));  // The executor waits for partners.
  waiting->GiveUp();
  EXPECT_EQ(scheduler.DropAbandoned(), 1);
  EXPECT_TRUE(scheduler.WaitIdle(absl::Seconds(60)));
  absl::MutexLock lock(&mutex);
  // Job 2 may run before the dropping thread records the drop.
  EXPECT_THAT(events, ::testing::UnorderedElementsAre(-1, 2));
}

TEST(SchedulerTest, SeveralExecutorsRunJobsAtOnce) {
  SchedulerOptions options;
  options.executors = 3;
  std::atomic<int> running{0}, most{0};
  {
    Scheduler scheduler(options);
    for (int i = 0; i < 6; ++i) {
      ASSERT_TRUE(scheduler
                      .Submit(std::make_unique<FunctionJob>([&] {
                        const int now = ++running;
                        int seen = most.load();
                        while (now > seen &&
                               !most.compare_exchange_weak(seen, now)) {
                        }
                        absl::SleepFor(absl::Milliseconds(50));
                        --running;
                      }))
                      .ok());
    }
  }
  EXPECT_GE(most.load(), 2);
}

// Runs a function on whichever thread runs it; may run inline.
class InlineJob final : public Job {
 public:
  explicit InlineJob(absl::AnyInvocable<void()> function)
      : function_(std::move(function)) {}
  bool runs_inline() const override { return true; }
  void Run(absl::Span<Job* const> /*batch*/) override { function_(); }

 private:
  absl::AnyInvocable<void()> function_;
};

TEST(SchedulerTest, RunsAnInlineJobOnTheSubmittingThreadWhenIdle) {
  Scheduler scheduler(SchedulerOptions{});
  std::thread::id ran_on;
  ASSERT_TRUE(scheduler
                  .Submit(std::make_unique<InlineJob>(
                      [&] { ran_on = std::this_thread::get_id(); }))
                  .ok());
  // Submit returned after the run: no wait needed.
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_TRUE(scheduler.WaitIdle(absl::Seconds(10)));
}

TEST(SchedulerTest, QueuesAnInlineJobBehindBusyExecutorsAndQueuedJobs) {
  absl::Mutex mutex;
  std::vector<std::vector<int>> batches;
  absl::Notification release;
  Scheduler scheduler(SchedulerOptions{});  // One executor.
  ASSERT_TRUE(scheduler
                  .Submit(std::make_unique<RecordingJob>(0, "", &batches,
                                                         &mutex, &release))
                  .ok());
  absl::SleepFor(absl::Milliseconds(50));  // Job 0 holds the executor.
  std::atomic<bool> ran_here{false};
  std::atomic<int> runs{0};
  const std::thread::id submitter = std::this_thread::get_id();
  ASSERT_TRUE(scheduler
                  .Submit(std::make_unique<InlineJob>([&] {
                    ran_here = std::this_thread::get_id() == submitter;
                    ++runs;
                  }))
                  .ok());
  EXPECT_EQ(runs.load(), 0);  // Queued, not run past the busy executor.
  release.Notify();
  EXPECT_TRUE(scheduler.WaitIdle(absl::Seconds(10)));
  EXPECT_EQ(runs.load(), 1);
  EXPECT_FALSE(ran_here.load());
}

TEST(SchedulerTest, AnInlineJobTakesAnExecutorsTurn) {
  // One executor: while an inline job runs, a queued job waits for it.
  Scheduler scheduler(SchedulerOptions{});
  std::atomic<int> running{0}, most{0};
  auto track = [&] {
    const int now = ++running;
    int seen = most.load();
    while (now > seen && !most.compare_exchange_weak(seen, now)) {
    }
    absl::SleepFor(absl::Milliseconds(100));
    --running;
  };
  std::thread inline_submitter([&] {
    EXPECT_TRUE(scheduler.Submit(std::make_unique<InlineJob>(track)).ok());
  });
  while (running.load() == 0) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_TRUE(scheduler.Submit(std::make_unique<FunctionJob>(track)).ok());
  inline_submitter.join();
  EXPECT_TRUE(scheduler.WaitIdle(absl::Seconds(10)));
  EXPECT_EQ(most.load(), 1);
}

TEST(SchedulerTest, IsBusyWhileAJobWaitsOrRunsOnAnExecutor) {
  Scheduler scheduler(SchedulerOptions{});  // One executor.
  EXPECT_FALSE(scheduler.busy());
  // An inline job runs on the submitting thread, not on the executors.
  bool busy_inline = true;
  ASSERT_TRUE(scheduler
                  .Submit(std::make_unique<InlineJob>(
                      [&] { busy_inline = scheduler.busy(); }))
                  .ok());
  EXPECT_FALSE(busy_inline);
  EXPECT_FALSE(scheduler.busy());
  absl::Notification started, release;
  ASSERT_TRUE(scheduler
                  .Submit(std::make_unique<FunctionJob>([&] {
                    started.Notify();
                    release.WaitForNotification();
                  }))
                  .ok());
  EXPECT_TRUE(scheduler.busy());  // Queued, or already running.
  started.WaitForNotification();
  EXPECT_TRUE(scheduler.busy());
  release.Notify();
  EXPECT_TRUE(scheduler.WaitIdle(absl::Seconds(10)));
  EXPECT_FALSE(scheduler.busy());
}

}  // namespace
}  // namespace attnserve
