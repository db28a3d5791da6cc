// SIGINT, SIGTERM and SIGHUP (a closed terminal; not when the process was
// started with it ignored, as under nohup) for the attnserve binary,
// watched by one thread from the first line of main: during start-up (loading
// weights can take a while) a signal ends the process at once, with status 128
// + the signal's number, as its default action would; once the server is up, it
// starts the drain, and a second SIGINT or SIGTERM during the drain ends the
// process at once the same way (an operator's second Ctrl-C; a second SIGHUP
// does not, as a closed terminal can send two, nor a copy of the first signal
// within kRepeatWindow of it, as timeout(1) sends one to its child and then to
// the child's process group).
//
//   TerminationSignals signals;  // before any other thread starts
//   ... start the server ...
//   signals.Started();
//   const int signal = signals.Wait();  // then drain
//
// Thread-safe. The constructor blocks the three signals in the calling thread
// (and so in every thread it starts later); its watcher thread is joined by the
// destructor.
#ifndef ATTNSERVE_SERVER_PROCESS_TERMINATION_SIGNALS_H_
#define ATTNSERVE_SERVER_PROCESS_TERMINATION_SIGNALS_H_

#include <signal.h>

#include <chrono>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace attnserve {

class TerminationSignals {
 public:
  // A signal equal to the first that arrives within this long of it is a copy
  // of it, not an operator's second signal.
  static constexpr std::chrono::milliseconds kRepeatWindow{250};

  TerminationSignals();
  TerminationSignals(const TerminationSignals&) = delete;
  TerminationSignals& operator=(const TerminationSignals&) = delete;
  ~TerminationSignals();

  // From now on a signal is returned by Wait instead of ending the process.
  void Started();

  // Blocks until SIGINT, SIGTERM or SIGHUP arrives after Started; returns its
  // number.
  int Wait();

 private:
  void Watch();

  sigset_t signals_;
  absl::Mutex mutex_;
  bool started_ ABSL_GUARDED_BY(mutex_) = false;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  int received_ ABSL_GUARDED_BY(mutex_) = 0;
  std::chrono::steady_clock::time_point received_at_ ABSL_GUARDED_BY(mutex_);
  absl::Notification arrived_;
  std::thread watcher_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_PROCESS_TERMINATION_SIGNALS_H_
