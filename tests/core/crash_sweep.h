// Runs many cases of something that may kill its process (a oneDNN kernel that
// executes an illegal instruction) in child processes, so that a crash becomes
// a reported failure that names its case instead of a dead test runner.
//
//   std::vector<SweepFailure> failures = RunCasesInChildren(
//       cases.size(), [&](int64_t i) { return RunOne(cases[i]); });
//
// The children are forked from the calling process, which must not have
// started OpenMP or oneDNN threads (fork copies only the calling thread). A
// child runs cases in order and announces each on a pipe before running it;
// when a child dies, the case it last announced is the one that killed it, and
// a new child goes on from the next case.
#ifndef ATTNSERVE_TESTS_CORE_CRASH_SWEEP_H_
#define ATTNSERVE_TESTS_CORE_CRASH_SWEEP_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace attnserve::testing {

struct SweepFailure {
  int64_t index;       // the case
  std::string reason;  // "killed by signal 4 (Illegal instruction)", or the
                       // message of the Status the case returned
};

// Runs run_case(0) ... run_case(count - 1), each in a child process; returns
// the cases that returned an error or ended their process, in order.
std::vector<SweepFailure> RunCasesInChildren(
    int64_t count, const std::function<absl::Status(int64_t)>& run_case);

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_CORE_CRASH_SWEEP_H_
