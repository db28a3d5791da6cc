// attnctl: the command line for an attnserve server.
//
//   attnctl [--target=localhost:50051] [--timeout=30s] COMMAND [ARGS] [FLAGS]
//
// Commands: health, services, attend, mha, weights, session, bench, grid; see
// kUsage
// and docs/client.md; --help lists every flag (attnserve/common/flags_help.h).
// Exits 0 on success, 1 when a call fails (the gRPC status is printed) or an
// output cannot be written, 2 on a usage error.
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "attnctl/attend.h"
#include "attnctl/bench.h"
#include "attnctl/cli.h"
#include "attnctl/grid.h"
#include "attnctl/request_flags.h"
#include "attnctl/sessions.h"
#include "attnctl/weights.h"
#include "attnserve/client/client.h"
#include "attnserve/common/flags_help.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace attnserve {
namespace {

constexpr char kUsage[] =
    "attnctl [--target=HOST:PORT] [--timeout=30s] COMMAND [ARGS] [FLAGS]\n"
    "  health [SERVICE]     health of the server (or of SERVICE)\n"
    "  services             services the server offers (through reflection)\n"
    "  attend               one Attend call: --query=q.npy --key=k.npy\n"
    "                       --value=v.npy [--output=o.npy --weights_out=w.npy\n"
    "                       --lse_out=l.npy], or --demo with --batch, "
    "--heads,\n"
    "                       --kv_heads, --query_len, --key_len, --key_dim,\n"
    "                       --value_dim, --seed, --input_dtype\n"
    "  mha                  one MultiHeadAttention call: --query_input=x.npy\n"
    "                       [--kv_input=y.npy] or --demo; --weights_name=NAME\n"
    "                       (demo) or --weights_dir=FOLDER; outputs as attend\n"
    "  weights [list]       the registered weight sets\n"
    "  weights put NAME FOLDER   register a folder of .npy weights\n"
    "  weights delete NAME  delete a registered weight set\n"
    "  session [list]       the caller's KV-cache sessions\n"
    "  session create       --layers=1 --heads --kv_heads --key_dim "
    "--value_dim\n"
    "                       [--cache_dtype=float32 --max_tokens=N --ttl=10m]\n"
    "  session step ID      append and attend on --layer: --key=k.npy\n"
    "                       --value=v.npy [--query=q.npy --output=o.npy\n"
    "                       --lse_out=l.npy], or --demo --tokens=1\n"
    "                       --query_tokens=1\n"
    "  session fork ID [LENGTH]   a new session sharing ID's first tokens\n"
    "  session truncate ID LENGTH\n"
    "  session get ID | delete ID\n"
    "  bench                closed-loop load: --rpc=attend|mha\n"
    "                       --concurrency=4 (--duration=10s | --requests=N)\n"
    "                       [--warmup=1s --json], shape flags as --demo;\n"
    "                       --rpc=step --sessions=N --context=L --steps=K\n"
    "                       [--layers --compare_stateless]: decode steps\n"
    "  grid                 attention-weights heatmap: --png=out.png or\n"
    "                       --svg=out.svg [--cell=8 --head=N "
    "--batch_index=B],\n"
    "                       inputs as attend\n"
    "Attention options (attend, mha, bench, grid): --scale --causal\n"
    "  --causal_alignment=top_left|bottom_right --key_lengths=5,7\n"
    "  --attn_mask=m.npy --return_weights=none|per_head|head_mean\n"
    "  --return_lse --precision=f32|bf16\n"
    "  --output_dtype=float32|bfloat16|float16 --bf16_as_uint16\n"
    "Connection (every command): --target --timeout --max_message_bytes\n"
    "  --tls_ca --tls_cert --tls_key --tls_server_name --auth_token_file\n"
    "  --wait_for_ready --compression=none|gzip|deflate\n"
    "--help lists every flag, --version prints attnctl's version.";

int RunHealth(Client& client, const std::string& service) {
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> status =
      client.CheckHealth(service, CallTimeout());
  if (!status.ok()) return Fail(status.status());
  std::printf("%s\n",
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*status)
                  .c_str());
  return *status == grpc::health::v1::HealthCheckResponse::SERVING
             ? kExitOk
             : kExitCallFailed;
}

int RunServices(Client& client) {
  // Reflection asks for the token like every RPC but health.
  std::unique_ptr<grpc::ClientContext> context =
      client.NewContext(absl::Now() + CallTimeout());
  auto stub =
      grpc::reflection::v1alpha::ServerReflection::NewStub(client.channel());
  auto stream = stub->ServerReflectionInfo(context.get());
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_list_services("");
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  if (!stream->Write(request) || !stream->WritesDone() ||
      !stream->Read(&response)) {
    const grpc::Status status = stream->Finish();
    return Fail(absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                             status.error_message()));
  }
  for (const auto& service : response.list_services_response().service()) {
    std::printf("%s\n", service.name().c_str());
  }
  stream->Finish();
  return kExitOk;
}

int Run(const std::vector<char*>& argv) {
  if (argv.size() < 2) {
    std::fprintf(stderr, "%s\n", kUsage);
    return kExitUsage;
  }
  const std::string command = argv[1];
  const std::vector<std::string> args(argv.begin() + 2, argv.end());
  const bool known = command == "health" || command == "services" ||
                     command == "attend" || command == "mha" ||
                     command == "weights" || command == "session" ||
                     command == "bench" || command == "grid";
  const bool takes_args =
      command == "health" || command == "weights" || command == "session";
  if (!known || (!takes_args && !args.empty()) ||
      (command == "health" && args.size() > 1)) {
    std::fprintf(stderr, "attnctl: unknown command or arguments\n%s\n", kUsage);
    return kExitUsage;
  }
  absl::StatusOr<std::unique_ptr<Client>> connected = ConnectFromFlags();
  if (!connected.ok()) return UsageError(connected.status());
  Client& client = **connected;
  if (command == "health")
    return RunHealth(client, args.empty() ? "" : args[0]);
  if (command == "services") return RunServices(client);
  if (command == "attend") return RunAttend(client);
  if (command == "mha") return RunMultiHead(client);
  if (command == "weights") return RunWeights(client, args, InputReadOptions());
  if (command == "session") return RunSession(client, args);
  if (command == "bench") return RunBench(client);
  return RunGrid(client);
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  attnserve::ConfigureUsage({"attnctl", attnserve::kUsage, "client/"});
  if (std::optional<int> status = attnserve::HandleHelpFlags(argc, argv)) {
    return *status;
  }
  if (const std::optional<std::string> error =
          attnserve::FlagArgumentsError(argc, argv)) {
    std::fprintf(stderr, "attnctl: %s\n", error->c_str());
    return 2;
  }
  return attnserve::Run(absl::ParseCommandLine(argc, argv));
}
