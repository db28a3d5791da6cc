#include "attnserve/server/attention/attention_service.h"

#include <chrono>
#include <new>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/common/allocation_failures.h"
#include "attnserve/common/echo.h"
#include "attnserve/common/refusals.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/proto/tensors.h"
#include "attnserve/server/attention/attend_stream.h"
#include "attnserve/server/attention/attention_compute.h"
#include "attnserve/server/metrics/metrics.h"
#include "attnserve/server/rpc/grpc_status.h"
#include "attnserve/server/rpc/inflate.h"
#include "attnserve/server/rpc/memory_budget.h"
#include "attnserve/server/rpc/wire_messages.h"
#include "attnserve/server/sessions/session_requests.h"
#include "attnserve/server/sessions/session_steps.h"
#include "attnserve/server/tensors/tensor_codec.h"
#include "inference/grpc_service.grpc.pb.h"

namespace attnserve {

// A unary call's side of its compute job.
class AttentionServiceImpl::UnaryCaller final : public ComputeCaller {
 public:
  // `complete`, if given, runs once the compute succeeded, before the answer
  // (a front-end moving the result into its own response); its error becomes
  // the call's.
  UnaryCaller(const AttentionServiceImpl* service, const Call& call,
              google::protobuf::Message* response,
              std::function<absl::Status()> complete = nullptr)
      : service_(service),
        call_(call),
        response_(response),
        complete_(std::move(complete)) {}

  // A passed deadline also cancels the call: it is checked first, and a
  // cancel within kDeadlineSlack of the deadline counts as the deadline's, so
  // that the metrics tell the two apart.
  absl::Status StillWanted() const override {
    const grpc::ServerContextBase& context = call_.handler->context();
    const bool cancelled = call_.handler->cancelled();
    if (DeadlineWithin(context,
                       cancelled ? kDeadlineSlack : absl::ZeroDuration())) {
      return absl::DeadlineExceededError(
          "the deadline passed before the compute started");
    }
    if (cancelled) return absl::CancelledError("the call was cancelled");
    return absl::OkStatus();
  }

  std::string client() const override {
    return QueueClient(service_->Owner(call_), call_.handler->peer());
  }

  void Computed(const absl::Status& status) override {
    absl::Status answer = status;
    if (answer.ok() && complete_) {
      try {
        answer = complete_();
      } catch (const std::bad_alloc&) {
        answer = AllocationFailed("build the answer");
      }
    }
    service_->Finish(call_, answer, response_);
  }

 private:
  const AttentionServiceImpl* const service_;
  const Call call_;
  google::protobuf::Message* const response_;
  const std::function<absl::Status()> complete_;
};

AttentionServiceImpl::AttentionServiceImpl(
    ServerMetrics* metrics, AttentionEngine* engine, Scheduler* scheduler,
    WeightsRegistry* registry, SessionStore* sessions, const CallGate* gate,
    MemoryBudget* budget, RequestChecks checks, TransportOptions transport,
    std::shared_ptr<BytesPool> pool, AccessLog* access_log)
    : metrics_(metrics),
      engine_(engine),
      registry_(registry),
      sessions_(sessions),
      gate_(gate),
      budget_(budget),
      checks_(checks),
      transport_(transport),
      pool_(std::move(pool)),
      compute_{metrics, engine, scheduler},
      watchdog_(transport_.message_timeout),
      stream_watchdog_(transport_.stream_idle_timeout),
      access_log_(access_log) {}

namespace {

// Why a unary call's request never arrived: its read fails when the call is
// cancelled, which the client's own deadline does at about the moment the
// server's copy passes (kDeadlineSlack).
absl::Status NotReceived(const grpc::ServerContextBase& context) {
  if (DeadlineWithin(context, kDeadlineSlack)) {
    return absl::DeadlineExceededError(
        "the deadline passed before the request arrived");
  }
  return absl::CancelledError("the call ended before its request arrived");
}

// What the access log says of each RPC's request and response (the response
// only once the call succeeded: a failed one's may be half filled).
void DescribeTiming(const v1::ServerTiming& timing, AccessRecord* record) {
  if (!record->status.ok()) return;
  record->queue_us = timing.queue_us();
  record->compute_us = timing.compute_us();
}

template <typename Request, typename Response>
void DescribeCall(const Request&, const Response&, AccessRecord*) {}

void DescribeCall(const v1::AttendRequest&, const v1::AttendResponse& response,
                  AccessRecord* record) {
  DescribeTiming(response.timing(), record);
}

void DescribeCall(const v1::MultiHeadAttentionRequest& request,
                  const v1::MultiHeadAttentionResponse& response,
                  AccessRecord* record) {
  record->weights = request.weights_name();
  record->weights_version = response.weights_version();
  DescribeTiming(response.timing(), record);
}

void DescribeCall(const v1::PutWeightsRequest& request,
                  const v1::PutWeightsResponse& response,
                  AccessRecord* record) {
  record->weights = request.name();
  if (record->status.ok()) record->weights_version = response.version();
}

void DescribeCall(const v1::DeleteWeightsRequest& request,
                  const v1::DeleteWeightsResponse&, AccessRecord* record) {
  record->weights = request.name();
}

void DescribeCall(const v1::CreateSessionRequest&,
                  const v1::CreateSessionResponse& response,
                  AccessRecord* record) {
  if (record->status.ok()) record->session = response.session().session_id();
}

// The first step's session; a decode batch names many.
void DescribeCall(const v1::StepRequest& request,
                  const v1::StepResponse& response, AccessRecord* record) {
  record->steps = request.steps_size();
  if (request.steps_size() > 0) record->session = request.steps(0).session_id();
  DescribeTiming(response.timing(), record);
}

void DescribeCall(const v1::ForkSessionRequest& request,
                  const v1::ForkSessionResponse& response,
                  AccessRecord* record) {
  record->session = request.session_id();
  if (record->status.ok()) {
    record->created_session = response.session().session_id();
  }
}

void DescribeCall(const v1::TruncateSessionRequest& request,
                  const v1::TruncateSessionResponse&, AccessRecord* record) {
  record->session = request.session_id();
}

void DescribeCall(const v1::DeleteSessionRequest& request,
                  const v1::DeleteSessionResponse&, AccessRecord* record) {
  record->session = request.session_id();
}

// A weight set's ModelInfer names the set (the model) and its version.
void DescribeCall(const inference::ModelInferRequest& request,
                  const inference::ModelInferResponse& response,
                  AccessRecord* record) {
  if (request.model_name() == oip::kSdpaModel) return;
  record->weights = request.model_name();
  if (record->status.ok() &&
      !absl::SimpleAtoi(response.model_version(), &record->weights_version)) {
    record->weights_version = 0;
  }
}

void DescribeCall(const v1::GetSessionRequest& request,
                  const v1::GetSessionResponse&, AccessRecord* record) {
  record->session = request.session_id();
}

}  // namespace

template <typename Request, typename Response>
class AttentionServiceImpl::WireCall final
    : public AttentionServiceImpl::UnaryCall {
 public:
  WireCall(AttentionServiceImpl* service, Rpc rpc,
           Handler<Request, Response> handler)
      : service_(service), rpc_(rpc), handler_(handler) {
    send_watchdog = &service_->watchdog_;
  }

  Request request;
  Response response;

  void Describe(AccessRecord* record) const override {
    DescribeCall(request, response, record);
  }

 private:
  // The gate is checked on the headers: a caller without the token, one
  // changing weight sets without an admin token, or one arriving while the
  // server drains, is answered before any of its message is read, so its
  // bytes are never buffered.
  // A refusal at the end of a drain is held by the gate (call_gate.h).
  void OnStart() override {
    const absl::Status admitted = service_->gate_->Admit(context());
    if (!admitted.ok()) {
      held_ = service_->gate_->HoldRefusal([this, admitted] {
        service_->Serve(rpc_, this, nullptr, admitted, handler_);
      });
      if (!held_) service_->Serve(rpc_, this, nullptr, admitted, handler_);
      return;
    }
    caller_admitted = true;
    if (rpc_ == Rpc::kPutWeights || rpc_ == Rpc::kDeleteWeights) {
      const absl::Status may_change =
          service_->gate_->AdmitWeightChange(context());
      if (!may_change.ok()) {
        return service_->Serve(rpc_, this, nullptr, may_change, handler_);
      }
    }
    ticket_ = service_->watchdog_.Watch(this);
    StartRead(&wire_request_);
  }

  void OnCancel() override {
    // A compute of this call's still queued is answered now, its place and
    // memory freed (a passed deadline cancels the call too).
    service_->compute_.scheduler->DropAbandoned();
    if (held_ && service_->gate_->Unhold(*held_)) {
      service_->Serve(rpc_, this, nullptr,
                      absl::CancelledError("the call was cancelled while the "
                                           "server was shutting down"),
                      handler_);
    }
  }

  // The message is held from here: it is charged to the budget, or dropped
  // at once with RESOURCE_EXHAUSTED if the budget has no room for it.
  void OnReadDone(bool ok) override {
    service_->watchdog_.Unwatch(ticket_);
    absl::Status admitted = absl::OkStatus();
    if (ok) {
      // Counted as received, before the budget or the inflation sees it.
      received_bytes = static_cast<int64_t>(wire_request_.Length());
      absl::StatusOr<MemoryBudget::Hold> taken = AdmitMessage(
          service_->transport_, *service_->budget_, peer(), &wire_request_);
      if (taken.ok()) {
        hold = *std::move(taken);
      } else {
        admitted = taken.status();
      }
    }
    service_->Serve(rpc_, this, ok ? &wire_request_ : nullptr, admitted,
                    handler_);
  }

  void OnDone() override {
    if (send_ticket) service_->watchdog_.Unwatch(*send_ticket);
    // An OK answer whose call then ended cancelled never reached its client
    // whole (it stopped reading, reset the call, or its deadline passed).
    if (answered_ok && cancelled()) {
      service_->metrics_->AnswerNotDelivered(*answered_ok);
    }
    GiveTensorBytes(&request, service_->pool_.get());
    GiveTensorBytes(&response, service_->pool_.get());
  }

  AttentionServiceImpl* const service_;
  const Rpc rpc_;
  const Handler<Request, Response> handler_;
  grpc::ByteBuffer wire_request_;
  TransferWatchdog::Ticket ticket_ = 0;
  std::optional<CallGate::Ticket> held_;  // Set in OnStart only.
};

template <typename Request, typename Response>
void AttentionServiceImpl::HandleMethod(CallLoop& loop, const char* method,
                                        Rpc rpc,
                                        Handler<Request, Response> handler) {
  HandleMethodOf(loop, v1::AttentionService::service_full_name(), method, rpc,
                 handler);
}

template <typename Request, typename Response>
void AttentionServiceImpl::HandleMethodOf(CallLoop& loop,
                                          const std::string& service,
                                          const char* method, Rpc rpc,
                                          Handler<Request, Response> handler) {
  loop.Handle(absl::StrCat("/", service, "/", method), [this, rpc, handler] {
    return std::make_unique<WireCall<Request, Response>>(this, rpc, handler);
  });
}

void AttentionServiceImpl::AddTo(CallLoop& loop) {
  HandleMethod(loop, "Attend", Rpc::kAttend,
               &AttentionServiceImpl::ServeAttend);
  HandleMethod(loop, "MultiHeadAttention", Rpc::kMultiHeadAttention,
               &AttentionServiceImpl::ServeMultiHeadAttention);
  HandleMethod(loop, "PutWeights", Rpc::kPutWeights,
               &AttentionServiceImpl::ServePutWeights);
  HandleMethod(loop, "ListWeights", Rpc::kListWeights,
               &AttentionServiceImpl::ServeListWeights);
  HandleMethod(loop, "DeleteWeights", Rpc::kDeleteWeights,
               &AttentionServiceImpl::ServeDeleteWeights);
  HandleMethod(loop, "CreateSession", Rpc::kCreateSession,
               &AttentionServiceImpl::ServeCreateSession);
  HandleMethod(loop, "Step", Rpc::kStep, &AttentionServiceImpl::ServeStep);
  HandleMethod(loop, "ForkSession", Rpc::kForkSession,
               &AttentionServiceImpl::ServeForkSession);
  HandleMethod(loop, "TruncateSession", Rpc::kTruncateSession,
               &AttentionServiceImpl::ServeTruncateSession);
  HandleMethod(loop, "DeleteSession", Rpc::kDeleteSession,
               &AttentionServiceImpl::ServeDeleteSession);
  HandleMethod(loop, "GetSession", Rpc::kGetSession,
               &AttentionServiceImpl::ServeGetSession);
  HandleMethod(loop, "ListSessions", Rpc::kListSessions,
               &AttentionServiceImpl::ServeListSessions);
  AddInferenceService(loop);
  loop.Handle(absl::StrCat("/", v1::AttentionService::service_full_name(),
                           "/AttendStream"),
              [this] {
                return MakeAttendStreamCall({compute_, gate_, budget_, checks_,
                                             transport_, &stream_watchdog_,
                                             access_log_, &open_streams_});
              });
}

template <typename Request, typename Response>
void AttentionServiceImpl::Serve(Rpc rpc, WireCall<Request, Response>* handler,
                                 grpc::ByteBuffer* wire_request,
                                 const absl::Status& admitted,
                                 Handler<Request, Response> serve) {
  const int64_t request_bytes = handler->received_bytes;
  metrics_->CallStarted(rpc, request_bytes);
  Call call{rpc, handler, absl::Now(), request_bytes, admitted, std::nullopt};
  // Refused by the gate (its token, a drain): no one's, whatever token it
  // carries.
  if (!handler->caller_admitted) call.identity.emplace();
  if (call.admitted.ok() && wire_request == nullptr) {
    call.admitted = NotReceived(handler->context());
  }
  if (call.admitted.ok()) {
    // The parse consumes the request's bytes, so that they are not held twice.
    call.admitted = ParseWire(wire_request, &handler->request, pool_.get());
  }
  if (!call.admitted.ok()) {
    return Finish(call, call.admitted, &handler->response);
  }
  (this->*serve)(call, handler->request, &handler->response);
}

void AttentionServiceImpl::Finish(const Call& call, const absl::Status& status,
                                  google::protobuf::Message* response) const {
  absl::Status answer = status;
  // The client's deadline is no later than the server's: past it, the client
  // has given up whether or not its cancel has arrived yet.
  if (answer.ok() &&
      (call.handler->cancelled() || DeadlinePassed(call.handler->context()))) {
    // Computed for a caller gone meanwhile (a batch, or a compute that ran to
    // its end): gRPC sends nothing now, so nothing is counted as sent.
    answer = DeadlineWithin(call.handler->context(), kDeadlineSlack)
                 ? absl::DeadlineExceededError(
                       "the deadline passed before the answer was sent (its "
                       "work was done)")
                 : absl::CancelledError(
                       "the call was cancelled before the answer was sent "
                       "(its work was done)");
  }
  if (answer.ok() && !IsComputeRpc(call.rpc)) {
    // An answer built here, not by a compute (whose memory the hold has
    // already): a ListSessions page may be max_message_bytes, held as the
    // message and on the wire until the client reads it.
    answer = call.handler->hold.Grow(
        2 * static_cast<int64_t>(response->ByteSizeLong()));
  }
  grpc::ByteBuffer* wire_response = &call.handler->wire_response;
  if (answer.ok()) answer = SerializeWire(response, wire_response, pool_);
  if (!answer.ok() && response != nullptr) {
    // Freed now, not with the call (which may wait on its client): Clear()
    // would keep a repeated field's entries for reuse.
    const std::unique_ptr<google::protobuf::Message> empty(response->New());
    response->GetReflection()->Swap(response, empty.get());
  }
  const absl::Time now = absl::Now();
  const int64_t response_bytes =
      answer.ok() ? static_cast<int64_t>(wire_response->Length()) : 0;
  metrics_->CallFinished(call.rpc, answer.code(), now - call.started,
                         response_bytes);
  if (call.handler->on_finish) call.handler->on_finish(answer);
  if (answer.ok()) call.handler->answered_ok = call.rpc;
  metrics_->SetBufferPoolBytes(pool_->held_bytes());
  if (access_log_ != nullptr) {
    AccessRecord record;
    record.time = now;
    record.rpc = RpcName(call.rpc);
    record.status = answer;
    record.peer = call.handler->peer();
    record.identity = Owner(call);
    record.request_bytes = call.request_bytes;
    record.response_bytes = response_bytes;
    record.server = now - call.started;
    call.handler->Describe(&record);
    if (answer.ok() && call.handler->computed) {
      record.queue_us = call.handler->computed->queue_us();
      record.compute_us = call.handler->computed->compute_us();
    }
    access_log_->Write(record);
  }
  AddStatusTrailers(answer, call.handler->context());
  call.handler->Answer(ToGrpcStatus(answer));
}

RequestChecks AttentionServiceImpl::ChecksFor(
    bool answer_carries_output) const {
  RequestChecks checks = checks_;
  checks.response_carries_output = answer_carries_output;
  return checks;
}

void AttentionServiceImpl::ServeAttend(const Call& call,
                                       const v1::AttendRequest& request,
                                       v1::AttendResponse* response) {
  StartAttend(call, request, response,
              std::make_shared<UnaryCaller>(this, call, response));
}

void AttentionServiceImpl::StartAttend(const Call& call,
                                       const v1::AttendRequest& request,
                                       v1::AttendResponse* response,
                                       std::shared_ptr<ComputeCaller> caller,
                                       bool answer_carries_output) {
  absl::StatusOr<AttendWork> work =
      ValidateAttendRequest(request, ChecksFor(answer_carries_output));
  if (!work.ok()) return caller->Computed(work.status());
  const absl::Status held = HoldComputeMemory(call, work->memory_bytes);
  if (!held.ok()) return caller->Computed(held);
  SeedOutput(work->shape.OutputElements(), work->plan.output_dtype,
             response->mutable_output());
  ComputeJob::Submit(
      ComputeJob::ForAttend(compute_, call.rpc, std::move(caller), call.started,
                            *std::move(work), &request, response));
}

void AttentionServiceImpl::ServeMultiHeadAttention(
    const Call& call, const v1::MultiHeadAttentionRequest& request,
    v1::MultiHeadAttentionResponse* response) {
  StartMultiHeadAttention(call, request, response,
                          std::make_shared<UnaryCaller>(this, call, response));
}

void AttentionServiceImpl::StartMultiHeadAttention(
    const Call& call, const v1::MultiHeadAttentionRequest& request,
    v1::MultiHeadAttentionResponse* response,
    std::shared_ptr<ComputeCaller> caller, bool answer_carries_output) {
  absl::StatusOr<MultiHeadWeights> weights =
      ResolveMultiHeadWeights(request, *registry_);
  if (!weights.ok()) return caller->Computed(weights.status());
  if (weights->registered != nullptr) {
    response->set_weights_version(weights->version);
  }
  const std::shared_ptr<const WeightSet> registered = weights->registered;
  absl::StatusOr<MultiHeadWork> work =
      ValidateMultiHeadRequest(request, weights->shape, weights->origin,
                               ChecksFor(answer_carries_output));
  if (!work.ok()) return caller->Computed(work.status());
  const absl::Status held = HoldComputeMemory(call, work->memory_bytes);
  if (!held.ok()) return caller->Computed(held);
  const double flops = MultiHeadFlops(
      work->shape.Heads().Dims(), work->shape.Projections(),
      work->plan.options.causal,
      work->plan.options.causal_alignment == CausalAlignment::kBottomRight);
  SeedOutput(work->shape.batch * work->shape.query_len * work->shape.embed_dim,
             work->plan.output_dtype, response->mutable_output());
  auto compute = [this, request = &request, response, registered,
                  work = *std::move(work)](const StopCheck& stop, double*) {
    if (registered != nullptr) {
      return ComputeMultiHead(*engine_, work, registered->views(), *request,
                              stop, response);
    }
    const WeightViews inline_weights(request->weights());
    return ComputeMultiHead(*engine_, work, inline_weights.views(), *request,
                            stop, response);
  };
  ComputeJob::Submit(
      ComputeJob::Alone(compute_, call.rpc, std::move(caller), call.started,
                        flops, response->mutable_timing(), std::move(compute)));
}

void AttentionServiceImpl::ServePutWeights(
    const Call& call, const v1::PutWeightsRequest& /*request*/,
    v1::PutWeightsResponse* response) {
  // The handler owns the request: its tensors' bytes are freed as the set is
  // built, so that the two are held together for one tensor, not the set.
  v1::PutWeightsRequest& request =
      static_cast<WireCall<v1::PutWeightsRequest, v1::PutWeightsResponse>*>(
          call.handler)
          ->request;
  absl::StatusOr<v1::PutWeightsResponse> result =
      PutWeightsInto(*registry_, &request);
  if (result.ok()) *response = *std::move(result);
  RecordWeightsHeld();
  return Finish(call, result.status(), response);
}

void AttentionServiceImpl::ServeListWeights(
    const Call& call, const v1::ListWeightsRequest& request,
    v1::ListWeightsResponse* response) {
  return Finish(call,
                ListWeightsPage(*registry_, request,
                                transport_.max_message_bytes, response),
                response);
}

void AttentionServiceImpl::ServeDeleteWeights(
    const Call& call, const v1::DeleteWeightsRequest& request,
    v1::DeleteWeightsResponse* response) {
  const absl::Status valid = ValidateWeightsName("name", request.name());
  if (!valid.ok()) return Finish(call, valid, response);
  absl::StatusOr<WeightsRegistry::Entry> entry =
      registry_->Delete(request.name());
  if (entry.ok()) {
    *response->mutable_deleted() = DescribeWeights(request.name(), *entry);
  }
  RecordWeightsHeld();
  return Finish(call, entry.status(), response);
}

const std::string& AttentionServiceImpl::Owner(const Call& call) const {
  if (!call.identity) call.identity = gate_->Identity(call.handler->context());
  return *call.identity;
}

void AttentionServiceImpl::ServeCreateSession(
    const Call& call, const v1::CreateSessionRequest& request,
    v1::CreateSessionResponse* response) {
  absl::StatusOr<SessionConfig> config =
      ValidateCreateSession(request, sessions_->options());
  if (!config.ok()) return Finish(call, config.status(), response);
  absl::StatusOr<SessionDescription> created =
      sessions_->Create(Owner(call), *config, request.session_id());
  if (created.ok()) {
    DescribeSession(*created, response->mutable_session());
    DescribeReplica(sessions_->replica(), response->mutable_replica());
  }
  return Finish(call, created.status(), response);
}

void AttentionServiceImpl::ServeStep(const Call& call,
                                     const v1::StepRequest& request,
                                     v1::StepResponse* response) {
  const StepLimits limits{checks_.limits.max_elements,
                          checks_.limits.max_request_memory_bytes,
                          checks_.max_message_bytes};
  absl::StatusOr<StepCall> steps = PrepareSteps(
      request, Owner(call), *sessions_, *engine_, limits, response);
  if (!steps.ok()) {
    response->Clear();
    return Finish(call, steps.status(), response);
  }
  metrics_->StepsPerCall(request.steps_size());
  DescribeReplica(sessions_->replica(), response->mutable_replica());
  const absl::Status held = HoldComputeMemory(call, steps->memory_bytes);
  if (!held.ok()) {
    response->Clear();
    return Finish(call, held, response);
  }
  const double flops = steps->flops;
  auto compute = [this, response, steps = *std::move(steps)](
                     const StopCheck& stop, double* done) mutable {
    const absl::Status status =
        RunSteps(steps, *sessions_, *engine_, stop, response);
    *done = steps.flops;  // Of the steps that computed.
    return status;
  };
  ComputeJob::Submit(ComputeJob::Alone(
      compute_, call.rpc, std::make_shared<UnaryCaller>(this, call, response),
      call.started, flops, response->mutable_timing(), std::move(compute)));
}

absl::Status AttentionServiceImpl::SameIncarnation(
    absl::string_view requested) const {
  return CheckReplicaIncarnation(requested, sessions_->replica(),
                                 "the session is");
}

void AttentionServiceImpl::ServeForkSession(
    const Call& call, const v1::ForkSessionRequest& request,
    v1::ForkSessionResponse* response) {
  absl::StatusOr<ForkPlan> plan =
      ValidateForkSession(request, sessions_->options());
  if (!plan.ok()) return Finish(call, plan.status(), response);
  if (absl::Status same = SameIncarnation(request.replica_incarnation());
      !same.ok()) {
    return Finish(call, same, response);
  }
  absl::StatusOr<SessionDescription> forked = sessions_->Fork(
      Owner(call), request.session_id(), plan->length, plan->ttl);
  if (forked.ok()) {
    DescribeSession(*forked, response->mutable_session());
    DescribeReplica(sessions_->replica(), response->mutable_replica());
  }
  return Finish(call, forked.status(), response);
}

void AttentionServiceImpl::ServeTruncateSession(
    const Call& call, const v1::TruncateSessionRequest& request,
    v1::TruncateSessionResponse* response) {
  absl::Status valid = ValidateTruncateSession(request);
  if (valid.ok()) valid = SameIncarnation(request.replica_incarnation());
  if (!valid.ok()) return Finish(call, valid, response);
  absl::StatusOr<SessionDescription> truncated =
      sessions_->Truncate(Owner(call), request.session_id(), request.length());
  if (truncated.ok()) DescribeSession(*truncated, response->mutable_session());
  return Finish(call, truncated.status(), response);
}

void AttentionServiceImpl::ServeDeleteSession(
    const Call& call, const v1::DeleteSessionRequest& request,
    v1::DeleteSessionResponse* response) {
  absl::Status valid = ValidateSessionId("session_id", request.session_id());
  if (valid.ok()) valid = SameIncarnation(request.replica_incarnation());
  if (!valid.ok()) return Finish(call, valid, response);
  absl::StatusOr<SessionDescription> deleted =
      sessions_->Delete(Owner(call), request.session_id());
  if (deleted.ok()) DescribeSession(*deleted, response->mutable_deleted());
  return Finish(call, deleted.status(), response);
}

void AttentionServiceImpl::ServeGetSession(const Call& call,
                                           const v1::GetSessionRequest& request,
                                           v1::GetSessionResponse* response) {
  absl::Status valid = ValidateSessionId("session_id", request.session_id());
  if (valid.ok()) valid = SameIncarnation(request.replica_incarnation());
  if (!valid.ok()) return Finish(call, valid, response);
  absl::StatusOr<SessionDescription> got =
      sessions_->Get(Owner(call), request.session_id());
  if (got.ok()) {
    DescribeSession(*got, response->mutable_session());
    DescribeReplica(sessions_->replica(), response->mutable_replica());
  }
  return Finish(call, got.status(), response);
}

void AttentionServiceImpl::ServeListSessions(
    const Call& call, const v1::ListSessionsRequest& request,
    v1::ListSessionsResponse* response) {
  const absl::Status listed = ListSessionsPage(
      *sessions_, Owner(call), request, transport_.max_message_bytes, response);
  const SessionOptions& options = sessions_->options();
  response->set_budget_bytes(options.kv_cache_bytes);
  response->set_identity_budget_bytes(options.kv_cache_bytes_per_identity);
  response->set_identity_max_sessions(options.max_sessions_per_identity);
  return Finish(call, listed, response);
}

void AttentionServiceImpl::SeedOutput(int64_t elements, v1::DType dtype,
                                      v1::Tensor* output) const {
  const size_t bytes =
      static_cast<size_t>(elements) * static_cast<size_t>(DTypeBytes(dtype));
  if (bytes < pool_->min_bytes()) return;
  try {
    *output->mutable_data() = pool_->Take(bytes);
  } catch (const std::bad_alloc&) {
    // Unseeded, the compute allocates the output itself, where a failure is
    // answered.
  }
}

void AttentionServiceImpl::RecordWeightsHeld() const {
  const WeightsRegistry::Listing listing = registry_->List("", 0);
  metrics_->SetWeightsHeld(listing.total_sets, listing.total_bytes);
}

// ---- inference.GRPCInferenceService: the Open Inference Protocol ----------

void AttentionServiceImpl::AddInferenceService(CallLoop& loop) {
  const std::string service =
      inference::GRPCInferenceService::service_full_name();
  HandleMethodOf(loop, service, "ServerLive", Rpc::kServerLive,
                 &AttentionServiceImpl::ServeServerLive);
  HandleMethodOf(loop, service, "ServerReady", Rpc::kServerReady,
                 &AttentionServiceImpl::ServeServerReady);
  HandleMethodOf(loop, service, "ModelReady", Rpc::kModelReady,
                 &AttentionServiceImpl::ServeModelReady);
  HandleMethodOf(loop, service, "ServerMetadata", Rpc::kServerMetadata,
                 &AttentionServiceImpl::ServeServerMetadata);
  HandleMethodOf(loop, service, "ModelMetadata", Rpc::kModelMetadata,
                 &AttentionServiceImpl::ServeModelMetadata);
  HandleMethodOf(loop, service, "ModelConfig", Rpc::kModelConfig,
                 &AttentionServiceImpl::ServeModelConfig);
  HandleMethodOf(loop, service, "ModelStatistics", Rpc::kModelStatistics,
                 &AttentionServiceImpl::ServeModelStatistics);
  HandleMethodOf(loop, service, "ModelInfer", Rpc::kModelInfer,
                 &AttentionServiceImpl::ServeModelInfer);
}

void AttentionServiceImpl::ServeServerLive(
    const Call& call, const inference::ServerLiveRequest& /*request*/,
    inference::ServerLiveResponse* response) {
  response->set_live(true);
  Finish(call, absl::OkStatus(), response);
}

// Ready until the drain starts (Triton's, too, is not ready while it stops);
// once the grace period ends the gate refuses the call itself.
void AttentionServiceImpl::ServeServerReady(
    const Call& call, const inference::ServerReadyRequest& /*request*/,
    inference::ServerReadyResponse* response) {
  response->set_ready(ready_.load());
  Finish(call, absl::OkStatus(), response);
}

absl::StatusOr<std::optional<WeightsRegistry::Entry>>
AttentionServiceImpl::FindModel(const std::string& name,
                                const std::string& version) const {
  if (name == oip::kSdpaModel) {
    if (!version.empty() && version != oip::kSdpaVersion) {
      return absl::NotFoundError(absl::StrCat("model sdpa has version ",
                                              oip::kSdpaVersion, ", not ",
                                              EchoText(version)));
    }
    return std::nullopt;
  }
  absl::StatusOr<WeightsRegistry::Entry> entry = registry_->Get(name);
  if (!entry.ok()) {
    return absl::NotFoundError(absl::StrCat(
        "no model named ", EchoText(name), ": the models are ", oip::kSdpaModel,
        " and the registered weight sets (ListWeights)"));
  }
  if (!version.empty() && version != absl::StrCat(entry->version)) {
    return absl::NotFoundError(absl::StrCat("model ", name, " has version ",
                                            entry->version, ", not ",
                                            EchoText(version)));
  }
  return *entry;
}

void AttentionServiceImpl::ServeModelReady(
    const Call& call, const inference::ModelReadyRequest& request,
    inference::ModelReadyResponse* response) {
  response->set_ready(ready_.load() &&
                      FindModel(request.name(), request.version()).ok());
  Finish(call, absl::OkStatus(), response);
}

void AttentionServiceImpl::ServeServerMetadata(
    const Call& call, const inference::ServerMetadataRequest& /*request*/,
    inference::ServerMetadataResponse* response) {
  response->set_name("attnserve");
  response->set_version(ATTNSERVE_VERSION);
  response->add_extensions("model_configuration");
  response->add_extensions("statistics");
  Finish(call, absl::OkStatus(), response);
}

void AttentionServiceImpl::ServeModelMetadata(
    const Call& call, const inference::ModelMetadataRequest& request,
    inference::ModelMetadataResponse* response) {
  absl::StatusOr<std::optional<WeightsRegistry::Entry>> model =
      FindModel(request.name(), request.version());
  if (!model.ok()) return Finish(call, model.status(), response);
  *response = *model ? oip::WeightSetMetadata(request.name(), (*model)->version,
                                              (*model)->weights->shape())
                     : oip::SdpaMetadata();
  Finish(call, absl::OkStatus(), response);
}

void AttentionServiceImpl::ServeModelConfig(
    const Call& call, const inference::ModelConfigRequest& request,
    inference::ModelConfigResponse* response) {
  absl::StatusOr<std::optional<WeightsRegistry::Entry>> model =
      FindModel(request.name(), request.version());
  if (!model.ok()) return Finish(call, model.status(), response);
  *response->mutable_config() =
      *model ? oip::WeightSetConfig(request.name(), (*model)->weights->shape())
             : oip::SdpaConfig();
  Finish(call, absl::OkStatus(), response);
}

// Every model (sdpa and each registered set at its version), or the one named.
void AttentionServiceImpl::ServeModelStatistics(
    const Call& call, const inference::ModelStatisticsRequest& request,
    inference::ModelStatisticsResponse* response) {
  const auto wanted = [&request](const std::string& name,
                                 const std::string& version) {
    return (request.name().empty() || request.name() == name) &&
           (request.version().empty() || request.version() == version);
  };
  if (wanted(oip::kSdpaModel, oip::kSdpaVersion)) {
    *response->add_model_stats() =
        inference_statistics_.Of(oip::kSdpaModel, oip::kSdpaVersion);
  }
  // The registry a page at a time; the protocol has no pages, so an answer
  // past the message limit is refused rather than built whole.
  // Room kept for the message's framing, as in the listings' pages.
  constexpr int64_t kFramingBytes = 256;
  std::string after;
  int64_t bytes = static_cast<int64_t>(response->ByteSizeLong());
  for (bool more = true; more;) {
    const WeightsRegistry::Listing listing =
        registry_->List(after, kMaxWeightsPage);
    more = listing.more;
    for (const auto& [name, entry] : listing.entries) {
      after = name;
      const std::string version = absl::StrCat(entry.version);
      // A set named as the built-in model is not one of the protocol's models
      // (the built-in answers to its name).
      if (name == oip::kSdpaModel || !wanted(name, version)) continue;
      *response->add_model_stats() = inference_statistics_.Of(name, version);
      bytes += static_cast<int64_t>(
                   response->model_stats(response->model_stats_size() - 1)
                       .ByteSizeLong()) +
               8;
      if (bytes > transport_.max_message_bytes - kFramingBytes) {
        return Finish(
            call,
            Permanent(absl::ResourceExhaustedError(absl::StrCat(
                "the statistics of every model take more than the ",
                "max_message_bytes limit of ", transport_.max_message_bytes,
                " bytes; ask for one model by name (ListWeights lists them)"))),
            response);
      }
    }
  }
  if (!request.name().empty() && response->model_stats_size() == 0) {
    return Finish(call, FindModel(request.name(), request.version()).status(),
                  response);
  }
  Finish(call, absl::OkStatus(), response);
}

// Translated into the native request (its bytes moved, not copied), computed
// on the native path, translated back; counted per model for ModelStatistics.
void AttentionServiceImpl::ServeModelInfer(
    const Call& call, const inference::ModelInferRequest& /*request*/,
    inference::ModelInferResponse* response) {
  // The handler owns the request; its bytes move into the native request.
  inference::ModelInferRequest& request =
      static_cast<WireCall<inference::ModelInferRequest,
                           inference::ModelInferResponse>*>(call.handler)
          ->request;
  const bool weight_set = request.model_name() != oip::kSdpaModel;
  // The native request and answer, until the compute is done; their tensors'
  // bytes (the request's, moved from raw_input_contents) go back to the pool.
  struct Native {
    explicit Native(BytesPool* bytes_pool) : pool(bytes_pool) {}
    ~Native() {
      GiveTensorBytes(&attend, pool);
      GiveTensorBytes(&attended, pool);
      GiveTensorBytes(&mha, pool);
      GiveTensorBytes(&mha_answer, pool);
    }
    BytesPool* const pool;
    oip::RequestedOutputs outputs;
    std::string version;
    v1::AttendRequest attend;
    v1::AttendResponse attended;
    v1::MultiHeadAttentionRequest mha;
    v1::MultiHeadAttentionResponse mha_answer;
  };
  auto native = std::make_shared<Native>(pool_.get());
  absl::StatusOr<std::optional<WeightsRegistry::Entry>> model =
      FindModel(request.model_name(), request.model_version());
  if (!model.ok()) {
    return Finish(call, model.status(), response);  // Not a model: uncounted.
  }
  native->version =
      *model ? absl::StrCat((*model)->version) : std::string(oip::kSdpaVersion);
  // The protocol's statistics take the call's final status, once answered
  // (a call cancelled meanwhile fails): the version computed and the
  // timing, once known.
  struct Statistics {
    std::string version;
    int64_t queue_us = 0;
    int64_t compute_us = 0;
  };
  auto statistics = std::make_shared<Statistics>();
  statistics->version = native->version;
  call.handler->on_finish = [this, model_name = request.model_name(),
                             statistics, started = call.started](
                                const absl::Status& final) {
    const absl::Time now = absl::Now();
    inference_statistics_.Record(model_name, statistics->version, final.ok(),
                                 now - started, statistics->queue_us,
                                 statistics->compute_us, now);
  };
  // Once computed: the answer's tensors move into the protocol's response.
  auto complete = [&request, response, native, weight_set, statistics,
                   handler = call.handler]() {
    v1::Tensor* output = weight_set ? native->mha_answer.mutable_output()
                                    : native->attended.mutable_output();
    v1::Tensor* lse = weight_set ? native->mha_answer.mutable_lse()
                                 : native->attended.mutable_lse();
    v1::Tensor* weights = weight_set ? native->mha_answer.mutable_weights()
                                     : native->attended.mutable_weights();
    const v1::ServerTiming& timing =
        weight_set ? native->mha_answer.timing() : native->attended.timing();
    // The version computed, which a set put again since the lookup moved on.
    if (weight_set) {
      native->version = absl::StrCat(native->mha_answer.weights_version());
    }
    statistics->version = native->version;
    statistics->queue_us = timing.queue_us();
    statistics->compute_us = timing.compute_us();
    handler->computed = timing;
    oip::FillInferResponse(request, native->version, native->outputs, output,
                           lse, weights, response);
    return absl::OkStatus();
  };
  // A refusal, of the translation or on the native path, is counted and named
  // as the protocol names its inputs.
  class InferCaller final : public ComputeCaller {
   public:
    InferCaller(std::shared_ptr<UnaryCaller> unary, bool weight_set)
        : unary_(std::move(unary)), weight_set_(weight_set) {}
    absl::Status StillWanted() const override { return unary_->StillWanted(); }
    std::string client() const override { return unary_->client(); }
    void Computed(const absl::Status& status) override {
      unary_->Computed(oip::InProtocolNames(status, weight_set_));
    }

   private:
    const std::shared_ptr<UnaryCaller> unary_;
    const bool weight_set_;
  };
  auto caller = std::make_shared<InferCaller>(
      std::make_shared<UnaryCaller>(this, call, response, std::move(complete)),
      weight_set);
  // The packed copy of typed contents is charged as the message was.
  if (const int64_t typed_bytes = oip::TypedContentsBytes(request);
      typed_bytes > 0) {
    const absl::Status held = call.handler->hold.Grow(typed_bytes);
    if (!held.ok()) return caller->Computed(held);
  }
  // The translation packs typed contents into tensors: a copy of the inputs.
  absl::Status translated;
  try {
    if (weight_set) {
      absl::StatusOr<v1::MultiHeadAttentionRequest> mha =
          oip::MultiHeadRequestFrom(request, &native->outputs);
      translated = mha.status();
      if (mha.ok()) native->mha = *std::move(mha);
    } else {
      absl::StatusOr<v1::AttendRequest> attend =
          oip::AttendRequestFrom(request, &native->outputs);
      translated = attend.status();
      if (attend.ok()) native->attend = *std::move(attend);
    }
  } catch (const std::bad_alloc&) {
    translated = AllocationFailed("translate the inputs");
  }
  if (!translated.ok()) return caller->Computed(translated);
  if (weight_set) {
    return StartMultiHeadAttention(call, native->mha, &native->mha_answer,
                                   std::move(caller), native->outputs.output);
  }
  StartAttend(call, native->attend, &native->attended, std::move(caller),
              native->outputs.output);
}

}  // namespace attnserve
