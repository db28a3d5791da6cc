// attnserve: multi-head attention as a gRPC service.
//
//   attnserve --port=50051 --threads=0
//
// Serves attnserve.v1.AttentionService, grpc.health.v1.Health and server
// reflection until SIGINT or SIGTERM, then lets calls in flight finish and
// exits 0.
#include <pthread.h>
#include <signal.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_join.h"
#include "server.h"

ABSL_FLAG(std::string, address, "0.0.0.0",
          "Address to listen on (IPv4, IPv6 or host name).");
ABSL_FLAG(int, port, 50051,
          "gRPC port; 0 picks a free one, printed at start-up.");
ABSL_FLAG(int, threads, 0,
          "Compute threads (OpenMP); 0 uses every core the process may use.");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{64} << 20,
          "Largest request or response message in bytes (at most 2147483647).");
ABSL_FLAG(int64_t, max_workspace_bytes, int64_t{1} << 30,
          "Most scratch memory one request's compute may allocate, in bytes.");
ABSL_FLAG(int, metrics_port, 9464,
          "Port of the Prometheus /metrics endpoint (on --address); 0 turns it "
          "off.");
ABSL_FLAG(int64_t, max_weights_bytes, int64_t{4} << 30,
          "Most bytes of registered weights the server holds.");
ABSL_FLAG(std::string, weights_dir, "",
          "Folder of weight sets to register at start-up: one folder per name "
          "holding "
          "config.txt (num_heads=H) and w_q/w_k/w_v/w_o[/b_*].npy.");

namespace {

// Blocks SIGINT and SIGTERM in this thread and every thread started after, so
// that only WaitForTerminationSignal sees them.
sigset_t BlockTerminationSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

int WaitForTerminationSignal(const sigset_t& signals) {
  int signal_number = 0;
  while (sigwait(&signals, &signal_number) != 0) {
  }
  return signal_number;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Serves multi-head attention over gRPC. Flags: --helpfull.");
  absl::ParseCommandLine(argc, argv);
  const sigset_t signals = BlockTerminationSignals();

  attnserve::ServerOptions options;
  options.address = absl::GetFlag(FLAGS_address);
  options.port = absl::GetFlag(FLAGS_port);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.max_workspace_bytes = absl::GetFlag(FLAGS_max_workspace_bytes);
  options.max_weights_bytes = absl::GetFlag(FLAGS_max_weights_bytes);
  options.weights_dir = absl::GetFlag(FLAGS_weights_dir);
  if (absl::GetFlag(FLAGS_metrics_port) == 0) {
    options.metrics_port.reset();
  } else {
    options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  }

  absl::StatusOr<std::unique_ptr<attnserve::AttnServer>> server =
      attnserve::AttnServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "attnserve: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::printf("%s\n", (*server)->Describe().c_str());
  std::printf("attnserve weights: %s\n",
              absl::StrJoin((*server)->startup_weights(), ", ").c_str());
  std::fflush(stdout);

  const int signal_number = WaitForTerminationSignal(signals);
  std::printf("attnserve: signal %d, finishing calls in flight\n",
              signal_number);
  std::fflush(stdout);
  (*server)->Shutdown();
  return 0;
}
