#include "compute_executor.h"

#include <utility>

namespace attnserve {

ComputeExecutor::ComputeExecutor() : thread_([this] { RunTasks(); }) {}

ComputeExecutor::~ComputeExecutor() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  thread_.join();
}

void ComputeExecutor::Submit(absl::AnyInvocable<void() &&> task) {
  absl::MutexLock lock(&mutex_);
  tasks_.push_back(std::move(task));
}

void ComputeExecutor::RunTasks() {
  while (true) {
    absl::AnyInvocable<void() &&> task;
    {
      absl::MutexLock lock(&mutex_);
      mutex_.Await(absl::Condition(
          +[](ComputeExecutor* self)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mutex_) {
                 return self->stopping_ || !self->tasks_.empty();
               },
          this));
      if (tasks_.empty()) return;  // Stopping, and nothing left to run.
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    std::move(task)();
  }
}

}  // namespace attnserve
