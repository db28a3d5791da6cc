// The attnserve.v1.AttentionService handlers: parse, validate, submit, respond.
#ifndef ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
#define ATTNSERVE_SERVER_ATTENTION_SERVICE_H_

#include "attnserve/core/attention_engine.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "compute_executor.h"
#include "request_validator.h"
#include "weights_registry.h"

namespace attnserve {

// Thread-safe, as gRPC requires. Does not own the engine, executor or registry,
// which must outlive it and every RPC it has started.
class AttentionServiceImpl final
    : public v1::AttentionService::CallbackService {
 public:
  AttentionServiceImpl(AttentionEngine* engine, ComputeExecutor* executor,
                       WeightsRegistry* registry, RequestLimits limits);

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* request,
                                   v1::AttendResponse* response) override;
  grpc::ServerUnaryReactor* MultiHeadAttention(
      grpc::CallbackServerContext* context,
      const v1::MultiHeadAttentionRequest* request,
      v1::MultiHeadAttentionResponse* response) override;
  grpc::ServerUnaryReactor* PutWeights(
      grpc::CallbackServerContext* context,
      const v1::PutWeightsRequest* request,
      v1::PutWeightsResponse* response) override;
  grpc::ServerUnaryReactor* ListWeights(
      grpc::CallbackServerContext* context,
      const v1::ListWeightsRequest* request,
      v1::ListWeightsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteWeights(
      grpc::CallbackServerContext* context,
      const v1::DeleteWeightsRequest* request,
      v1::DeleteWeightsResponse* response) override;

 private:
  // Runs `compute` on the executor unless the caller has gone or its deadline
  // has passed by then, records the queue wait and compute time in `timing`,
  // and finishes the call. Returns the call's reactor (a context's
  // DefaultReactor may be taken only once).
  template <typename Compute>
  grpc::ServerUnaryReactor* Submit(grpc::CallbackServerContext* context,
                                   v1::ServerTiming* timing, Compute compute);

  AttentionEngine* const engine_;
  ComputeExecutor* const executor_;
  WeightsRegistry* const registry_;
  const RequestLimits limits_;
};

// Validates, converts and registers `request` (shared by PutWeights and the
// start-up loaders).
absl::StatusOr<v1::PutWeightsResponse> PutWeightsInto(
    WeightsRegistry& registry, const v1::PutWeightsRequest& request);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
