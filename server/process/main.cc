// attnserve: multi-head attention as a gRPC service. The flags are in
// flags.cc.
//
//   attnserve --port=50051 --threads=0
//
// Serves attnserve.v1.AttentionService, grpc.health.v1.Health and server
// reflection until SIGINT or SIGTERM, then drains (see --drain_grace_seconds)
// and exits 0. A configuration that cannot work exits 2; another start-up
// failure 1. Every flag can also come from the environment as ATTNSERVE_<FLAG
// IN CAPITALS> (ATTNSERVE_PORT=50051); a flag on the command line wins.
#include <malloc.h>
#include <pthread.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/common/flags_help.h"
#include "attnserve/server/process/termination_signals.h"
#include "attnserve/server/server.h"
#include "flags.h"

namespace {

// 2 for a configuration that cannot work (a bad flag, budgets that do not fit
// the memory limit), 1 for anything else (a port in use, an unreadable file).
int ExitCodeFor(const absl::Status& status) {
  return status.code() == absl::StatusCode::kInvalidArgument ||
                 status.code() == absl::StatusCode::kFailedPrecondition
             ? 2
             : 1;
}

}  // namespace

// OpenMP's default wait policy has idle team threads spin between parallel
// regions, which on shared cores starves gRPC's own threads: measured here, 64
// calls in flight ran at 47 requests/s with spinning and ~800 without, and a
// tiny call's p99 fell from 16 ms to 0.3 ms. libgomp reads OMP_WAIT_POLICY when
// it loads, before main, so the process re-executes itself once with PASSIVE
// unless the environment already chose (set ACTIVE on dedicated cores).
void PreferPassiveOpenMpThreads(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  // The real path, not /proc/self/exe, so that the process keeps its name (ps,
  // pkill).
  char path[4096];
  const ssize_t length = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (length <= 0) return;
  path[length] = '\0';
  setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  execv(path, argv);
  // Not re-executed: go on with the default policy.
}

// Has malloc keep what calls free for the next calls, in one arena, instead of
// handing it back at once: gRPC's receive buffers for a 1 MB request were
// fresh pages nearly every time (17-154 page faults a request; 2-14 % of the
// throughput of small Attends under load). The server's trimmer still gives
// free memory back once a second while calls end (malloc_trim), so RSS shows
// what is in use; it can return only the main arena's top, hence one arena (the
// threads that allocate much are few: io threads and executors). Before any
// thread starts; the environment's malloc settings (GLIBC_TUNABLES, MALLOC_*_)
// win.
void KeepFreedMemoryForTheNextCalls() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables != nullptr &&
      std::strstr(tunables, "glibc.malloc.") != nullptr) {
    return;
  }
  for (const char* name : {"MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_",
                           "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"}) {
    if (std::getenv(name) != nullptr) return;
  }
  mallopt(M_ARENA_MAX, 1);
  // glibc's largest: 32 MiB on 64-bit hosts. Larger blocks are mapped afresh.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
}

int main(int argc, char** argv) {
  PreferPassiveOpenMpThreads(argv);
  KeepFreedMemoryForTheNextCalls();
  attnserve::ConfigureUsage({"attnserve", attnserve::kUsage, "server/"});
  if (std::optional<int> status = attnserve::HandleHelpFlags(argc, argv)) {
    return *status;
  }
  std::vector<std::string> environment;
  std::vector<char*> arguments =
      attnserve::ArgumentsWithEnvironment(argc, argv, &environment);
  absl::ParseCommandLine(static_cast<int>(arguments.size()), arguments.data());
  attnserve::TerminationSignals signals;
  // Debian builds Abseil without NDEBUG, so every absl::Mutex acquisition
  // feeds a global lock-order graph (about 1 % of a busy server's CPU, under a
  // global lock). The test suite keeps the check; the served binary does not.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  const absl::StatusOr<attnserve::ServerOptions> options =
      attnserve::OptionsFromFlags();
  if (!options.ok()) {
    std::fprintf(stderr, "attnserve: %s\n",
                 attnserve::WithFlagNames(options.status().ToString()).c_str());
    return 2;
  }
  absl::StatusOr<std::unique_ptr<attnserve::AttnServer>> server =
      attnserve::AttnServer::Start(*options);
  if (!server.ok()) {
    std::fprintf(stderr, "attnserve: %s\n",
                 attnserve::WithFlagNames(server.status().ToString()).c_str());
    return ExitCodeFor(server.status());
  }
  signals.Started();
  std::printf("%s\n", (*server)->Describe().c_str());
  const std::vector<std::string>& weights = (*server)->startup_weights();
  std::printf(
      "attnserve weights: %s\n",
      weights.empty() ? "(none)" : absl::StrJoin(weights, ", ").c_str());
  std::fflush(stdout);

  const int signal_number = signals.Wait();
  std::printf("attnserve: signal %d, draining\n", signal_number);
  std::fflush(stdout);
  (*server)->Shutdown();
  std::printf("attnserve: drained, exiting\n");
  return 0;
}
