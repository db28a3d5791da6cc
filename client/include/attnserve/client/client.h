// attnserve::Client: calls an attnserve server from C++.
//
//   ATTNSERVE_ASSIGN_OR_RETURN(std::unique_ptr<attnserve::Client> client,
//                              attnserve::Client::Connect("localhost:50051"));
//   attnserve::v1::AttendRequest request;
//   *request.mutable_query() = attnserve::MakeFloat32Tensor({1, 8, 128, 64},
//   query_values);
//   ...
//   ATTNSERVE_ASSIGN_OR_RETURN(attnserve::v1::AttendResponse response,
//                              client->Attend(request, absl::Seconds(5)));
//
// Errors come back as absl::Status with the server's gRPC code and message
// unchanged.
#ifndef ATTNSERVE_CLIENT_CLIENT_H_
#define ATTNSERVE_CLIENT_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "grpc/health/v1/health.pb.h"

namespace attnserve {

struct ClientOptions {
  // The largest message the client sends or receives, in bytes; match the
  // server's
  // --max_message_bytes.
  int max_message_bytes = 64 << 20;
};

// A connection to one attnserve target. Thread-safe: calls may run concurrently
// on one Client.
class Client {
 public:
  // Returns a client for `target`, a gRPC target string ("localhost:50051",
  // "dns:///attnserve.default.svc:50051", "unix:/run/attnserve.sock"). Connects
  // lazily: an unreachable server shows as UNAVAILABLE on the first call.
  // INVALID_ARGUMENT for an empty target or bad options.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      absl::string_view target, const ClientOptions& options = {});

  // Calls Attend, waiting at most `timeout` (DEADLINE_EXCEEDED past it).
  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& request,
                                            absl::Duration timeout);

  // Calls MultiHeadAttention, waiting at most `timeout`.
  absl::StatusOr<v1::MultiHeadAttentionResponse> MultiHeadAttention(
      const v1::MultiHeadAttentionRequest& request, absl::Duration timeout);

  // The weights registry: register or replace, list, delete.
  absl::StatusOr<v1::PutWeightsResponse> PutWeights(
      const v1::PutWeightsRequest& request, absl::Duration timeout);
  absl::StatusOr<v1::ListWeightsResponse> ListWeights(absl::Duration timeout);
  absl::StatusOr<v1::DeleteWeightsResponse> DeleteWeights(
      absl::string_view name, absl::Duration timeout);

  // Asks grpc.health.v1.Health about `service` ("" for the server as a whole).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus>
  CheckHealth(absl::string_view service, absl::Duration timeout);

  // The channel, for calling services this class does not wrap.
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }

 private:
  explicit Client(std::shared_ptr<grpc::Channel> channel);

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

// A FLOAT32 tensor of `shape` holding `values` (row-major). The caller keeps
// the element count consistent with the shape; the server rejects a mismatch by
// name.
v1::Tensor MakeFloat32Tensor(absl::Span<const int64_t> shape,
                             absl::Span<const float> values);

// A tensor of `dtype` (FLOAT32, BFLOAT16 or FLOAT16) and `shape` holding
// `values` rounded to the dtype (to nearest, ties to even).
v1::Tensor MakeTensor(v1::DType dtype, absl::Span<const int64_t> shape,
                      absl::Span<const float> values);

// A BOOL tensor of `shape` holding `values` (one byte each).
v1::Tensor MakeBoolTensor(absl::Span<const int64_t> shape,
                          const std::vector<bool>& values);

// The elements of a FLOAT32 tensor. INVALID_ARGUMENT if the dtype is not
// FLOAT32 or the byte count does not match the shape.
absl::StatusOr<std::vector<float>> Float32Values(const v1::Tensor& tensor);

// The elements of a FLOAT32, BFLOAT16 or FLOAT16 tensor, widened to float.
// INVALID_ARGUMENT for another dtype or a byte count that does not match the
// shape.
absl::StatusOr<std::vector<float>> FloatValues(const v1::Tensor& tensor);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_CLIENT_H_
