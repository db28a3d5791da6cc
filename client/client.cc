#include "attnserve/client/client.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnserve/common/dtype.h"
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

// Calls the unary `method` of `stub` with a deadline `timeout` from now.
template <typename Stub, typename Request, typename Response>
absl::StatusOr<Response> CallUnary(
    Stub& stub,
    grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                 Response*),
    const Request& request, absl::Duration timeout) {
  grpc::ClientContext context;
  SetTimeout(timeout, &context);
  Response response;
  const grpc::Status status = (stub.*method)(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::AttendResponse> Client::Attend(
    const v1::AttendRequest& request, absl::Duration timeout) {
  return CallUnary(*stub_, &v1::AttentionService::Stub::Attend, request,
                   timeout);
}

absl::StatusOr<v1::MultiHeadAttentionResponse> Client::MultiHeadAttention(
    const v1::MultiHeadAttentionRequest& request, absl::Duration timeout) {
  return CallUnary(*stub_, &v1::AttentionService::Stub::MultiHeadAttention,
                   request, timeout);
}

absl::StatusOr<v1::PutWeightsResponse> Client::PutWeights(
    const v1::PutWeightsRequest& request, absl::Duration timeout) {
  return CallUnary(*stub_, &v1::AttentionService::Stub::PutWeights, request,
                   timeout);
}

absl::StatusOr<v1::ListWeightsResponse> Client::ListWeights(
    absl::Duration timeout) {
  return CallUnary(*stub_, &v1::AttentionService::Stub::ListWeights,
                   v1::ListWeightsRequest(), timeout);
}

absl::StatusOr<v1::DeleteWeightsResponse> Client::DeleteWeights(
    absl::string_view name, absl::Duration timeout) {
  v1::DeleteWeightsRequest request;
  request.set_name(std::string(name));
  return CallUnary(*stub_, &v1::AttentionService::Stub::DeleteWeights, request,
                   timeout);
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

v1::Tensor MakeTensor(v1::DType dtype, absl::Span<const int64_t> shape,
                      absl::Span<const float> values) {
  if (dtype == v1::FLOAT32) return MakeFloat32Tensor(shape, values);
  v1::Tensor tensor;
  tensor.set_dtype(dtype);
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  std::string* data = tensor.mutable_data();
  data->resize(values.size() * 2);
  ConvertFromFloat32(
      values.data(), static_cast<int64_t>(values.size()),
      dtype == v1::BFLOAT16 ? DataType::kBFloat16 : DataType::kFloat16,
      data->data());
  return tensor;
}

v1::Tensor MakeBoolTensor(absl::Span<const int64_t> shape,
                          const std::vector<bool>& values) {
  v1::Tensor tensor;
  tensor.set_dtype(v1::BOOL);
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  std::string* data = tensor.mutable_data();
  for (bool value : values) data->push_back(value ? 1 : 0);
  return tensor;
}

absl::StatusOr<std::vector<float>> Float32Values(const v1::Tensor& tensor) {
  if (tensor.dtype() != v1::FLOAT32) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor.dtype is ", tensor.dtype(), ", expected FLOAT32"));
  }
  return FloatValues(tensor);
}

absl::StatusOr<std::vector<float>> FloatValues(const v1::Tensor& tensor) {
  if (tensor.dtype() != v1::FLOAT32 && tensor.dtype() != v1::BFLOAT16 &&
      tensor.dtype() != v1::FLOAT16) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor.dtype is ", tensor.dtype(),
                     ", expected FLOAT32, BFLOAT16 or FLOAT16"));
  }
  const uint64_t element_bytes = tensor.dtype() == v1::FLOAT32 ? 4 : 2;
  uint64_t elements = 1;
  for (int64_t dim : tensor.shape()) {
    if (dim < 0 || __builtin_mul_overflow(elements, static_cast<uint64_t>(dim),
                                          &elements)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor.shape has dimension ", dim,
                       ", expected a small non-negative size"));
    }
  }
  if (tensor.data().size() / element_bytes != elements ||
      tensor.data().size() % element_bytes != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor.data has ", tensor.data().size(),
                     " bytes, expected ", elements, " x ", element_bytes));
  }
  const DataType type = tensor.dtype() == v1::FLOAT32    ? DataType::kFloat32
                        : tensor.dtype() == v1::BFLOAT16 ? DataType::kBFloat16
                                                         : DataType::kFloat16;
  std::vector<float> values(elements);
  ConvertToFloat32(type, tensor.data().data(), static_cast<int64_t>(elements),
                   values.data());
  return values;
}

}  // namespace attnserve
