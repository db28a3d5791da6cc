#include "attnserve/server/process/termination_signals.h"

#include <pthread.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>

namespace attnserve {

TerminationSignals::TerminationSignals() {
  sigemptyset(&signals_);
  sigaddset(&signals_, SIGINT);
  sigaddset(&signals_, SIGTERM);
  // A hang-up drains, unless the process was started to ignore it (nohup, a
  // supervisor): a blocked signal is delivered to sigwait even when ignored.
  struct sigaction hangup = {};
  if (sigaction(SIGHUP, nullptr, &hangup) == 0 &&
      hangup.sa_handler != SIG_IGN) {
    sigaddset(&signals_, SIGHUP);
  }
  pthread_sigmask(SIG_BLOCK, &signals_, nullptr);
  watcher_ = std::thread([this] { Watch(); });
}

TerminationSignals::~TerminationSignals() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  // Wakes the watcher, which waits for a first signal (main returning on an
  // error) or a second one (the drain is over).
  pthread_kill(watcher_.native_handle(), SIGTERM);
  watcher_.join();
}

void TerminationSignals::Started() {
  absl::MutexLock lock(&mutex_);
  started_ = true;
}

int TerminationSignals::Wait() {
  arrived_.WaitForNotification();
  absl::MutexLock lock(&mutex_);
  return received_;
}

void TerminationSignals::Watch() {
  while (true) {
    int signal_number = 0;
    while (sigwait(&signals_, &signal_number) != 0) {
    }
    absl::MutexLock lock(&mutex_);
    if (stopping_) return;
    // A hang-up can come twice (the terminal's, then the shell's to its
    // jobs): only an operator's SIGINT or SIGTERM cuts a drain short.
    if (received_ != 0 && signal_number == SIGHUP) continue;
    // One signal sent twice at once is one request: timeout(1), for one,
    // sends it to its child and then to the child's process group, and a
    // drain of a loaded server had ended in 143 on the second copy when the
    // first had been taken in between (an ASan CI run, 2026-12-07).
    if (received_ == signal_number &&
        std::chrono::steady_clock::now() - received_at_ < kRepeatWindow) {
      continue;
    }
    if (!started_ || received_ != 0) {
      std::fprintf(stderr, "attnserve: signal %d during %s, exiting now\n",
                   signal_number,
                   started_ ? "the drain (a second signal)" : "start-up");
      std::fflush(stderr);
      _exit(128 + signal_number);
    }
    received_ = signal_number;
    received_at_ = std::chrono::steady_clock::now();
    arrived_.Notify();
  }
}

}  // namespace attnserve
