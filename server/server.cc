#include "server.h"

#include <limits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attention_service.h"
#include "attnserve/core/status_macros.h"
#include "compute_executor.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "weights_loader.h"
#include "weights_registry.h"

namespace attnserve {
namespace {

// How long Shutdown waits for calls in flight before cancelling them.
constexpr absl::Duration kShutdownGrace = absl::Seconds(30);

absl::Status ValidateOptions(const ServerOptions& options) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("port is ", options.port, ", expected 0 to 65535"));
  }
  if (options.threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads is ", options.threads, ", expected >= 0"));
  }
  if (options.max_message_bytes <= 0 ||
      options.max_message_bytes > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_message_bytes is ", options.max_message_bytes,
                     ", expected 1 to 2147483647"));
  }
  return absl::OkStatus();
}

std::string ListenAddress(const ServerOptions& options) {
  const bool ipv6_literal = absl::StrContains(options.address, ':');
  return ipv6_literal ? absl::StrCat("[", options.address, "]:", options.port)
                      : absl::StrCat(options.address, ":", options.port);
}

class AttnServerImpl final : public AttnServer {
 public:
  AttnServerImpl(std::unique_ptr<AttentionEngine> engine,
                 const ServerOptions& options, RequestLimits limits)
      : engine_(std::move(engine)),
        registry_(options.max_weights_bytes),
        service_(engine_.get(), &executor_, &registry_, limits) {}

  // Registers the demo weights and those of --weights_dir.
  absl::Status LoadWeights(const ServerOptions& options) {
    ATTNSERVE_RETURN_IF_ERROR(
        PutWeightsInto(registry_, DemoWeights()).status());
    startup_weights_.push_back(kDemoWeightsName);
    if (options.weights_dir.empty()) return absl::OkStatus();
    ATTNSERVE_ASSIGN_OR_RETURN(
        std::vector<std::string> names,
        LoadWeightsDir(options.weights_dir, options.max_weights_bytes,
                       registry_));
    for (const std::string& name : names) {
      // A folder named demo replaces the built-in set; list it once.
      if (name != kDemoWeightsName) startup_weights_.push_back(name);
    }
    return absl::OkStatus();
  }

  const std::vector<std::string>& startup_weights() const override {
    return startup_weights_;
  }

  ~AttnServerImpl() override { Shutdown(); }

  absl::Status Listen(const ServerOptions& options) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    builder.AddListeningPort(ListenAddress(options),
                             grpc::InsecureServerCredentials(), &port_);
    // Without this gRPC sets SO_REUSEPORT, and a second server on a busy port
    // would start and silently take half the connections instead of failing.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.SetMaxReceiveMessageSize(
        static_cast<int>(options.max_message_bytes));
    builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port_ == 0) {
      return absl::UnavailableError(
          absl::StrCat("could not listen on ", ListenAddress(options),
                       ": the address is in use or not local to this machine"));
    }
    server_->GetHealthCheckService()->SetServingStatus(
        v1::AttentionService::service_full_name(), true);
    return absl::OkStatus();
  }

  int port() const override { return port_; }

  void Shutdown() override {
    absl::MutexLock lock(&shutdown_mutex_);
    if (server_ == nullptr || shut_down_) return;
    shut_down_ = true;
    server_->GetHealthCheckService()->SetServingStatus(false);
    server_->Shutdown(absl::ToChronoTime(absl::Now() + kShutdownGrace));
  }

 private:
  // Declared in the order they are built; destroyed in reverse, so the gRPC
  // server goes first, then the executor (after its queued tasks), then the
  // engine.
  std::unique_ptr<AttentionEngine> engine_;
  WeightsRegistry registry_;
  std::vector<std::string> startup_weights_;
  ComputeExecutor executor_;
  AttentionServiceImpl service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  absl::Mutex shutdown_mutex_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mutex_) = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<AttnServer>> AttnServer::Start(
    const ServerOptions& options) {
  ATTNSERVE_RETURN_IF_ERROR(ValidateOptions(options));
  EngineOptions engine_options;
  engine_options.num_threads = options.threads;
  engine_options.max_workspace_bytes = options.max_workspace_bytes;
  ATTNSERVE_ASSIGN_OR_RETURN(std::unique_ptr<AttentionEngine> engine,
                             AttentionEngine::Create(engine_options));
  RequestLimits limits;
  limits.max_message_bytes = options.max_message_bytes;
  auto server =
      std::make_unique<AttnServerImpl>(std::move(engine), options, limits);
  ATTNSERVE_RETURN_IF_ERROR(server->LoadWeights(options));
  ATTNSERVE_RETURN_IF_ERROR(server->Listen(options));
  return server;
}

}  // namespace attnserve
