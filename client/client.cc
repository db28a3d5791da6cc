#include "attnserve/client/client.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace attnserve {
namespace {

absl::Status FromGrpcStatus(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

void SetTimeout(absl::Duration timeout, grpc::ClientContext* context) {
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(
    absl::string_view target, const ClientOptions& options) {
  if (target.empty()) {
    return absl::InvalidArgumentError(
        "target is empty, expected e.g. \"localhost:50051\"");
  }
  if (options.max_message_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes is ", options.max_message_bytes, ", expected > 0"));
  }
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(options.max_message_bytes);
  arguments.SetMaxSendMessageSize(options.max_message_bytes);
  return std::unique_ptr<Client>(new Client(grpc::CreateCustomChannel(
      std::string(target), grpc::InsecureChannelCredentials(), arguments)));
}

Client::Client(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)),
      stub_(v1::AttentionService::NewStub(channel_)) {}

absl::StatusOr<v1::AttendResponse> Client::Attend(
    const v1::AttendRequest& request, absl::Duration timeout) {
  grpc::ClientContext context;
  SetTimeout(timeout, &context);
  v1::AttendResponse response;
  const grpc::Status status = stub_->Attend(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus>
Client::CheckHealth(absl::string_view service, absl::Duration timeout) {
  grpc::ClientContext context;
  SetTimeout(timeout, &context);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(std::string(service));
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status =
      grpc::health::v1::Health::NewStub(channel_)->Check(&context, request,
                                                         &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response.status();
}

v1::Tensor MakeFloat32Tensor(absl::Span<const int64_t> shape,
                             absl::Span<const float> values) {
  v1::Tensor tensor;
  tensor.set_dtype(v1::FLOAT32);
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  tensor.set_data(reinterpret_cast<const char*>(values.data()),
                  values.size() * sizeof(float));
  return tensor;
}

absl::StatusOr<std::vector<float>> Float32Values(const v1::Tensor& tensor) {
  if (tensor.dtype() != v1::FLOAT32) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor.dtype is ", tensor.dtype(), ", expected FLOAT32"));
  }
  uint64_t elements = 1;
  for (int64_t dim : tensor.shape()) {
    if (dim < 0 || __builtin_mul_overflow(elements, static_cast<uint64_t>(dim),
                                          &elements)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor.shape has dimension ", dim,
                       ", expected a small non-negative size"));
    }
  }
  if (tensor.data().size() / sizeof(float) != elements ||
      tensor.data().size() % sizeof(float) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor.data has ", tensor.data().size(),
                     " bytes, expected ", elements, " x ", sizeof(float)));
  }
  std::vector<float> values(elements);
  std::memcpy(values.data(), tensor.data().data(), tensor.data().size());
  return values;
}

}  // namespace attnserve
