// libFuzzer target: raw protobuf bytes through the server's request path.
//
// The input (fuzz_requests.h) is parsed as an AttendRequest,
// MultiHeadAttentionRequest, PutWeightsRequest, CreateSessionRequest,
// StepRequest or the Open Inference Protocol's ModelInferRequest (translated
// to the native Attend or MultiHeadAttention request by oip/, then as those)
// as the service parses it (ParseWire on a grpc::ByteBuffer) and
// taken through exactly what the service does before its compute:
// ValidateAttendRequest (and the batch key), the weights name and registry
// lookup or ValidateProjectionWeights, then ValidateMultiHeadRequest, or
// PutWeightsInto, or ValidateCreateSession and the store's Create, or
// PrepareSteps against a store holding one tiny session. A request that
// validates is then converted and computed (ComputeAttend, ComputeAttendBatch,
// ComputeMultiHead, RunSteps) when it is tiny. Besides the sanitizers'
// findings, it traps when
//   - validation fails with a code other than INVALID_ARGUMENT, NOT_FOUND or
//     RESOURCE_EXHAUSTED, or with an empty message (INTERNAL is never the
//     answer to bad input);
//   - a request that validated fails in its compute (the validator let through
//     something the engine refuses);
//   - a response tensor's bytes do not match its shape and dtype;
//   - a step's result is neither an error (with a code a caller can act on
//     and a message) nor a length, with the output its query asked for;
//   - the store holds more page bytes than its budget.
// With ATTNSERVE_FUZZ_VERBOSE set it prints what became of each input (to see
// what a corpus reaches: build-fuzz/fuzz/request_fuzzer -runs=0 CORPUS).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "attnserve/common/flops.h"
#include "attnserve/core/attention_engine.h"
#include "attnserve/proto/tensors.h"
#include "attnserve/server/attention/attend_batch.h"
#include "attnserve/server/attention/attention_compute.h"
#include "attnserve/server/attention/request_validator.h"
#include "attnserve/server/oip/inference_models.h"
#include "attnserve/server/rpc/wire_messages.h"
#include "attnserve/server/sessions/session_requests.h"
#include "attnserve/server/sessions/session_steps.h"
#include "attnserve/server/sessions/session_store.h"
#include "attnserve/server/tensors/tensor_codec.h"
#include "attnserve/server/weights/weights_loader.h"
#include "attnserve/server/weights/weights_registry.h"
#include "fuzz_requests.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace attnserve::fuzz {
namespace {

// Small enough that anything that validates computes in about a millisecond.
constexpr double kMaxComputeFlops = double{1 << 22};
constexpr int64_t kMaxWeightsBytes = int64_t{1} << 20;

// Small enough that inputs of a few KiB reach every limit.
constexpr int64_t kMaxMessageBytes = int64_t{64} << 10;
constexpr int64_t kMaxWorkspaceBytes = int64_t{256} << 10;
RequestLimits FuzzLimits() {
  RequestLimits limits;
  limits.max_elements = 1024;
  limits.max_request_memory_bytes = int64_t{1} << 20;
  return limits;
}

void Note(const char* what, const absl::Status& status) {
  static const bool verbose = std::getenv("ATTNSERVE_FUZZ_VERBOSE") != nullptr;
  if (verbose) {
    std::fprintf(stderr, "request_fuzzer: %s: %s\n", what,
                 status.ToString().substr(0, 200).c_str());
  }
}

void Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "request_fuzzer: %s: %s\n", what,
               status.ToString().c_str());
  __builtin_trap();
}

void Require(const char* what, const absl::Status& status) {
  if (!status.ok()) Fail(what, status);
}

// A refusal must be one a caller can act on, and say why.
void CheckRefusal(const absl::Status& status) {
  Note("refused", status);
  const absl::StatusCode code = status.code();
  // FAILED_PRECONDITION: a weights_version the registry does not hold.
  if (code != absl::StatusCode::kInvalidArgument &&
      code != absl::StatusCode::kNotFound &&
      code != absl::StatusCode::kResourceExhausted &&
      code != absl::StatusCode::kFailedPrecondition) {
    Fail("a malformed request got an unexpected code", status);
  }
  if (status.message().empty()) Fail("a refusal without a message", status);
}

void CheckResponseTensor(const char* field, const v1::Tensor& tensor) {
  int64_t elements = 1;
  for (int64_t dim : tensor.shape()) elements *= dim;
  if (static_cast<int64_t>(tensor.data().size()) !=
      elements * DTypeBytes(tensor.dtype())) {
    Fail(field, absl::InternalError("data does not match shape and dtype"));
  }
}

template <typename Response>
void CheckResponse(const Response& response) {
  CheckResponseTensor("output", response.output());
  if (response.has_weights())
    CheckResponseTensor("weights", response.weights());
  if (response.has_lse()) CheckResponseTensor("lse", response.lse());
}

// What every input shares: the engine and the registered weights, which no
// input changes (PutWeights goes to a registry of its own).
struct Fixture {
  std::unique_ptr<AttentionEngine> engine;
  WeightsRegistry registry{kMaxWeightsBytes};

  Fixture() {
    EngineOptions options;
    options.num_threads = 1;
    options.max_workspace_bytes = kMaxWorkspaceBytes;
    absl::StatusOr<std::unique_ptr<AttentionEngine>> created =
        AttentionEngine::Create(options);
    Require("AttentionEngine::Create", created.status());
    engine = *std::move(created);
    Require("PutWeights demo",
            PutWeightsInto(registry, DemoWeights()).status());
    Require("PutWeights tiny",
            PutWeightsInto(registry, TinyWeights()).status());
    checks = {FuzzLimits(), kMaxMessageBytes, engine.get()};
  }

  // What the service checks requests against, with the engine above.
  RequestChecks checks;
};

Fixture& TheFixture() {
  static Fixture* const fixture = new Fixture();
  return *fixture;
}

// `message`'s bytes with map entries sorted (ModelInferRequest's parameters),
// so that equal messages serialise alike.
std::string Deterministic(const google::protobuf::Message& message) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    message.SerializeToCodedStream(&coded);
  }
  return bytes;
}

// Parses `size` bytes at `data` as the service parses a request's bytes, into
// strings from a pool (one of its own, holding a few strings of any size, so
// that the fuzzer's small tensors take that path too and every input frees
// what it allocates, as libFuzzer's leak check wants); false, with the refusal
// checked, if they are not a valid `Request`. The parse must agree with
// protobuf's own.
template <typename Request>
bool Parse(const uint8_t* data, size_t size, Request* request) {
  BytesPool pool(int64_t{1} << 20, 1);
  for (const size_t capacity : {size_t{16}, size_t{200}, size_t{4096}}) {
    std::string kept;
    kept.reserve(capacity);
    pool.Give(std::move(kept));
  }
  grpc::Slice slice(data, size);
  grpc::ByteBuffer wire(&slice, 1);
  const absl::Status parsed = ParseWire(&wire, request, &pool);
  Request plain;
  const bool plain_parsed = plain.ParseFromArray(data, static_cast<int>(size));
  if (parsed.ok() != plain_parsed ||
      (parsed.ok() && Deterministic(*request) != Deterministic(plain))) {
    Fail("the pooled parse disagrees with protobuf's", parsed);
  }
  if (!parsed.ok()) CheckRefusal(parsed);
  return parsed.ok();
}

void FuzzAttend(const v1::AttendRequest& request) {
  const absl::StatusOr<AttendWork> work =
      ValidateAttendRequest(request, TheFixture().checks);
  if (!work.ok()) return CheckRefusal(work.status());
  const std::string batch_key =
      AttendBatchKey(*TheFixture().engine, request, *work);
  if (AttentionFlops(work->shape.Dims(), work->plan.options.causal) >
      kMaxComputeFlops) {
    return Note("valid, too large to compute", absl::OkStatus());
  }
  Fixture& fixture = TheFixture();
  v1::AttendResponse response;
  Require(
      "ComputeAttend of a validated request",
      ComputeAttend(*fixture.engine, *work, request, StopCheck(), &response));
  CheckResponse(response);
  Note("Attend computed", absl::OkStatus());
  if (batch_key.empty()) return;
  // The scheduler may batch a request with others of its key: here, itself.
  v1::AttendResponse batched[2];
  const AttendBatchItem items[] = {{&*work, &request, &batched[0]},
                                   {&*work, &request, &batched[1]}};
  Require("ComputeAttendBatch of a validated request",
          ComputeAttendBatch(*fixture.engine, items));
  for (const v1::AttendResponse& one : batched) CheckResponse(one);
}

// As AttentionServiceImpl::MultiHeadAttention, less the scheduler.
void FuzzMultiHead(const v1::MultiHeadAttentionRequest& request) {
  Fixture& fixture = TheFixture();
  if (request.weights_source_case() ==
      v1::MultiHeadAttentionRequest::WEIGHTS_SOURCE_NOT_SET) {
    return;  // The service refuses it before any check.
  }
  const absl::StatusOr<MultiHeadWeights> weights =
      ResolveMultiHeadWeights(request, fixture.registry);
  if (!weights.ok()) return CheckRefusal(weights.status());
  const std::shared_ptr<const WeightSet> registered = weights->registered;
  const absl::StatusOr<MultiHeadWork> work = ValidateMultiHeadRequest(
      request, weights->shape, weights->origin, TheFixture().checks);
  if (!work.ok()) return CheckRefusal(work.status());
  if (MultiHeadFlops(work->shape.Heads().Dims(), work->shape.Projections(),
                     work->plan.options.causal) > kMaxComputeFlops) {
    return Note("valid, too large to compute", absl::OkStatus());
  }
  v1::MultiHeadAttentionResponse response;
  if (registered != nullptr) {
    Require("ComputeMultiHead with registered weights",
            ComputeMultiHead(*fixture.engine, *work, registered->views(),
                             request, StopCheck(), &response));
  } else {
    const WeightViews inline_weights(request.weights());
    Require("ComputeMultiHead with inline weights",
            ComputeMultiHead(*fixture.engine, *work, inline_weights.views(),
                             request, StopCheck(), &response));
  }
  CheckResponse(response);
  Note("MultiHeadAttention computed", absl::OkStatus());
}

// A store as small as the limits above: inputs of a few KiB reach its budget
// and every limit.
SessionOptions FuzzSessionOptions() {
  SessionOptions options;
  options.kv_cache_bytes = 16 << 10;
  options.page_tokens = 4;
  options.max_sessions = 4;
  options.max_session_tokens = 64;
  options.max_session_layers = 4;
  options.max_steps_per_call = 8;
  options.max_page_bytes = 4 << 10;
  return options;
}

void FuzzCreateSession(const v1::CreateSessionRequest& request) {
  SessionStore store(FuzzSessionOptions(), nullptr);
  const absl::StatusOr<SessionConfig> config =
      ValidateCreateSession(request, store.options());
  if (!config.ok()) return CheckRefusal(config.status());
  const absl::StatusOr<SessionDescription> created =
      store.Create("", *config, request.session_id());
  Require("Create of a validated session", created.status());
  v1::SessionInfo info;
  DescribeSession(*created, &info);
  if (info.num_layers() != request.num_layers() ||
      info.lengths_size() != request.num_layers()) {
    Fail("DescribeSession", absl::InternalError("layers differ"));
  }
  if (!request.session_id().empty() &&
      info.session_id() != request.session_id()) {
    Fail("Create", absl::InternalError("the caller's session_id was not used"));
  }
  // The same id again is taken.
  const absl::StatusOr<SessionDescription> again =
      store.Create("", *config, info.session_id());
  if (!absl::IsAlreadyExists(again.status())) {
    Fail("Create with a held id", again.status());
  }
  Note("CreateSession created", absl::OkStatus());
}

void FuzzStep(v1::StepRequest& request) {
  Fixture& fixture = TheFixture();
  SessionStore store(FuzzSessionOptions(), nullptr);
  const absl::StatusOr<SessionConfig> config =
      ValidateCreateSession(TinySession(), store.options());
  Require("the tiny session's config", config.status());
  const absl::StatusOr<SessionDescription> tiny = store.Create("", *config);
  Require("the tiny session", tiny.status());
  {
    absl::StatusOr<SessionStore::Pin> pin = store.Acquire("", tiny->id);
    Require("pinning the tiny session", pin.status());
    const std::vector<float> keys(2 * kTinySessionTokens * 3, 0.5f);
    const std::vector<float> values(2 * kTinySessionTokens * 2, -0.25f);
    KvAppend append;
    append.tokens = kTinySessionTokens;
    append.key = reinterpret_cast<const char*>(keys.data());
    append.value = reinterpret_cast<const char*>(values.data());
    int64_t length = 0;
    Require("the tiny session's tokens",
            store.AppendAndView(*pin, 0, 0, append, 0, &length).status());
  }
  for (v1::SessionStep& step : *request.mutable_steps()) {
    if (step.session_id() == kTinySessionMarker) step.set_session_id(tiny->id);
  }
  if (request.replica_incarnation() == kThisIncarnationMarker) {
    request.set_replica_incarnation(store.replica().incarnation);
  }
  const StepLimits limits{FuzzLimits().max_elements,
                          FuzzLimits().max_request_memory_bytes,
                          kMaxMessageBytes};
  v1::StepResponse response;
  absl::StatusOr<StepCall> call =
      PrepareSteps(request, "", store, *fixture.engine, limits, &response);
  if (!call.ok()) return CheckRefusal(call.status());
  if (call->flops > kMaxComputeFlops) return Note("Step too large", {});
  Require("RunSteps",
          RunSteps(*call, store, *fixture.engine, StopCheck(), &response));
  if (response.results_size() != request.steps_size()) {
    Fail("Step", absl::InternalError("a result is missing"));
  }
  for (int i = 0; i < response.results_size(); ++i) {
    const v1::StepResult& result = response.results(i);
    if (result.has_error()) {
      const absl::Status error(
          static_cast<absl::StatusCode>(result.error().code()),
          result.error().message());
      if (error.code() != absl::StatusCode::kFailedPrecondition) {
        CheckRefusal(error);
      }
      continue;
    }
    if (request.steps(i).has_query() != result.has_output()) {
      Fail("Step", absl::InternalError("output and query disagree"));
    }
    if (result.has_output()) CheckResponseTensor("output", result.output());
    if (result.has_lse()) CheckResponseTensor("lse", result.lse());
  }
  const SessionTotals totals = store.Totals();
  if (totals.used_bytes > totals.budget_bytes) {
    Fail("the store", absl::InternalError("holds more than its budget"));
  }
  Note("Step computed", absl::OkStatus());
}

void FuzzPutWeights(const v1::PutWeightsRequest& request) {
  WeightsRegistry registry(kMaxWeightsBytes);
  const absl::StatusOr<v1::PutWeightsResponse> put =
      PutWeightsInto(registry, request);
  if (!put.ok()) return CheckRefusal(put.status());
  const WeightsRegistry::Listing listing = registry.List();
  if (listing.entries.size() != 1 || listing.total_bytes != put->bytes()) {
    Fail("the registry after one put",
         absl::InternalError("holds other than the set put"));
  }
  const v1::WeightsInfo info =
      DescribeWeights(listing.entries[0].first, listing.entries[0].second);
  if (info.name() != request.name()) {
    Fail("DescribeWeights", absl::InternalError("names another set"));
  }
  Require("DeleteWeights", registry.Delete(request.name()).status());
  Note("PutWeights registered", absl::OkStatus());
}

// The translation of ModelInfer, then the native request's own path. A
// refusal of the translation is checked as the native ones are; an answer
// translated back holds the outputs asked, each of the bytes its shape says.
void FuzzModelInfer(inference::ModelInferRequest& request) {
  const bool weight_set = request.model_name() != oip::kSdpaModel;
  oip::RequestedOutputs outputs;
  if (!weight_set) {
    absl::StatusOr<v1::AttendRequest> attend =
        oip::AttendRequestFrom(request, &outputs);
    if (!attend.ok()) {
      return CheckRefusal(oip::InProtocolNames(attend.status(), false));
    }
    const absl::StatusOr<AttendWork> work =
        ValidateAttendRequest(*attend, TheFixture().checks);
    if (!work.ok()) {
      return CheckRefusal(oip::InProtocolNames(work.status(), false));
    }
    FuzzAttend(*attend);
    if (AttentionFlops(work->shape.Dims(), work->plan.options.causal) >
        kMaxComputeFlops) {
      return;
    }
    v1::AttendResponse answer;
    Require("ComputeAttend of a translated request",
            ComputeAttend(*TheFixture().engine, *work, *attend, StopCheck(),
                          &answer));
    inference::ModelInferResponse response;
    oip::FillInferResponse(request, oip::kSdpaVersion, outputs,
                           answer.mutable_output(), answer.mutable_lse(),
                           answer.mutable_weights(), &response);
    const int expected = outputs.output + outputs.lse + outputs.weights;
    if (response.outputs_size() != expected ||
        response.raw_output_contents_size() != expected) {
      Fail("FillInferResponse", absl::InternalError("not the outputs asked"));
    }
    for (int i = 0; i < expected; ++i) {
      int64_t elements = 1;
      for (int64_t dim : response.outputs(i).shape()) elements *= dim;
      const int64_t width = response.outputs(i).datatype() == "FP32" ? 4 : 2;
      if (static_cast<int64_t>(response.raw_output_contents(i).size()) !=
          elements * width) {
        Fail("FillInferResponse",
             absl::InternalError("bytes and shape differ"));
      }
    }
    return;
  }
  absl::StatusOr<v1::MultiHeadAttentionRequest> mha =
      oip::MultiHeadRequestFrom(request, &outputs);
  if (!mha.ok()) return CheckRefusal(oip::InProtocolNames(mha.status(), true));
  FuzzMultiHead(*mha);
}

}  // namespace
}  // namespace attnserve::fuzz

// libprotobuf logs every string field that is not UTF-8 as an error; the
// refusal is checked instead, and the log would fill the disk.
extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve::fuzz;  // NOLINT(build/namespaces)
  if (size < 1) return 0;
  const auto kind = static_cast<RequestKind>(data[0] % kRequestKinds);
  switch (kind) {
    case RequestKind::kAttend: {
      attnserve::v1::AttendRequest request;
      if (Parse(data + 1, size - 1, &request)) FuzzAttend(request);
      break;
    }
    case RequestKind::kMultiHead: {
      attnserve::v1::MultiHeadAttentionRequest request;
      if (Parse(data + 1, size - 1, &request)) FuzzMultiHead(request);
      break;
    }
    case RequestKind::kPutWeights: {
      attnserve::v1::PutWeightsRequest request;
      if (Parse(data + 1, size - 1, &request)) FuzzPutWeights(request);
      break;
    }
    case RequestKind::kCreateSession: {
      attnserve::v1::CreateSessionRequest request;
      if (Parse(data + 1, size - 1, &request)) FuzzCreateSession(request);
      break;
    }
    case RequestKind::kStep: {
      attnserve::v1::StepRequest request;
      if (Parse(data + 1, size - 1, &request)) FuzzStep(request);
      break;
    }
    case RequestKind::kModelInfer: {
      inference::ModelInferRequest request;
      if (Parse(data + 1, size - 1, &request)) FuzzModelInfer(request);
      break;
    }
  }
  return 0;
}
