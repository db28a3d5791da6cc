#include "reliability/attnserve_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "server/free_port.h"
#include "server/metrics_scrape.h"

namespace attnserve::testing {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream file(path);
  std::stringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttnserveProcess>> AttnserveProcess::Start(
    const std::string& binary, const std::vector<std::string>& flags) {
  char log_template[] = "/tmp/attnserve_soak_XXXXXX";
  const int log_fd = mkstemp(log_template);
  if (log_fd < 0) return absl::InternalError("mkstemp failed");
  const int metrics_port = FreeLoopbackPort();
  std::vector<std::string> arguments = {
      binary, "--address=127.0.0.1", "--port=0",
      absl::StrCat("--metrics_port=", metrics_port)};
  arguments.insert(arguments.end(), flags.begin(), flags.end());
  std::vector<char*> argv;
  for (std::string& argument : arguments) argv.push_back(argument.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    dup2(log_fd, STDOUT_FILENO);
    dup2(log_fd, STDERR_FILENO);
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  close(log_fd);
  std::unique_ptr<AttnserveProcess> process(
      new AttnserveProcess(pid, log_template, metrics_port));
  const std::string marker = "listening on 127.0.0.1:";
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (absl::Now() < give_up) {
    const std::string log = process->Log();
    const size_t at = log.find(marker);
    if (at != std::string::npos) {
      const size_t end = log.find(',', at);
      if (end != std::string::npos &&
          absl::SimpleAtoi(
              log.substr(at + marker.size(), end - at - marker.size()),
              &process->port_)) {
        return process;
      }
    }
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      process->exited_ = true;
      return absl::UnavailableError(
          absl::StrCat("attnserve exited during start-up: ", log));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::UnavailableError(absl::StrCat(
      "attnserve did not report its port within 30 s: ", process->Log()));
}

AttnserveProcess::~AttnserveProcess() {
  if (!exited_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  unlink(log_path_.c_str());
}

std::string AttnserveProcess::target() const {
  return absl::StrCat("127.0.0.1:", port_);
}

absl::StatusOr<int64_t> AttnserveProcess::RssKilobytes() const {
  const std::string status = ReadFile(absl::StrCat("/proc/", pid_, "/status"));
  for (absl::string_view line : absl::StrSplit(status, '\n')) {
    if (!absl::ConsumePrefix(&line, "VmRSS:")) continue;
    line = absl::StripAsciiWhitespace(line);
    absl::ConsumeSuffix(&line, "kB");
    int64_t kilobytes = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kilobytes))
      return kilobytes;
  }
  return absl::NotFoundError(absl::StrCat("no VmRSS for process ", pid_));
}

absl::StatusOr<std::string> AttnserveProcess::ScrapeMetrics() const {
  std::string metrics = Scrape(metrics_port_);
  if (metrics.empty()) {
    return absl::UnavailableError(
        absl::StrCat("no metrics on port ", metrics_port_));
  }
  return metrics;
}

namespace {

// Whether every thread of `pid` shows stopped in /proc: a thread running on
// another CPU (the io thread spins) goes on until SIGSTOP reaches it, which
// on a loaded VM can take long enough to answer the next call.
bool AllThreadsStopped(pid_t pid) {
  std::error_code error;
  bool any = false;
  for (const auto& task : std::filesystem::directory_iterator(
           absl::StrCat("/proc/", pid, "/task"), error)) {
    std::ifstream stat(task.path() / "stat");
    std::string text((std::istreambuf_iterator<char>(stat)),
                     std::istreambuf_iterator<char>());
    const size_t name_end = text.rfind(')');
    if (name_end == std::string::npos) continue;  // it ended meanwhile
    const char state = name_end + 2 < text.size() ? text[name_end + 2] : '?';
    if (state != 'T' && state != 't') return false;
    any = true;
  }
  return any && !error;
}

}  // namespace

void AttnserveProcess::Signal(int signal_number) const {
  kill(pid_, signal_number);
  if (signal_number != SIGSTOP) return;
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!AllThreadsStopped(pid_) && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
}

absl::StatusOr<int> AttnserveProcess::Wait(absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  while (!exited_) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      return absl::InternalError(
          absl::StrCat("attnserve ended by signal ", WTERMSIG(status)));
    }
    if (absl::Now() > give_up) {
      return absl::DeadlineExceededError(absl::StrCat(
          "attnserve still running after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::FailedPreconditionError("attnserve was already waited for");
}

std::string AttnserveProcess::Log() const { return ReadFile(log_path_); }

double MetricSum(const std::string& metrics, const std::string& name,
                 const std::map<std::string, std::string>& labels) {
  double sum = 0;
  for (const auto& [series, value] : Samples(metrics)) {
    absl::string_view labels_text = series;
    if (!absl::ConsumePrefix(&labels_text, name)) continue;
    if (!labels_text.empty() && labels_text.front() != '{') continue;
    bool match = true;
    for (const auto& [label, label_value] : labels) {
      const std::string pair = absl::StrCat(label, "=\"", label_value, "\"");
      match = match && (absl::StrContains(labels_text, "{" + pair) ||
                        absl::StrContains(labels_text, "," + pair));
    }
    if (match) sum += value;
  }
  return sum;
}

}  // namespace attnserve::testing
