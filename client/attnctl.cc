// attnctl: the command line for an attnserve server.
//
//   attnctl [--target=localhost:50051] health [SERVICE]
//   attnctl [--target=...] services
//   attnctl [--target=...] attend --demo [--batch=1 --heads=8 ... --seed=1]
//
// Exits 0 on success, 1 when the call fails (the gRPC status is printed), 2 on
// a usage error.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/client/client.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, target, "localhost:50051",
          "gRPC target of the attnserve server.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(30), "Deadline of each call.");
ABSL_FLAG(bool, demo, false,
          "attend, mha: send random inputs drawn from --seed.");
ABSL_FLAG(uint64_t, seed, 1, "attend --demo: seed of the random inputs.");
ABSL_FLAG(int64_t, batch, 1, "attend --demo: B.");
ABSL_FLAG(int64_t, heads, 8, "attend --demo: H, query heads.");
ABSL_FLAG(int64_t, kv_heads, 8,
          "attend --demo: Hkv, key/value heads (divides H).");
ABSL_FLAG(int64_t, query_len, 128, "attend --demo: Lq.");
ABSL_FLAG(int64_t, key_len, 128, "attend --demo: Lk.");
ABSL_FLAG(int64_t, key_dim, 64, "attend --demo: Dk.");
ABSL_FLAG(int64_t, value_dim, 64, "attend --demo: Dv.");
ABSL_FLAG(std::string, weights_name, "demo",
          "mha --demo: the registered weight set to use.");

namespace attnserve {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitCallFailed = 1;
constexpr int kExitUsage = 2;

constexpr char kUsage[] =
    "attnctl [--target=HOST:PORT] COMMAND\n"
    "  health [SERVICE]   health of the server (or of SERVICE)\n"
    "  services           services the server offers (through reflection)\n"
    "  attend --demo      attention on random inputs; --batch, --heads, "
    "--kv_heads,\n"
    "                     --query_len, --key_len, --key_dim, --value_dim, "
    "--seed\n"
    "  mha --demo         multi-head self-attention on random inputs with a\n"
    "                     registered weight set; --weights_name (demo), "
    "--batch,\n"
    "                     --query_len, --seed\n"
    "  weights            the registered weight sets";

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "attnctl: %s\n", status.ToString().c_str());
  return kExitCallFailed;
}

int RunHealth(Client& client, const std::string& service) {
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> status =
      client.CheckHealth(service, absl::GetFlag(FLAGS_timeout));
  if (!status.ok()) return Fail(status.status());
  std::printf("%s\n",
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*status)
                  .c_str());
  return *status == grpc::health::v1::HealthCheckResponse::SERVING
             ? kExitOk
             : kExitCallFailed;
}

int RunServices(Client& client) {
  grpc::ClientContext context;
  context.set_deadline(
      absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_timeout)));
  auto stub =
      grpc::reflection::v1alpha::ServerReflection::NewStub(client.channel());
  auto stream = stub->ServerReflectionInfo(&context);
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

std::vector<float> RandomValues(int64_t count, std::mt19937_64& generator) {
  std::uniform_real_distribution<float> distribution(-1.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values) value = distribution(generator);
  return values;
}

int PrintResult(const v1::Tensor& output_tensor, const v1::ServerTiming& timing,
                absl::Duration round_trip);

int RunAttendDemo(Client& client) {
  const int64_t b = absl::GetFlag(FLAGS_batch), h = absl::GetFlag(FLAGS_heads),
                hkv = absl::GetFlag(FLAGS_kv_heads),
                lq = absl::GetFlag(FLAGS_query_len),
                lk = absl::GetFlag(FLAGS_key_len),
                dk = absl::GetFlag(FLAGS_key_dim),
                dv = absl::GetFlag(FLAGS_value_dim);
  for (int64_t dim : {b, h, hkv, lq, lk, dk, dv}) {
    if (dim <= 0 || dim > (int64_t{1} << 20)) {
      std::fprintf(stderr,
                   "attnctl: every --demo dimension must be in [1, 2^20]\n");
      return kExitUsage;
    }
  }
  std::mt19937_64 generator(absl::GetFlag(FLAGS_seed));
  v1::AttendRequest request;
  *request.mutable_query() = MakeFloat32Tensor(
      {b, h, lq, dk}, RandomValues(b * h * lq * dk, generator));
  *request.mutable_key() = MakeFloat32Tensor(
      {b, hkv, lk, dk}, RandomValues(b * hkv * lk * dk, generator));
  *request.mutable_value() = MakeFloat32Tensor(
      {b, hkv, lk, dv}, RandomValues(b * hkv * lk * dv, generator));

  const absl::Time start = absl::Now();
  absl::StatusOr<v1::AttendResponse> response =
      client.Attend(request, absl::GetFlag(FLAGS_timeout));
  if (!response.ok()) return Fail(response.status());
  return PrintResult(response->output(), response->timing(),
                     absl::Now() - start);
}

// Prints a result's shape, checksum and the server's timings.
int PrintResult(const v1::Tensor& output_tensor, const v1::ServerTiming& timing,
                absl::Duration round_trip) {
  absl::StatusOr<std::vector<float>> output = FloatValues(output_tensor);
  if (!output.ok()) return Fail(output.status());
  double sum = 0.0, sum_abs = 0.0;
  for (float value : *output) {
    sum += value;
    sum_abs += std::abs(value);
  }
  std::printf("output shape [%s] %s\n",
              absl::StrJoin(output_tensor.shape(), ", ").c_str(),
              v1::DType_Name(output_tensor.dtype()).c_str());
  std::printf("checksum sum=%.6f sum_abs=%.6f\n", sum, sum_abs);
  std::printf("server queue_us=%lld compute_us=%lld, round trip %s\n",
              static_cast<long long>(timing.queue_us()),
              static_cast<long long>(timing.compute_us()),
              absl::FormatDuration(round_trip).c_str());
  return kExitOk;
}

int RunWeights(Client& client) {
  absl::StatusOr<v1::ListWeightsResponse> list =
      client.ListWeights(absl::GetFlag(FLAGS_timeout));
  if (!list.ok()) return Fail(list.status());
  for (const v1::WeightsInfo& info : list->weights()) {
    std::printf(
        "%s version=%lld E=%lld Ekv=%lld H=%lld Hkv=%lld Dk=%lld Dv=%lld "
        "bias=%d "
        "bytes=%lld\n",
        info.name().c_str(), static_cast<long long>(info.version()),
        static_cast<long long>(info.embed_dim()),
        static_cast<long long>(info.kv_embed_dim()),
        static_cast<long long>(info.num_heads()),
        static_cast<long long>(info.num_kv_heads()),
        static_cast<long long>(info.key_dim()),
        static_cast<long long>(info.value_dim()), info.has_bias() ? 1 : 0,
        static_cast<long long>(info.bytes()));
  }
  return kExitOk;
}

int RunMultiHeadDemo(Client& client) {
  const std::string name = absl::GetFlag(FLAGS_weights_name);
  absl::StatusOr<v1::ListWeightsResponse> list =
      client.ListWeights(absl::GetFlag(FLAGS_timeout));
  if (!list.ok()) return Fail(list.status());
  int64_t embed_dim = 0;
  for (const v1::WeightsInfo& info : list->weights()) {
    if (info.name() == name) embed_dim = info.embed_dim();
  }
  if (embed_dim == 0) {
    return Fail(absl::NotFoundError("no weight set named '" + name +
                                    "' on the server"));
  }
  const int64_t b = absl::GetFlag(FLAGS_batch),
                l = absl::GetFlag(FLAGS_query_len);
  if (b <= 0 || l <= 0 || b > (int64_t{1} << 20) || l > (int64_t{1} << 20)) {
    std::fprintf(stderr,
                 "attnctl: --batch and --query_len must be in [1, 2^20]\n");
    return kExitUsage;
  }
  std::mt19937_64 generator(absl::GetFlag(FLAGS_seed));
  v1::MultiHeadAttentionRequest request;
  *request.mutable_query_input() = MakeFloat32Tensor(
      {b, l, embed_dim}, RandomValues(b * l * embed_dim, generator));
  request.set_weights_name(name);
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::MultiHeadAttentionResponse> response =
      client.MultiHeadAttention(request, absl::GetFlag(FLAGS_timeout));
  if (!response.ok()) return Fail(response.status());
  std::printf("weights %s version %lld\n", name.c_str(),
              static_cast<long long>(response->weights_version()));
  return PrintResult(response->output(), response->timing(),
                     absl::Now() - start);
}

int Run(const std::vector<char*>& args) {
  if (args.size() < 2) {
    std::fprintf(stderr, "%s\n", kUsage);
    return kExitUsage;
  }
  const std::string command = args[1];
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect(absl::GetFlag(FLAGS_target));
  if (!client.ok()) return Fail(client.status());
  if (command == "health" && args.size() <= 3) {
    return RunHealth(**client, args.size() == 3 ? args[2] : "");
  }
  if (command == "services" && args.size() == 2) return RunServices(**client);
  if (command == "attend" && args.size() == 2) {
    if (!absl::GetFlag(FLAGS_demo)) {
      std::fprintf(stderr, "attnctl: attend takes its inputs from --demo\n%s\n",
                   kUsage);
      return kExitUsage;
    }
    return RunAttendDemo(**client);
  }
  if (command == "mha" && args.size() == 2) {
    if (!absl::GetFlag(FLAGS_demo)) {
      std::fprintf(stderr, "attnctl: mha takes its inputs from --demo\n%s\n",
                   kUsage);
      return kExitUsage;
    }
    return RunMultiHeadDemo(**client);
  }
  if (command == "weights" && args.size() == 2) return RunWeights(**client);
  std::fprintf(stderr, "attnctl: unknown command or arguments\n%s\n", kUsage);
  return kExitUsage;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(attnserve::kUsage);
  return attnserve::Run(absl::ParseCommandLine(argc, argv));
}
