// The attnserve.v1.AttentionService handlers: parse, validate, submit, respond.
#ifndef ATTNSERVE_SERVER_ATTENTION_ATTENTION_SERVICE_H_
#define ATTNSERVE_SERVER_ATTENTION_ATTENTION_SERVICE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <optional>

#include "absl/time/time.h"
#include "attnserve/core/attention_engine.h"
#include "attnserve/server/attention/attend_stream.h"
#include "attnserve/server/attention/compute_job.h"
#include "attnserve/server/attention/request_validator.h"
#include "attnserve/server/attention/scheduler.h"
#include "attnserve/server/metrics/metrics.h"
#include "attnserve/server/oip/inference_models.h"
#include "attnserve/server/rpc/access_log.h"
#include "attnserve/server/rpc/bytes_pool.h"
#include "attnserve/server/rpc/call_gate.h"
#include "attnserve/server/rpc/call_loop.h"
#include "attnserve/server/rpc/memory_budget.h"
#include "attnserve/server/rpc/transfer_watchdog.h"
#include "attnserve/server/rpc/transport_options.h"
#include "attnserve/server/sessions/session_store.h"
#include "attnserve/server/weights/weights_registry.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "inference/grpc_service.pb.h"

namespace attnserve {

// attnserve.v1.AttentionService, served on the CallLoop. The handlers parse
// each request and serialise each response themselves (wire_messages.h), so
// that bytes that are not a valid request get INVALID_ARGUMENT like any other
// malformed request, and tensors' bytes are kept between calls.
//
// Thread-safe. Does not own its dependencies, which must outlive it and every
// call it has started.
class AttentionServiceImpl final {
 public:
  AttentionServiceImpl(ServerMetrics* metrics, AttentionEngine* engine,
                       Scheduler* scheduler, WeightsRegistry* registry,
                       SessionStore* sessions, const CallGate* gate,
                       MemoryBudget* budget, RequestChecks checks,
                       TransportOptions transport,
                       std::shared_ptr<BytesPool> pool,
                       AccessLog* access_log = nullptr);

  // Serves every method of the service on `loop`.
  void AddTo(CallLoop& loop);

  // Sets the weights gauges from the registry (the handlers call it after each
  // change; the server after loading weights at start-up).
  void RecordWeightsHeld() const;

  // The drain's end: every AttendStream, open or opened later, takes no more
  // messages and ends UNAVAILABLE once it has written the answers to those it
  // took.
  void EndStreams() { open_streams_.EndAll(); }

  // The drain's start: the Open Inference Protocol's ServerReady and
  // ModelReady answer false from now on (as gRPC's health turns NOT_SERVING),
  // while calls are still taken through the grace period.
  void StopReady() { ready_.store(false); }

 private:
  class UnaryCaller;

  // The handler of one unary call: what Finish answers.
  class UnaryCall : public ServerCall {
   public:
    grpc::ByteBuffer wire_response;  // Where Finish serialises the response.
    // The request's bytes as they arrived (compressed or not), once read.
    int64_t received_bytes = 0;
    // The gate admitted the caller (its token, the drain): its identity is
    // known, whatever else refuses the call.
    bool caller_admitted = false;
    // The call's share of the memory budget: its message from arrival, then
    // its compute's memory too, until the answer has been sent (OnDone).
    MemoryBudget::Hold hold;
    // Called by Finish with the call's final status (a ModelInfer of a
    // model records the protocol's statistics there).
    std::function<void(const absl::Status&)> on_finish;
    // The compute's timing where the response does not carry it (ModelInfer,
    // whose native answer held it), for the access log.
    std::optional<v1::ServerTiming> computed;
    // Set by Finish when it gave gRPC an OK answer: counted as not delivered
    // if the call then ends cancelled (OnDone).
    std::optional<Rpc> answered_ok;

    // Fills in what the access log says of the call's request and response:
    // the weights or session it named, the server's timing.
    virtual void Describe(AccessRecord* record) const = 0;

    // Ends the call with `status`, and with wire_response if OK: an answer
    // its client has not taken within send_watchdog's timeout cancels the
    // call, which frees what the answer holds.
    void Answer(const grpc::Status& status) {
      if (status.ok()) {
        if (send_watchdog != nullptr) {
          send_ticket =
              send_watchdog->Watch(this, SendAllowance(wire_response.Length()));
        }
        FinishWithMessage(wire_response, status);
      } else {
        Finish(status);
      }
    }

   protected:
    TransferWatchdog* send_watchdog = nullptr;  // Set by the subclass.
    // The answer's, while it is sent; unwatched in OnDone.
    std::optional<TransferWatchdog::Ticket> send_ticket;
  };
  // A unary call of one method: reads its request, then hands it to the
  // service; owns the request and the response until the call is done, then
  // gives their tensors' bytes to the pool.
  template <typename Request, typename Response>
  class WireCall;

  // One call in progress: what Finish needs to answer it and record it.
  struct Call {
    Rpc rpc;
    UnaryCall* handler;  // Owns the request and the response.
    absl::Time started;
    int64_t request_bytes;  // On the wire, as it arrived (compressed or not).
    absl::Status admitted;  // The gate's verdict, then the parse's: not OK
                            // means answer at once with it.
    // The caller's identity, worked out once (Owner).
    mutable std::optional<std::string> identity;
  };

  template <typename Request, typename Response>
  using Handler = void (AttentionServiceImpl::*)(const Call&, const Request&,
                                                 Response*);

  // Registers `method`'s calls, served by `handler`.
  template <typename Request, typename Response>
  void HandleMethod(CallLoop& loop, const char* method, Rpc rpc,
                    Handler<Request, Response> handler);
  // `method` of `service` ("inference.GRPCInferenceService").
  template <typename Request, typename Response>
  void HandleMethodOf(CallLoop& loop, const std::string& service,
                      const char* method, Rpc rpc,
                      Handler<Request, Response> handler);

  // Serves one unary call whose request has arrived (nullptr: the call ended
  // before it did, or the gate refused it on its headers with `admitted`):
  // parses it and hands a call that passed the gate and the parse to
  // `handler`.
  template <typename Request, typename Response>
  void Serve(Rpc rpc, WireCall<Request, Response>* call,
             grpc::ByteBuffer* wire_request, const absl::Status& admitted,
             Handler<Request, Response> handler);

  void ServeAttend(const Call& call, const v1::AttendRequest& request,
                   v1::AttendResponse* response);
  // The server's checks, for an answer that carries the output or not.
  RequestChecks ChecksFor(bool answer_carries_output) const;
  // Validate `request`, hold its compute's memory and submit the compute;
  // `caller` hears the outcome, a refusal included. The request and response
  // must outlive the caller's Computed. Without `answer_carries_output` (a
  // ModelInfer asking for other outputs alone) the answer's size is checked
  // without the output.
  void StartAttend(const Call& call, const v1::AttendRequest& request,
                   v1::AttendResponse* response,
                   std::shared_ptr<ComputeCaller> caller,
                   bool answer_carries_output = true);
  void StartMultiHeadAttention(const Call& call,
                               const v1::MultiHeadAttentionRequest& request,
                               v1::MultiHeadAttentionResponse* response,
                               std::shared_ptr<ComputeCaller> caller,
                               bool answer_carries_output = true);

  // inference.GRPCInferenceService, the Open Inference Protocol
  // (inference_service.cc; models in oip/inference_models.h).
  void AddInferenceService(CallLoop& loop);
  void ServeServerLive(const Call& call,
                       const inference::ServerLiveRequest& request,
                       inference::ServerLiveResponse* response);
  void ServeServerReady(const Call& call,
                        const inference::ServerReadyRequest& request,
                        inference::ServerReadyResponse* response);
  void ServeModelReady(const Call& call,
                       const inference::ModelReadyRequest& request,
                       inference::ModelReadyResponse* response);
  void ServeServerMetadata(const Call& call,
                           const inference::ServerMetadataRequest& request,
                           inference::ServerMetadataResponse* response);
  void ServeModelMetadata(const Call& call,
                          const inference::ModelMetadataRequest& request,
                          inference::ModelMetadataResponse* response);
  void ServeModelConfig(const Call& call,
                        const inference::ModelConfigRequest& request,
                        inference::ModelConfigResponse* response);
  void ServeModelStatistics(const Call& call,
                            const inference::ModelStatisticsRequest& request,
                            inference::ModelStatisticsResponse* response);
  void ServeModelInfer(const Call& call,
                       const inference::ModelInferRequest& request,
                       inference::ModelInferResponse* response);
  // The model `name` at `version` ("" for any): sdpa (nullopt) or the
  // registered set of that name; NOT_FOUND naming what exists otherwise.
  absl::StatusOr<std::optional<WeightsRegistry::Entry>> FindModel(
      const std::string& name, const std::string& version) const;
  void ServeMultiHeadAttention(const Call& call,
                               const v1::MultiHeadAttentionRequest& request,
                               v1::MultiHeadAttentionResponse* response);
  void ServePutWeights(const Call& call, const v1::PutWeightsRequest& request,
                       v1::PutWeightsResponse* response);
  void ServeListWeights(const Call& call, const v1::ListWeightsRequest& request,
                        v1::ListWeightsResponse* response);
  void ServeDeleteWeights(const Call& call,
                          const v1::DeleteWeightsRequest& request,
                          v1::DeleteWeightsResponse* response);
  void ServeCreateSession(const Call& call,
                          const v1::CreateSessionRequest& request,
                          v1::CreateSessionResponse* response);
  void ServeStep(const Call& call, const v1::StepRequest& request,
                 v1::StepResponse* response);
  // CheckReplicaIncarnation for one session's request.
  absl::Status SameIncarnation(absl::string_view requested) const;
  void ServeForkSession(const Call& call, const v1::ForkSessionRequest& request,
                        v1::ForkSessionResponse* response);
  void ServeTruncateSession(const Call& call,
                            const v1::TruncateSessionRequest& request,
                            v1::TruncateSessionResponse* response);
  void ServeDeleteSession(const Call& call,
                          const v1::DeleteSessionRequest& request,
                          v1::DeleteSessionResponse* response);
  void ServeGetSession(const Call& call, const v1::GetSessionRequest& request,
                       v1::GetSessionResponse* response);
  void ServeListSessions(const Call& call,
                         const v1::ListSessionsRequest& request,
                         v1::ListSessionsResponse* response);

  // The identity the caller's sessions belong to (CallGate::Identity), of an
  // admitted call.
  const std::string& Owner(const Call& call) const;

  // Gives a response tensor that will hold `elements` of `dtype` kept memory
  // of that size, if the pool has some.
  void SeedOutput(int64_t elements, v1::DType dtype, v1::Tensor* output) const;

  // Records the call's metrics, then answers it with `status` (and `response`,
  // serialised, if OK). The call, request and response may be gone once it
  // returns.
  void Finish(const Call& call, const absl::Status& status,
              google::protobuf::Message* response) const;

  // Adds the memory the call's compute will allocate to its hold;
  // RESOURCE_EXHAUSTED if the budget has no room for it.
  absl::Status HoldComputeMemory(const Call& call, int64_t bytes) const {
    return call.handler->hold.Grow(bytes);
  }

  ServerMetrics* const metrics_;
  AttentionEngine* const engine_;
  WeightsRegistry* const registry_;
  SessionStore* const sessions_;
  const CallGate* const gate_;
  MemoryBudget* const budget_;
  const RequestChecks checks_;
  const TransportOptions transport_;
  // Where requests' and responses' tensor bytes are kept between calls.
  const std::shared_ptr<BytesPool> pool_;
  // Where the computes run and record.
  const ComputeContext compute_;
  // Cancels unary calls whose request stops arriving or whose answer is not
  // taken.
  TransferWatchdog watchdog_;
  // Cancels AttendStreams whose next message does not come or whose answer
  // is not taken.
  TransferWatchdog stream_watchdog_;
  // The AttendStreams open, for EndStreams.
  OpenStreams open_streams_;
  // One line per call when not null (--access_log).
  AccessLog* const access_log_;
  // ModelInfer's calls by model, for ModelStatistics.
  oip::InferenceStatistics inference_statistics_;
  // Until the drain starts (StopReady).
  std::atomic<bool> ready_{true};
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_ATTENTION_SERVICE_H_
