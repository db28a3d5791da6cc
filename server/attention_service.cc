#include "attention_service.h"

#include <chrono>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attend_stream.h"
#include "attention_compute.h"
#include "attnserve/common/status_macros.h"
#include "grpc_status.h"
#include "metrics.h"
#include "tensor_codec.h"

namespace attnserve {

AttentionServiceImpl::AttentionServiceImpl(ServerMetrics* metrics,
                                           AttentionEngine* engine,
                                           ComputeExecutor* executor,
                                           WeightsRegistry* registry,
                                           RequestLimits limits)
    : metrics_(metrics),
      engine_(engine),
      executor_(executor),
      registry_(registry),
      limits_(limits) {}

AttentionServiceImpl::Call AttentionServiceImpl::Start(
    Rpc rpc, grpc::CallbackServerContext* context,
    const google::protobuf::Message& request) const {
  metrics_->CallStarted(rpc, static_cast<int64_t>(request.ByteSizeLong()));
  return Call{rpc, context, context->DefaultReactor(), absl::Now()};
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Finish(
    const Call& call, const absl::Status& status,
    const google::protobuf::Message& response) const {
  metrics_->CallFinished(
      call.rpc, status.code(), absl::Now() - call.started,
      status.ok() ? static_cast<int64_t>(response.ByteSizeLong()) : 0);
  call.reactor->Finish(ToGrpcStatus(status));
  return call.reactor;
}

template <typename Compute>
grpc::ServerUnaryReactor* AttentionServiceImpl::Submit(
    const Call& call, double flops, v1::ServerTiming* timing,
    const google::protobuf::Message* response, Compute compute) {
  const absl::Time submitted = absl::Now();
  metrics_->Enqueued();
  executor_->Submit([this, call, flops, timing, response, submitted,
                     compute = std::move(compute)] {
    const absl::Time started = absl::Now();
    metrics_->Dequeued(call.rpc, started - submitted);
    timing->set_queue_us(absl::ToInt64Microseconds(started - submitted));
    absl::Status status;
    if (call.context->IsCancelled()) {
      status = absl::CancelledError(
          "the call was cancelled before its compute started");
    } else if (call.context->deadline() < std::chrono::system_clock::now()) {
      status = absl::DeadlineExceededError(
          "the deadline passed before the compute started");
    } else {
      status = compute();
      const absl::Duration elapsed = absl::Now() - started;
      timing->set_compute_us(absl::ToInt64Microseconds(elapsed));
      metrics_->Computed(call.rpc, elapsed, 1, status.ok() ? flops : 0.0);
    }
    Finish(call, status, *response);
  });
  return call.reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(
    grpc::CallbackServerContext* context, const v1::AttendRequest* request,
    v1::AttendResponse* response) {
  const Call call = Start(Rpc::kAttend, context, *request);
  absl::StatusOr<AttendWork> work = ValidateAttendRequest(*request, limits_);
  if (!work.ok()) return Finish(call, work.status(), *response);
  const double flops = AttentionFlops(work->shape, work->plan.options.causal);
  return Submit(call, flops, response->mutable_timing(), response,
                [this, request, response, work = *std::move(work)] {
                  return ComputeAttend(*engine_, work, *request, response);
                });
}

grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendStreamResponse>*
AttentionServiceImpl::AttendStream(grpc::CallbackServerContext* context) {
  return StartAttendStream(context, {metrics_, engine_, executor_, limits_});
}

grpc::ServerUnaryReactor* AttentionServiceImpl::MultiHeadAttention(
    grpc::CallbackServerContext* context,
    const v1::MultiHeadAttentionRequest* request,
    v1::MultiHeadAttentionResponse* response) {
  const Call call = Start(Rpc::kMultiHeadAttention, context, *request);
  std::shared_ptr<const WeightSet> registered;
  std::string origin = "weights";
  WeightsShape weights_shape;
  if (request->weights_source_case() ==
      v1::MultiHeadAttentionRequest::kWeightsName) {
    absl::Status name =
        ValidateWeightsName("weights_name", request->weights_name());
    if (!name.ok()) return Finish(call, name, *response);
    absl::StatusOr<WeightsRegistry::Entry> entry =
        registry_->Get(request->weights_name());
    if (!entry.ok()) return Finish(call, entry.status(), *response);
    registered = entry->weights;
    response->set_weights_version(entry->version);
    origin = "weights '" + request->weights_name() + "'";
    weights_shape = registered->shape();
  } else if (request->weights_source_case() ==
             v1::MultiHeadAttentionRequest::kWeights) {
    absl::StatusOr<WeightsShape> shape =
        ValidateProjectionWeights(request->weights(), "weights");
    if (!shape.ok()) return Finish(call, shape.status(), *response);
    weights_shape = *shape;
  } else {
    return Finish(
        call,
        absl::InvalidArgumentError(
            "weights and weights_name are both missing, expected one: "
            "inline ProjectionWeights or a name registered by PutWeights"),
        *response);
  }
  absl::StatusOr<MultiHeadWork> work =
      ValidateMultiHeadRequest(*request, weights_shape, origin, limits_);
  if (!work.ok()) return Finish(call, work.status(), *response);
  const double flops = MultiHeadFlops(work->shape, work->plan.options.causal);
  return Submit(call, flops, response->mutable_timing(), response,
                [this, request, response, registered, work = *std::move(work)] {
                  if (registered != nullptr) {
                    return ComputeMultiHead(*engine_, work, registered->views(),
                                            *request, response);
                  }
                  const WeightViews inline_weights(request->weights());
                  return ComputeMultiHead(*engine_, work,
                                          inline_weights.views(), *request,
                                          response);
                });
}

absl::StatusOr<v1::PutWeightsResponse> PutWeightsInto(
    WeightsRegistry& registry, const v1::PutWeightsRequest& request) {
  ATTNSERVE_RETURN_IF_ERROR(ValidateWeightsName("name", request.name()));
  if (!request.has_weights()) {
    return absl::InvalidArgumentError(
        "weights is missing, expected ProjectionWeights");
  }
  ATTNSERVE_ASSIGN_OR_RETURN(
      const WeightsShape shape,
      ValidateProjectionWeights(request.weights(), "weights"));
  ATTNSERVE_RETURN_IF_ERROR(registry.CheckCapacity(
      request.name(), WeightSet::BytesFor(shape, request.weights())));
  ATTNSERVE_ASSIGN_OR_RETURN(
      const WeightsRegistry::Entry entry,
      registry.Put(request.name(),
                   WeightSet::FromProto(request.weights(), shape)));
  v1::PutWeightsResponse response;
  response.set_version(entry.version);
  response.set_bytes(entry.weights->bytes());
  return response;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::PutWeights(
    grpc::CallbackServerContext* context, const v1::PutWeightsRequest* request,
    v1::PutWeightsResponse* response) {
  const Call call = Start(Rpc::kPutWeights, context, *request);
  absl::StatusOr<v1::PutWeightsResponse> result =
      PutWeightsInto(*registry_, *request);
  if (result.ok()) *response = *std::move(result);
  RecordWeightsHeld();
  return Finish(call, result.status(), *response);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListWeights(
    grpc::CallbackServerContext* context, const v1::ListWeightsRequest* request,
    v1::ListWeightsResponse* response) {
  const Call call = Start(Rpc::kListWeights, context, *request);
  const WeightsRegistry::Listing listing = registry_->List();
  for (const auto& [name, entry] : listing.entries) {
    *response->add_weights() = DescribeWeights(name, entry);
  }
  response->set_total_bytes(listing.total_bytes);
  return Finish(call, absl::OkStatus(), *response);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::DeleteWeights(
    grpc::CallbackServerContext* context,
    const v1::DeleteWeightsRequest* request,
    v1::DeleteWeightsResponse* response) {
  const Call call = Start(Rpc::kDeleteWeights, context, *request);
  absl::StatusOr<WeightsRegistry::Entry> entry =
      registry_->Delete(request->name());
  if (entry.ok()) {
    *response->mutable_deleted() = DescribeWeights(request->name(), *entry);
  }
  RecordWeightsHeld();
  return Finish(call, entry.status(), *response);
}

void AttentionServiceImpl::RecordWeightsHeld() const {
  const WeightsRegistry::Listing listing = registry_->List();
  metrics_->SetWeightsHeld(static_cast<int64_t>(listing.entries.size()),
                           listing.total_bytes);
}

}  // namespace attnserve
