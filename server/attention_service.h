// The attnserve.v1.AttentionService handlers: parse, validate, submit, respond.
#ifndef ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
#define ATTNSERVE_SERVER_ATTENTION_SERVICE_H_

#include <memory>

#include "absl/time/time.h"
#include "attnserve/core/attention_engine.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "bytes_pool.h"
#include "call_gate.h"
#include "metrics.h"
#include "request_validator.h"
#include "scheduler.h"
#include "weights_registry.h"

namespace attnserve {

// AttentionService with every method registered raw: the handlers parse each
// request and serialise each response themselves (wire_messages.h), so that
// bytes that are not a valid request get INVALID_ARGUMENT like any other
// malformed request.
using RawAttentionService = v1::AttentionService::WithRawCallbackMethod_Attend<
    v1::AttentionService::WithRawCallbackMethod_AttendStream<
        v1::AttentionService::WithRawCallbackMethod_MultiHeadAttention<
            v1::AttentionService::WithRawCallbackMethod_PutWeights<
                v1::AttentionService::WithRawCallbackMethod_ListWeights<
                    v1::AttentionService::WithRawCallbackMethod_DeleteWeights<
                        v1::AttentionService::Service>>>>>>;

// Thread-safe, as gRPC requires. Does not own its dependencies, which must
// outlive it and every RPC it has started.
class AttentionServiceImpl final : public RawAttentionService {
 public:
  AttentionServiceImpl(ServerMetrics* metrics, AttentionEngine* engine,
                       Scheduler* scheduler, WeightsRegistry* registry,
                       const CallGate* gate, RequestLimits limits,
                       std::shared_ptr<BytesPool> pool);

  // Each takes the request's wire bytes (an attnserve.v1.<Method>Request) and
  // answers with the response's.
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttendStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* MultiHeadAttention(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* PutWeights(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListWeights(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* DeleteWeights(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;

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
    grpc::ServerUnaryReactor* reactor;  // Owns the request and the response.
    grpc::ByteBuffer* wire_response;    // Where Finish serialises the response.
    absl::Time started;
    absl::Status admitted;  // The gate's verdict, then the parse's: not OK
                            // means answer at once with it.
  };

  // Serves one unary call: makes its reactor, parses the request, and hands a
  // call that passed the gate and the parse to `handler`.
  template <typename Request, typename Response>
  grpc::ServerUnaryReactor* Serve(
      Rpc rpc, grpc::CallbackServerContext* context,
      const grpc::ByteBuffer& wire_request, grpc::ByteBuffer* wire_response,
      grpc::ServerUnaryReactor* (AttentionServiceImpl::*handler)(const Call&,
                                                                 const Request&,
                                                                 Response*));

  grpc::ServerUnaryReactor* ServeAttend(const Call& call,
                                        const v1::AttendRequest& request,
                                        v1::AttendResponse* response);
  grpc::ServerUnaryReactor* ServeMultiHeadAttention(
      const Call& call, const v1::MultiHeadAttentionRequest& request,
      v1::MultiHeadAttentionResponse* response);
  grpc::ServerUnaryReactor* ServePutWeights(
      const Call& call, const v1::PutWeightsRequest& request,
      v1::PutWeightsResponse* response);
  grpc::ServerUnaryReactor* ServeListWeights(
      const Call& call, const v1::ListWeightsRequest& request,
      v1::ListWeightsResponse* response);
  grpc::ServerUnaryReactor* ServeDeleteWeights(
      const Call& call, const v1::DeleteWeightsRequest& request,
      v1::DeleteWeightsResponse* response);

  // Gives a response tensor that will hold `elements` of `dtype` kept memory
  // of that size, if the pool has some.
  void SeedOutput(int64_t elements, v1::DType dtype, v1::Tensor* output) const;

  // Records the call's metrics, then answers it with `status` (and `response`,
  // serialised, if OK). Returns the reactor for the handler to return. The
  // reactor, request and response may be gone once it returns.
  grpc::ServerUnaryReactor* Finish(const Call& call, const absl::Status& status,
                                   google::protobuf::Message* response) const;

  // Queues `job` for the call; answers RESOURCE_EXHAUSTED at once if the queue
  // is full.
  grpc::ServerUnaryReactor* Enqueue(const Call& call, std::unique_ptr<Job> job,
                                    google::protobuf::Message* response);

  // On a job's way out of the queue: records the wait in the metrics and
  // `timing`; DEADLINE_EXCEEDED if the call's deadline has passed, CANCELLED
  // if the caller has gone (nothing computed).
  absl::Status Dequeue(const Call& call, absl::Time enqueued,
                       v1::ServerTiming* timing) const;

  ServerMetrics* const metrics_;
  AttentionEngine* const engine_;
  Scheduler* const scheduler_;
  WeightsRegistry* const registry_;
  const CallGate* const gate_;
  const RequestLimits limits_;
  // Where requests' and responses' tensor bytes are kept between calls.
  const std::shared_ptr<BytesPool> pool_;
};

// Validates, converts and registers `request` (shared by PutWeights and the
// start-up loaders).
absl::StatusOr<v1::PutWeightsResponse> PutWeightsInto(
    WeightsRegistry& registry, const v1::PutWeightsRequest& request);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
