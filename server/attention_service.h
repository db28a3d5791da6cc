// The attnserve.v1.AttentionService handlers: parse, validate, submit, respond.
#ifndef ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
#define ATTNSERVE_SERVER_ATTENTION_SERVICE_H_

#include "absl/time/time.h"
#include "attnserve/core/attention_engine.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "call_gate.h"
#include "metrics.h"
#include "request_validator.h"
#include "scheduler.h"
#include "weights_registry.h"

namespace attnserve {

// Thread-safe, as gRPC requires. Does not own its dependencies, which must
// outlive it and every RPC it has started.
class AttentionServiceImpl final
    : public v1::AttentionService::CallbackService {
 public:
  AttentionServiceImpl(ServerMetrics* metrics, AttentionEngine* engine,
                       Scheduler* scheduler, WeightsRegistry* registry,
                       const CallGate* gate, RequestLimits limits);

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* request,
                                   v1::AttendResponse* response) override;
  grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendStreamResponse>*
  AttendStream(grpc::CallbackServerContext* context) override;
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

  // Sets the weights gauges from the registry (the handlers call it after each
  // change; the server after loading weights at start-up).
  void RecordWeightsHeld() const;

 private:
  class UnaryJob;
  class AttendJob;

  // One call in progress: what Finish needs to answer it and record it.
  struct Call {
    Rpc rpc;
    grpc::CallbackServerContext* context;
    grpc::ServerUnaryReactor*
        reactor;  // The context's DefaultReactor, taken once.
    absl::Time started;
    absl::Status
        admitted;  // The gate's verdict: not OK means answer at once with it.
  };

  Call Start(Rpc rpc, grpc::CallbackServerContext* context,
             const google::protobuf::Message& request) const;

  // Records the call's metrics, then answers it with `status` (and `response`
  // if OK). Returns the reactor for the handler to return.
  grpc::ServerUnaryReactor* Finish(
      const Call& call, const absl::Status& status,
      const google::protobuf::Message& response) const;

  // Queues `job` for the call; answers RESOURCE_EXHAUSTED at once if the queue
  // is full.
  grpc::ServerUnaryReactor* Enqueue(const Call& call, std::unique_ptr<Job> job,
                                    const google::protobuf::Message& response);

  // On a job's way out of the queue: records the wait in the metrics and
  // `timing`; CANCELLED or DEADLINE_EXCEEDED if the caller has gone or its
  // deadline has passed (nothing computed).
  absl::Status Dequeue(const Call& call, absl::Time enqueued,
                       v1::ServerTiming* timing) const;

  ServerMetrics* const metrics_;
  AttentionEngine* const engine_;
  Scheduler* const scheduler_;
  WeightsRegistry* const registry_;
  const CallGate* const gate_;
  const RequestLimits limits_;
};

// Validates, converts and registers `request` (shared by PutWeights and the
// start-up loaders).
absl::StatusOr<v1::PutWeightsResponse> PutWeightsInto(
    WeightsRegistry& registry, const v1::PutWeightsRequest& request);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
