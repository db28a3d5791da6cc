#include "attention_service.h"

#include <chrono>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpc_status.h"
#include "tensor_codec.h"

namespace attnserve {

AttentionServiceImpl::AttentionServiceImpl(AttentionEngine* engine,
                                           ComputeExecutor* executor,
                                           RequestLimits limits)
    : engine_(engine), executor_(executor), limits_(limits) {}

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(
    grpc::CallbackServerContext* context, const v1::AttendRequest* request,
    v1::AttendResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<AttendWork> work = ValidateAttendRequest(*request, limits_);
  if (!work.ok()) {
    reactor->Finish(ToGrpcStatus(work.status()));
    return reactor;
  }
  const absl::Time submitted = absl::Now();
  executor_->Submit([this, context, request, response, reactor, submitted,
                     work = *std::move(work)] {
    response->mutable_timing()->set_queue_us(
        absl::ToInt64Microseconds(absl::Now() - submitted));
    reactor->Finish(
        ToGrpcStatus(ComputeAttend(context, work, *request, response)));
  });
  return reactor;
}

absl::Status AttentionServiceImpl::ComputeAttend(
    grpc::CallbackServerContext* context, const AttendWork& work,
    const v1::AttendRequest& request, v1::AttendResponse* response) {
  if (context->IsCancelled()) {
    return absl::CancelledError(
        "the call was cancelled before its compute started");
  }
  if (context->deadline() < std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError(
        "the deadline passed before the compute started");
  }
  std::vector<float> query_copy, key_copy, value_copy;
  const absl::Span<const float> query =
      Float32Elements(request.query(), &query_copy);
  const absl::Span<const float> key = Float32Elements(request.key(), &key_copy);
  const absl::Span<const float> value =
      Float32Elements(request.value(), &value_copy);
  const int64_t output_shape[] = {work.shape.batch, work.shape.heads,
                                  work.shape.query_len, work.shape.value_dim};
  const absl::Span<float> output =
      ResizeFloat32(output_shape, response->mutable_output());

  const absl::Time started = absl::Now();
  absl::Status status =
      engine_->Attend(work.shape, work.options, query, key, value, output);
  response->mutable_timing()->set_compute_us(
      absl::ToInt64Microseconds(absl::Now() - started));
  if (!status.ok()) response->clear_output();
  return status;
}

}  // namespace attnserve
