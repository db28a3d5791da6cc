// ComputeExecutor: the thread that runs attention compute, apart from gRPC's
// threads.
//
// gRPC callback handlers must not block, so they validate a request and hand
// its compute here. One executor runs one task at a time, in submission order,
// on a thread it owns; the engine's OpenMP team spreads each task over the
// cores. Thread-safe.
#ifndef ATTNSERVE_SERVER_COMPUTE_EXECUTOR_H_
#define ATTNSERVE_SERVER_COMPUTE_EXECUTOR_H_

#include <deque>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace attnserve {

class ComputeExecutor {
 public:
  // Starts the executor's thread.
  ComputeExecutor();
  // Runs every task already submitted, then joins the thread.
  ~ComputeExecutor();

  ComputeExecutor(const ComputeExecutor&) = delete;
  ComputeExecutor& operator=(const ComputeExecutor&) = delete;

  // Queues `task` to run after every task submitted before it. Must not be
  // called once the destructor has started.
  void Submit(absl::AnyInvocable<void() &&> task);

 private:
  void RunTasks();

  absl::Mutex mutex_;
  std::deque<absl::AnyInvocable<void() &&>> tasks_ ABSL_GUARDED_BY(mutex_);
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::thread thread_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_COMPUTE_EXECUTOR_H_
