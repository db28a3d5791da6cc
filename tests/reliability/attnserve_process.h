// The shipped attnserve binary run as a child process on loopback, so that a
// test can load it from outside, read its memory from /proc and signal it like
// an orchestrator would.
//
//   absl::StatusOr<std::unique_ptr<AttnserveProcess>> server =
//       AttnserveProcess::Start(ATTNSERVE_BINARY, {"--drain_grace_seconds=1"});
//   ... (*server)->target(), (*server)->RssKilobytes() ...
//   (*server)->Signal(SIGTERM);
//   absl::StatusOr<int> exit_status = (*server)->Wait(absl::Seconds(30));
#ifndef ATTNSERVE_TESTS_RELIABILITY_ATTNSERVE_PROCESS_H_
#define ATTNSERVE_TESTS_RELIABILITY_ATTNSERVE_PROCESS_H_

#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace attnserve::testing {

// Not thread-safe, except RssKilobytes, which any thread may call.
class AttnserveProcess {
 public:
  // Starts `binary` with --address=127.0.0.1 --port=0, a free metrics port and
  // `flags`, its output going to a file, and waits (up to 30 s) for the line
  // that gives its port. UNAVAILABLE if it exits or does not report a port.
  static absl::StatusOr<std::unique_ptr<AttnserveProcess>> Start(
      const std::string& binary, const std::vector<std::string>& flags);

  // Kills the process (SIGKILL) if it still runs, and removes its log.
  ~AttnserveProcess();

  pid_t pid() const { return pid_; }
  std::string target() const;  // "127.0.0.1:<port>"
  int metrics_port() const { return metrics_port_; }

  // VmRSS from /proc/<pid>/status; NOT_FOUND once the process is gone.
  absl::StatusOr<int64_t> RssKilobytes() const;

  // GET /metrics: the Prometheus text.
  absl::StatusOr<std::string> ScrapeMetrics() const;

  // Sends `signal_number`; for SIGSTOP, returns once every thread has stopped
  // (at most 10 s).
  void Signal(int signal_number) const;

  // Waits for the process to exit and returns its exit status;
  // DEADLINE_EXCEEDED after `timeout`, INTERNAL if a signal ended it.
  absl::StatusOr<int> Wait(absl::Duration timeout);

  // Everything it has printed so far.
  std::string Log() const;

 private:
  AttnserveProcess(pid_t pid, std::string log_path, int metrics_port)
      : pid_(pid),
        log_path_(std::move(log_path)),
        metrics_port_(metrics_port) {}

  pid_t pid_;
  std::string log_path_;
  int metrics_port_;
  int port_ = 0;
  bool exited_ = false;
};

// The sum of the Prometheus samples of metric `name` in `metrics` whose labels
// include `labels`, e.g. MetricSum(text, "attnserve_requests_total", {{"rpc",
// "Attend"}}); 0 if none.
double MetricSum(const std::string& metrics, const std::string& name,
                 const std::map<std::string, std::string>& labels = {});

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_RELIABILITY_ATTNSERVE_PROCESS_H_
