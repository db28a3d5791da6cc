// The attnserve.v1.AttentionService handlers: parse, validate, submit, respond.
#ifndef ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
#define ATTNSERVE_SERVER_ATTENTION_SERVICE_H_

#include "attnserve/core/attention_engine.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "compute_executor.h"
#include "request_validator.h"

namespace attnserve {

// Thread-safe, as gRPC requires. Does not own the engine or the executor, which
// must outlive it and every RPC it has started.
class AttentionServiceImpl final
    : public v1::AttentionService::CallbackService {
 public:
  AttentionServiceImpl(AttentionEngine* engine, ComputeExecutor* executor,
                       RequestLimits limits);

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* request,
                                   v1::AttendResponse* response) override;

 private:
  // Runs on the executor: computes a validated request into `response`, unless
  // the caller has gone or its deadline has passed.
  absl::Status ComputeAttend(grpc::CallbackServerContext* context,
                             const AttendWork& work,
                             const v1::AttendRequest& request,
                             v1::AttendResponse* response);

  AttentionEngine* const engine_;
  ComputeExecutor* const executor_;
  const RequestLimits limits_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
