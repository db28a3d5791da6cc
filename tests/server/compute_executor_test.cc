#include "compute_executor.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

TEST(ComputeExecutorTest, RunsTasksInSubmissionOrderOnOneThread) {
  absl::Mutex mutex;
  std::vector<int> order;
  std::vector<std::thread::id> threads;
  {
    ComputeExecutor executor;
    for (int i = 0; i < 100; ++i) {
      executor.Submit([&, i] {
        absl::MutexLock lock(&mutex);
        order.push_back(i);
        threads.push_back(std::this_thread::get_id());
      });
    }
  }
  std::vector<int> expected(100);
  for (int i = 0; i < 100; ++i) expected[i] = i;
  EXPECT_EQ(order, expected);
  EXPECT_THAT(threads, ::testing::Each(threads.front()));
  EXPECT_NE(threads.front(), std::this_thread::get_id());
}

TEST(ComputeExecutorTest, DestructorFinishesQueuedTasks) {
  absl::Notification release;
  int finished = 0;
  {
    ComputeExecutor executor;
    executor.Submit([&] { release.WaitForNotification(); });
    for (int i = 0; i < 10; ++i) executor.Submit([&] { ++finished; });
    release.Notify();
  }
  EXPECT_EQ(finished, 10);
}

TEST(ComputeExecutorTest, AcceptsSubmissionsFromManyThreads) {
  std::atomic<int> count{0};
  {
    ComputeExecutor executor;
    std::vector<std::thread> submitters;
    for (int t = 0; t < 4; ++t) {
      submitters.emplace_back([&] {
        for (int i = 0; i < 250; ++i) executor.Submit([&] { ++count; });
      });
    }
    for (std::thread& submitter : submitters) submitter.join();
  }
  EXPECT_EQ(count.load(), 1000);
}

}  // namespace
}  // namespace attnserve
