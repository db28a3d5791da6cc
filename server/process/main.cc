// attnserve: multi-head attention as a gRPC service. The flags are in
// flags.cc.
//
//   attnserve --port=50051 --threads=0
//
// Serves attnserve.v1.AttentionService, the Open Inference Protocol's
// inference.GRPCInferenceService, grpc.health.v1.Health and server reflection
// until SIGINT, SIGTERM or SIGHUP, then drains (see --drain_grace_seconds)
// and exits 0. A configuration that cannot work exits 2; another start-up
// failure 1. Every flag can also come from the environment as ATTNSERVE_<FLAG
// IN CAPITALS> (ATTNSERVE_PORT=50051); a flag on the command line wins.
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
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

#include "absl/base/config.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnserve/common/echo.h"
#include "attnserve/common/flags_help.h"
#include "attnserve/common/listen_socket.h"
#include "attnserve/common/log.h"
#include "attnserve/core/attention_engine.h"
#include "attnserve/server/process/termination_signals.h"
#include "attnserve/server/server.h"
#include "flags.h"
#include "google/protobuf/stubs/common.h"
#include "grpcpp/grpcpp.h"

namespace {

// 2 for a configuration that cannot work (a bad flag, budgets that do not fit
// the memory limit, weights over --max_weights_bytes, a file over its size
// limit), 1 for anything else (a port in use, an unreadable file).
int ExitCodeFor(const absl::Status& status) {
  return status.code() == absl::StatusCode::kInvalidArgument ||
                 status.code() == absl::StatusCode::kFailedPrecondition ||
                 status.code() == absl::StatusCode::kResourceExhausted
             ? 2
             : 1;
}

// --version's last line: the libraries this binary runs with (gRPC and oneDNN
// as loaded, protobuf and Abseil as compiled in) and the ISA oneDNN picks on
// this CPU.
std::string LibraryVersions() {
  const attnserve::RuntimeInfo onednn = attnserve::OneDnnRuntimeInfo();
  constexpr int kProtobuf = GOOGLE_PROTOBUF_VERSION;  // 3021012: 3.21.12
  return absl::StrCat("gRPC ", grpc::Version(), ", protobuf ",
                      kProtobuf / 1000000, ".", kProtobuf / 1000 % 1000, ".",
                      kProtobuf % 1000, ", Abseil ", ABSL_LTS_RELEASE_VERSION,
                      ", oneDNN ", onednn.onednn_version, " (",
                      onednn.threading, "), CPU ISA ", onednn.cpu_isa, "\n");
}

// Takes --only_check_args (and --noonly_check_args, =true, =false) out of
// `arguments` and returns whether it was set. Abseil's own exits 0 inside the
// parse, before any value is checked against its range or the memory plan:
// --port=70000 passed.
bool TakeOnlyCheckArgs(std::vector<char*>* arguments) {
  bool only_check = false;
  std::vector<char*> kept;
  for (size_t i = 0; i < arguments->size(); ++i) {
    absl::string_view name = (*arguments)[i];
    if (i > 0 && name == "--") {
      kept.insert(kept.end(), arguments->begin() + i, arguments->end());
      break;
    }
    if (i > 0 &&
        (absl::ConsumePrefix(&name, "--") || absl::ConsumePrefix(&name, "-"))) {
      if (name == "only_check_args" || name == "only_check_args=true" ||
          name == "only_check_args=1") {
        only_check = true;
        continue;
      }
      if (name == "noonly_check_args" || name == "only_check_args=false" ||
          name == "only_check_args=0") {
        only_check = false;
        continue;
      }
    }
    kept.push_back((*arguments)[i]);
  }
  *arguments = std::move(kept);
  return only_check;
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
  // Log lines go to stdout and stderr from any thread: when whatever reads
  // them goes away (a log shipper restarting), their writes must fail with
  // EPIPE, not kill the server with SIGPIPE. Set before any thread starts.
  signal(SIGPIPE, SIG_IGN);
  PreferPassiveOpenMpThreads(argv);
  KeepFreedMemoryForTheNextCalls();
  attnserve::ConfigureUsage(
      {"attnserve", attnserve::kUsage, "server/", LibraryVersions});
  if (std::optional<int> status = attnserve::HandleHelpFlags(argc, argv)) {
    return *status;
  }
  std::vector<std::string> environment;
  std::vector<char*> arguments =
      attnserve::ArgumentsWithEnvironment(argc, argv, &environment);
  if (const std::optional<std::string> error = attnserve::FlagArgumentsError(
          static_cast<int>(arguments.size()), arguments.data())) {
    attnserve::FlushLog(absl::Seconds(2));
    std::fprintf(stderr, "attnserve: %s\n",
                 attnserve::WithEnvironmentNames(*error, environment).c_str());
    return 2;
  }
  const bool only_check_args = TakeOnlyCheckArgs(&arguments);
  const std::vector<char*> positional = absl::ParseCommandLine(
      static_cast<int>(arguments.size()), arguments.data());
  if (positional.size() > 1) {
    // "--demo_weights false": the flag set to true, "false" left over.
    attnserve::FlushLog(absl::Seconds(2));
    std::fprintf(stderr,
                 "attnserve: unexpected argument %s: attnserve takes flags "
                 "only (--name=value; a boolean flag's value follows an "
                 "=, as in --demo_weights=false)\n",
                 attnserve::EchoText(positional[1]).c_str());
    return 2;
  }
  attnserve::TerminationSignals signals;
  // Each connection takes a descriptor: a soft limit below the hard one (1,024
  // under systemd's defaults) is no reason to refuse clients.
  const int64_t descriptors = attnserve::RaiseDescriptorLimit();
  // Debian builds Abseil without NDEBUG, so every absl::Mutex acquisition
  // feeds a global lock-order graph (about 1 % of a busy server's CPU, under a
  // global lock). The test suite keeps the check; the served binary does not.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  const absl::StatusOr<attnserve::ServerOptions> options =
      attnserve::OptionsFromFlags();
  if (!options.ok()) {
    attnserve::FlushLog(absl::Seconds(2));
    std::fprintf(
        stderr, "attnserve: %s\n",
        attnserve::WithEnvironmentNames(
            attnserve::WithFlagNames(options.status().ToString()), environment)
            .c_str());
    return 2;
  }
  if (only_check_args) {
    const absl::Status checked = attnserve::AttnServer::Check(*options);
    attnserve::FlushLog(absl::Seconds(2));
    if (checked.ok()) return 0;
    std::fprintf(stderr, "attnserve: %s\n",
                 attnserve::WithEnvironmentNames(
                     attnserve::WithFlagNames(checked.ToString()), environment)
                     .c_str());
    return ExitCodeFor(checked);
  }
  absl::StatusOr<std::unique_ptr<attnserve::AttnServer>> server =
      attnserve::AttnServer::Start(*options);
  if (!server.ok()) {
    attnserve::FlushLog(absl::Seconds(2));
    std::fprintf(
        stderr, "attnserve: %s\n",
        attnserve::WithEnvironmentNames(
            attnserve::WithFlagNames(server.status().ToString()), environment)
            .c_str());
    return ExitCodeFor(server.status());
  }
  signals.Started();
  attnserve::Log(
      attnserve::LogLevel::kInfo,
      absl::StrCat((*server)->Describe(), ", open files limit ",
                   descriptors < 0 ? "none" : absl::StrCat(descriptors)));
  const std::vector<std::string>& weights = (*server)->startup_weights();
  attnserve::Log(
      attnserve::LogLevel::kInfo,
      absl::StrCat("attnserve weights: ",
                   weights.empty() ? "(none)" : absl::StrJoin(weights, ", ")));

  const int signal_number = signals.Wait();
  attnserve::Log(
      attnserve::LogLevel::kInfo,
      absl::StrCat("attnserve: signal ", signal_number, ", draining"));
  (*server)->Shutdown();
  attnserve::Log(attnserve::LogLevel::kInfo, "attnserve: drained, exiting");
  return 0;
}
