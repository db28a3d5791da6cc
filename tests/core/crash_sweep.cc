#include "core/crash_sweep.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace attnserve::testing {
namespace {

// The child: runs cases from `first`, writing "S <i>" before each and
// "F <i> <message>" after one that failed, one line each.
[[noreturn]] void RunChild(int64_t first, int64_t count,
                           const std::function<absl::Status(int64_t)>& run_case,
                           int fd) {
  // A case that crashes leaves no core file behind.
  const rlimit no_core = {0, 0};
  setrlimit(RLIMIT_CORE, &no_core);
  FILE* out = fdopen(fd, "w");
  if (out == nullptr) _exit(3);
  for (int64_t i = first; i < count; ++i) {
    std::fprintf(out, "S %lld\n", static_cast<long long>(i));
    std::fflush(out);
    const absl::Status status = run_case(i);
    if (!status.ok()) {
      const std::string message =
          absl::StrReplaceAll(status.ToString(), {{"\n", " "}});
      std::fprintf(out, "F %lld %s\n", static_cast<long long>(i),
                   message.c_str());
      std::fflush(out);
    }
  }
  std::fclose(out);
  _exit(0);
}

std::string DescribeExit(int wait_status) {
  if (WIFSIGNALED(wait_status)) {
    const int signal = WTERMSIG(wait_status);
    return absl::StrCat("killed by signal ", signal, " (", strsignal(signal),
                        ")");
  }
  return absl::StrCat("exited with status ", WEXITSTATUS(wait_status));
}

}  // namespace

std::vector<SweepFailure> RunCasesInChildren(
    int64_t count, const std::function<absl::Status(int64_t)>& run_case) {
  std::vector<SweepFailure> failures;
  int64_t next = 0;
  while (next < count) {
    int fds[2];
    if (pipe(fds) != 0) {
      failures.push_back({next, "pipe() failed"});
      return failures;
    }
    std::fflush(nullptr);  // Nothing buffered is written twice.
    const pid_t child = fork();
    if (child < 0) {
      failures.push_back({next, "fork() failed"});
      return failures;
    }
    if (child == 0) {
      close(fds[0]);
      RunChild(next, count, run_case, fds[1]);
    }
    close(fds[1]);
    FILE* in = fdopen(fds[0], "r");
    int64_t started = -1;
    char* line = nullptr;
    size_t capacity = 0;
    ssize_t length;
    while ((length = getline(&line, &capacity, in)) > 0) {
      std::string text(line, static_cast<size_t>(length));
      if (text.back() == '\n') text.pop_back();
      const size_t space = text.find(' ', 2);
      int64_t index = -1;
      if (text.size() < 3 ||
          !absl::SimpleAtoi(
              text.substr(2, space == std::string::npos ? std::string::npos
                                                        : space - 2),
              &index)) {
        continue;
      }
      if (text[0] == 'S') {
        started = index;
      } else if (text[0] == 'F') {
        failures.push_back(
            {index, space == std::string::npos ? "" : text.substr(space + 1)});
      }
    }
    std::free(line);
    std::fclose(in);
    int wait_status = 0;
    waitpid(child, &wait_status, 0);
    if (WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0) break;
    // The child died inside the case it announced last (or before any).
    const int64_t culprit = started >= 0 ? started : next;
    failures.push_back({culprit, DescribeExit(wait_status)});
    next = culprit + 1;
  }
  return failures;
}

}  // namespace attnserve::testing
