#include "attnserve/common/log.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <deque>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attnserve {

namespace {

std::atomic<int> min_level{static_cast<int>(LogLevel::kInfo)};

constexpr const char* kNames[] = {"debug", "info", "warning", "error"};

// The most bytes of lines waiting to be written; past it lines are dropped,
// counted, and the count written once the reader takes lines again.
constexpr size_t kMaxQueuedBytes = size_t{1} << 20;
// How long the process's exit waits for the lines still queued.
constexpr absl::Duration kExitFlush = absl::Seconds(2);

// Held by every writer of stdout and stderr through the whole of a write.
absl::Mutex& StandardStreams() {
  static absl::Mutex* const mutex = new absl::Mutex();
  return *mutex;
}

// Lines are queued by the threads that log and written by one thread of
// their own: a reader of stderr that stops reading (a stalled log shipper's
// full pipe) blocks that thread alone, never a thread serving calls, as a
// blocking write on the gRPC io thread did. Leaked on purpose: its thread
// writes until the process ends.
class Writer {
 public:
  static Writer& Get() {
    static Writer* const writer = [] {
      auto* created = new Writer();
      std::atexit([] { Get().Flush(kExitFlush); });
      return created;
    }();
    return *writer;
  }

  void Queue(int fd, std::string line) {
    absl::MutexLock lock(&mutex_);
    if (queued_bytes_ + line.size() > kMaxQueuedBytes) {
      ++dropped_;
      return;
    }
    // Where lines were dropped, the count of them, in order.
    if (dropped_ > 0) queue_.emplace_back(STDERR_FILENO, TakeDropped());
    queued_bytes_ += line.size();
    queue_.emplace_back(fd, std::move(line));
  }

  // Waits until every line queued is written, for at most `limit`.
  void Flush(absl::Duration limit) {
    absl::MutexLock lock(&mutex_);
    mutex_.AwaitWithTimeout(
        absl::Condition(
            +[](Writer* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mutex_) {
              return w->queue_.empty() && !w->writing_;
            },
            this),
        limit);
  }

 private:
  Writer() {
    std::thread([this] { Loop(); }).detach();
  }

  void Loop() {
    // A reader that went away fails the write with EPIPE instead of killing
    // the process with SIGPIPE: the signal stays blocked on this thread.
    sigset_t pipe_signal;
    sigemptyset(&pipe_signal);
    sigaddset(&pipe_signal, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
    while (true) {
      std::deque<std::pair<int, std::string>> lines;
      {
        absl::MutexLock lock(&mutex_);
        mutex_.Await(absl::Condition(
            +[](std::deque<std::pair<int, std::string>>* queue) {
              return !queue->empty();
            },
            &queue_));
        lines.swap(queue_);
        queued_bytes_ = 0;
        writing_ = true;
      }
      for (const auto& [fd, line] : lines) WriteToStandardStream(fd, line);
      std::string dropped;
      {
        absl::MutexLock lock(&mutex_);
        // Lines dropped after the last one queued: said now.
        if (queue_.empty() && dropped_ > 0) dropped = TakeDropped();
      }
      if (!dropped.empty()) WriteToStandardStream(STDERR_FILENO, dropped);
      absl::MutexLock lock(&mutex_);
      writing_ = false;
    }
  }

  // The line that says how many were dropped, the count cleared.
  std::string TakeDropped() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    return absl::StrCat("attnserve: warning: ", std::exchange(dropped_, 0),
                        " log lines dropped: the log's reader fell behind by "
                        "more than ",
                        kMaxQueuedBytes, " bytes\n");
  }

  absl::Mutex mutex_;
  std::deque<std::pair<int, std::string>> queue_ ABSL_GUARDED_BY(mutex_);
  size_t queued_bytes_ ABSL_GUARDED_BY(mutex_) = 0;
  int64_t dropped_ ABSL_GUARDED_BY(mutex_) = 0;
  bool writing_ ABSL_GUARDED_BY(mutex_) = false;
};

}  // namespace

std::optional<LogLevel> ParseLogLevel(absl::string_view name) {
  for (int level = 0; level < 4; ++level) {
    if (name == kNames[level]) return static_cast<LogLevel>(level);
  }
  return std::nullopt;
}

const char* LogLevelName(LogLevel level) {
  return kNames[static_cast<int>(level)];
}

void SetLogLevel(LogLevel level) {
  min_level.store(static_cast<int>(level), std::memory_order_relaxed);
}

bool LogEnabled(LogLevel level) {
  return static_cast<int>(level) >= min_level.load(std::memory_order_relaxed);
}

void Log(LogLevel level, absl::string_view line) {
  if (!LogEnabled(level)) return;
  // Whole lines, in order, by one thread: they never interleave.
  Writer::Get().Queue(
      level >= LogLevel::kWarning ? STDERR_FILENO : STDOUT_FILENO,
      absl::StrCat(line, "\n"));
}

void FlushLog(absl::Duration limit) { Writer::Get().Flush(limit); }

size_t WriteToStandardStream(int fd, absl::string_view text) {
  absl::MutexLock lock(&StandardStreams());
  while (!text.empty()) {
    const ssize_t written = ::write(fd, text.data(), text.size());
    if (written < 0) {
      if (errno == EINTR) continue;
      break;  // EPIPE, a closed descriptor: the rest is lost.
    }
    text.remove_prefix(static_cast<size_t>(written));
  }
  return text.size();
}

}  // namespace attnserve
