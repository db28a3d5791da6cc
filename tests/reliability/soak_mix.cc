#include "reliability/soak_mix.h"

#include <chrono>
#include <cmath>
#include <future>
#include <initializer_list>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnserve/client/client.h"
#include "grpcpp/grpcpp.h"
#include "reference/reference_attention.h"

namespace attnserve::testing {
namespace {

using Options = v1::AttentionOptions;
using Code = grpc::StatusCode;

constexpr char kSoakWeights[] = "soak";

std::chrono::system_clock::time_point In(std::chrono::microseconds delay) {
  return std::chrono::system_clock::now() + delay;
}
constexpr std::chrono::seconds kCallTimeout(60);

// Bounds a call by `timeout`. Before SIGTERM calls wait for their channel to be
// connected: gRPC 1.51's client may fail a connection attempt that would have
// succeeded ("No such file or directory": it reads connect()'s errno after
// other calls, grpc/grpc#35064), and the channel then backs off for ~1 s,
// failing every call made on it meanwhile with UNAVAILABLE. That is the
// client's bug, not the server's; a connection the server breaks still fails
// the calls on it. While draining, calls fail at once as a client's would.
void Bound(grpc::ClientContext& context, bool draining,
           std::chrono::microseconds timeout = kCallTimeout) {
  context.set_deadline(In(timeout));
  context.set_wait_for_ready(!draining);
}

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t elements = 1;
  for (int64_t dim : shape) elements *= dim;
  return elements;
}

v1::Tensor Random(v1::DType dtype, const std::vector<int64_t>& shape,
                  uint64_t seed) {
  return MakeTensor(dtype, shape, RandomValues(Elements(shape), seed));
}

v1::AttendRequest AttendOf(v1::DType dtype, std::vector<int64_t> query,
                           std::vector<int64_t> key, std::vector<int64_t> value,
                           uint64_t seed) {
  v1::AttendRequest request;
  *request.mutable_query() = Random(dtype, query, seed);
  *request.mutable_key() = Random(dtype, key, seed + 1);
  *request.mutable_value() = Random(dtype, value, seed + 2);
  return request;
}

// Four Attend requests: plain; GQA with bottom-right causal, key lengths and
// lse; bf16 with a bool mask, bf16 precision and head-mean weights; fp16 with a
// float mask and a scale, big enough (16.8 MFLOP) to run on the executor's
// thread team.
std::vector<v1::AttendRequest> AttendRequests() {
  std::vector<v1::AttendRequest> requests;
  requests.push_back(
      AttendOf(v1::FLOAT32, {1, 2, 8, 16}, {1, 2, 8, 16}, {1, 2, 8, 16}, 100));
  v1::AttendRequest gqa = AttendOf(v1::FLOAT32, {2, 4, 16, 32}, {2, 1, 24, 32},
                                   {2, 1, 24, 32}, 200);
  gqa.mutable_options()->set_causal(true);
  gqa.mutable_options()->set_causal_alignment(Options::BOTTOM_RIGHT);
  gqa.mutable_options()->add_key_lengths(24);
  gqa.mutable_options()->add_key_lengths(17);
  gqa.mutable_options()->set_return_lse(true);
  requests.push_back(std::move(gqa));
  v1::AttendRequest bf16 = AttendOf(v1::BFLOAT16, {1, 4, 32, 32},
                                    {1, 4, 32, 32}, {1, 4, 32, 32}, 300);
  std::vector<bool> allowed(32 * 32);
  for (size_t i = 0; i < allowed.size(); ++i) allowed[i] = (i * 7919) % 5 != 0;
  *bf16.mutable_options()->mutable_attn_mask() =
      MakeBoolTensor({32, 32}, allowed);
  bf16.mutable_options()->set_precision(Options::BF16);
  bf16.mutable_options()->set_return_weights(Options::HEAD_MEAN);
  requests.push_back(std::move(bf16));
  v1::AttendRequest fp16 = AttendOf(v1::FLOAT16, {1, 8, 64, 64},
                                    {1, 8, 128, 64}, {1, 8, 128, 64}, 400);
  *fp16.mutable_options()->mutable_attn_mask() =
      Random(v1::FLOAT32, {1, 1, 64, 128}, 404);
  fp16.mutable_options()->set_scale(0.1f);
  fp16.mutable_options()->set_output_dtype(v1::FLOAT32);
  requests.push_back(std::move(fp16));
  return requests;
}

// E = 16, H = 4, Hkv = 2, Dk = Dv = 4, with biases.
v1::ProjectionWeights SoakWeights() {
  v1::ProjectionWeights w;
  *w.mutable_w_q() = Random(v1::FLOAT32, {16, 16}, 500);
  *w.mutable_w_k() = Random(v1::FLOAT32, {8, 16}, 501);
  *w.mutable_w_v() = Random(v1::FLOAT32, {8, 16}, 502);
  *w.mutable_w_o() = Random(v1::FLOAT32, {16, 16}, 503);
  *w.mutable_b_q() = Random(v1::FLOAT32, {16}, 504);
  *w.mutable_b_k() = Random(v1::FLOAT32, {8}, 505);
  *w.mutable_b_v() = Random(v1::FLOAT32, {8}, 506);
  *w.mutable_b_o() = Random(v1::FLOAT32, {16}, 507);
  w.set_num_heads(4);
  w.set_num_kv_heads(2);
  return w;
}

// The built-in demo weights; the soak weights inline, causal; the soak weights
// by name, with per-head weights.
std::vector<v1::MultiHeadAttentionRequest> MultiHeadRequests() {
  std::vector<v1::MultiHeadAttentionRequest> requests(3);
  *requests[0].mutable_query_input() = Random(v1::FLOAT32, {1, 8, 64}, 600);
  requests[0].set_weights_name("demo");
  *requests[1].mutable_query_input() = Random(v1::FLOAT32, {2, 6, 16}, 601);
  *requests[1].mutable_weights() = SoakWeights();
  requests[1].mutable_options()->set_causal(true);
  *requests[2].mutable_query_input() = Random(v1::FLOAT32, {2, 6, 16}, 602);
  requests[2].set_weights_name(kSoakWeights);
  requests[2].mutable_options()->set_return_weights(Options::PER_HEAD);
  return requests;
}

bool SameTensor(const v1::Tensor& a, const v1::Tensor& b) {
  return a.dtype() == b.dtype() && a.shape_size() == b.shape_size() &&
         std::equal(a.shape().begin(), a.shape().end(), b.shape().begin()) &&
         a.data() == b.data();
}

template <typename Response>
bool SameAnswer(const Response& a, const Response& b) {
  return SameTensor(a.output(), b.output()) &&
         SameTensor(a.weights(), b.weights()) && SameTensor(a.lse(), b.lse());
}

// The recorded answer agrees with the reference within docs/api.md's F32
// bounds.
absl::Status CheckNear(const v1::Tensor& actual,
                       const std::vector<double>& expected) {
  const absl::StatusOr<std::vector<float>> values = Float32Values(actual);
  if (!values.ok()) return values.status();
  if (values->size() != expected.size())
    return absl::InternalError("wrong output size");
  for (size_t i = 0; i < expected.size(); ++i) {
    if (std::abs((*values)[i] - expected[i]) >
        1e-5 + 1e-5 * std::abs(expected[i])) {
      return absl::InternalError(absl::StrCat(
          "output[", i, "] is ", (*values)[i], ", expected ", expected[i]));
    }
  }
  return absl::OkStatus();
}

std::vector<float> Values(const v1::Tensor& tensor) {
  return Float32Values(tensor).value();
}

absl::Status CheckRecordedAnswers(
    const v1::AttendRequest& attend, const v1::AttendResponse& attend_answer,
    const v1::MultiHeadAttentionRequest& multi_head,
    const v1::MultiHeadAttentionResponse& multi_head_answer) {
  const absl::Status sdpa = CheckNear(
      attend_answer.output(),
      ReferenceAttention({1, 2, 2, 8, 8, 16, 16}, Values(attend.query()),
                         Values(attend.key()), Values(attend.value()))
          .output);
  if (!sdpa.ok()) return sdpa;
  const v1::ProjectionWeights& w = multi_head.weights();
  ReferenceOptions options;
  options.causal = true;
  return CheckNear(
      multi_head_answer.output(),
      ReferenceMultiHeadAttention(
          {2, 6, 6, 16, 16, 4, 2, 4, 4}, Values(multi_head.query_input()), {},
          {Values(w.w_q()), Values(w.w_k()), Values(w.w_v()), Values(w.w_o()),
           Values(w.b_q()), Values(w.b_k()), Values(w.b_v()), Values(w.b_o())},
          options)
          .output);
}

// Counts `status` for `operation` against the codes it may end with. While
// draining, the server may also refuse the call (UNAVAILABLE), or gRPC's own
// shutdown may cancel a call that arrived after the service stopped taking
// calls (CANCELLED): then it returns false and the caller stops sending, as a
// client of a replica going away would.
bool Outcome(SoakTally& tally, const char* operation,
             const grpc::Status& status, std::initializer_list<Code> allowed,
             bool draining, int64_t requests,
             const std::string& expected_message = "") {
  tally.Count(operation, status.error_code(), requests);
  bool expected = false;
  for (Code code : allowed) expected = expected || status.error_code() == code;
  if (draining && !expected &&
      (status.error_code() == Code::UNAVAILABLE ||
       status.error_code() == Code::CANCELLED)) {
    return false;
  }
  if (!expected ||
      status.error_message().find(expected_message) == std::string::npos) {
    tally.Unexpected(absl::StrCat(operation, ": code ", status.error_code(),
                                  ": ", status.error_message()));
  }
  return true;
}

}  // namespace

void SoakTally::Count(const std::string& operation, grpc::StatusCode code,
                      int64_t requests) {
  absl::MutexLock lock(&mutex_);
  ++calls_[{operation, static_cast<int>(code)}];
  requests_ += requests;
}

void SoakTally::Unexpected(const std::string& description) {
  absl::MutexLock lock(&mutex_);
  ++unexpected_;
  if (described_.size() < 20) described_.push_back(description);
}

int64_t SoakTally::requests() const {
  absl::MutexLock lock(&mutex_);
  return requests_;
}

int64_t SoakTally::unexpected() const {
  absl::MutexLock lock(&mutex_);
  return unexpected_;
}

int64_t SoakTally::Calls(const std::string& operation,
                         grpc::StatusCode code) const {
  absl::MutexLock lock(&mutex_);
  int64_t calls = 0;
  for (const auto& [key, count] : calls_) {
    if ((operation.empty() || key.first == operation) &&
        key.second == static_cast<int>(code)) {
      calls += count;
    }
  }
  return calls;
}

int64_t SoakTally::Calls(const std::string& operation) const {
  absl::MutexLock lock(&mutex_);
  int64_t calls = 0;
  for (const auto& [key, count] : calls_) {
    if (key.first == operation) calls += count;
  }
  return calls;
}

std::string SoakTally::Report() const {
  absl::MutexLock lock(&mutex_);
  std::string report;
  for (const auto& [key, count] : calls_) {
    absl::StrAppend(&report, "  ", key.first, " code ", key.second, ": ", count,
                    "\n");
  }
  for (const std::string& description : described_) {
    absl::StrAppend(&report, "  unexpected: ", description, "\n");
  }
  return report;
}

absl::StatusOr<std::unique_ptr<SoakMix>> SoakMix::Create(
    v1::AttentionService::Stub& stub) {
  std::unique_ptr<SoakMix> mix(new SoakMix());
  mix->put_weights_.set_name(kSoakWeights);
  *mix->put_weights_.mutable_weights() = SoakWeights();
  {
    grpc::ClientContext context;
    Bound(context, /*draining=*/false);
    v1::PutWeightsResponse put;
    const grpc::Status status =
        stub.PutWeights(&context, mix->put_weights_, &put);
    if (!status.ok())
      return absl::InternalError("PutWeights: " + status.error_message());
  }
  mix->attend_ = AttendRequests();
  for (const v1::AttendRequest& request : mix->attend_) {
    grpc::ClientContext context;
    Bound(context, /*draining=*/false);
    mix->attend_answers_.emplace_back();
    const grpc::Status status =
        stub.Attend(&context, request, &mix->attend_answers_.back());
    if (!status.ok())
      return absl::InternalError("Attend: " + status.error_message());
  }
  mix->multi_head_ = MultiHeadRequests();
  for (const v1::MultiHeadAttentionRequest& request : mix->multi_head_) {
    grpc::ClientContext context;
    Bound(context, /*draining=*/false);
    mix->multi_head_answers_.emplace_back();
    const grpc::Status status = stub.MultiHeadAttention(
        &context, request, &mix->multi_head_answers_.back());
    if (!status.ok())
      return absl::InternalError("MultiHeadAttention: " +
                                 status.error_message());
  }
  const absl::Status reference =
      CheckRecordedAnswers(mix->attend_[0], mix->attend_answers_[0],
                           mix->multi_head_[1], mix->multi_head_answers_[1]);
  if (!reference.ok()) return reference;
  mix->invalid_attend_ = mix->attend_[0];
  mix->invalid_attend_.mutable_options()->set_scale(
      std::numeric_limits<float>::quiet_NaN());
  mix->unknown_weights_ = mix->multi_head_[0];
  mix->unknown_weights_.set_weights_name("no-such-weights");
  return mix;
}

bool SoakMix::Run(int64_t index, Stub& stub, const std::string& target,
                  bool draining, SoakTally& tally) const {
  switch (index % 20) {
    case 0:
    case 4:
    case 17:
      return Attend(0, stub, draining, tally);
    case 1:
    case 5:
    case 19:
      return Attend(1, stub, draining, tally);
    case 2:
    case 16:
      return Attend(2, stub, draining, tally);
    case 3:
      return Attend(3, stub, draining, tally);
    case 6:
    case 7:
    case 8:
      return MultiHead(index % 20 - 6, stub, draining, tally);
    case 9:
    case 18:
      return Stream(stub, draining, tally);
    case 10:
      return InvalidAttend(stub, draining, tally);
    case 11:
      return UnknownWeights(stub, draining, tally);
    case 12:
      return TinyDeadline(index, stub, draining, tally);
    case 13:
      return CancelWhileQueued(index, stub, draining, tally);
    case 14:
      if (index % 200 == 14) {
        // A channel of its own, so that its connection closes when it goes.
        grpc::ChannelArguments arguments;
        arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
        const auto own =
            v1::AttentionService::NewStub(grpc::CreateCustomChannel(
                target, grpc::InsecureChannelCredentials(), arguments));
        return CancelStream(*own, kStreamChannelGone, draining, tally);
      }
      return CancelStream(stub, kStreamCancel, draining, tally);
    default:
      return Registry(stub, draining, tally);
  }
}

bool SoakMix::Attend(size_t which, Stub& stub, bool draining,
                     SoakTally& tally) const {
  grpc::ClientContext context;
  Bound(context, draining);
  v1::AttendResponse response;
  const grpc::Status status = stub.Attend(&context, attend_[which], &response);
  if (status.ok() && !SameAnswer(response, attend_answers_[which])) {
    tally.Unexpected(absl::StrCat("Attend #", which,
                                  ": the answer differs from the idle one"));
  }
  return Outcome(tally, kAttend, status, {Code::OK}, draining, 1);
}

bool SoakMix::MultiHead(size_t which, Stub& stub, bool draining,
                        SoakTally& tally) const {
  grpc::ClientContext context;
  Bound(context, draining);
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status =
      stub.MultiHeadAttention(&context, multi_head_[which], &response);
  if (status.ok() && !SameAnswer(response, multi_head_answers_[which])) {
    tally.Unexpected(absl::StrCat("MultiHeadAttention #", which,
                                  ": the answer differs from the idle one"));
  }
  return Outcome(tally, kMultiHead, status, {Code::OK}, draining, 1);
}

// Four requests on one stream, the second invalid: four answers in order, the
// second its error.
bool SoakMix::Stream(Stub& stub, bool draining, SoakTally& tally) const {
  grpc::ClientContext context;
  Bound(context, draining);
  const auto stream = stub.AttendStream(&context);
  const std::vector<const v1::AttendRequest*> requests = {
      &attend_[0], &invalid_attend_, &attend_[1], &attend_[2]};
  const std::vector<const v1::AttendResponse*> answers = {
      &attend_answers_[0], nullptr, &attend_answers_[1], &attend_answers_[2]};
  for (const v1::AttendRequest* request : requests) {
    if (!stream->Write(*request)) break;
  }
  stream->WritesDone();
  v1::AttendStreamResponse answer;
  int64_t answered = 0;
  while (stream->Read(&answer)) {
    const size_t at = static_cast<size_t>(answered);
    if (answer.index() != answered || at >= answers.size()) {
      tally.Unexpected(absl::StrCat("AttendStream: answer ", answer.index(),
                                    " came ", answered));
    } else if (answers[at] == nullptr) {
      Outcome(tally, kStreamBadRequest,
              grpc::Status(static_cast<Code>(answer.error().code()),
                           answer.error().message()),
              {Code::INVALID_ARGUMENT}, draining, 0, "options.scale is nan");
    } else if (answer.has_error() ||
               !SameAnswer(answer.response(), *answers[at])) {
      tally.Unexpected(absl::StrCat("AttendStream: answer ", answered,
                                    " is wrong: ", answer.error().message()));
    }
    ++answered;
  }
  const grpc::Status status = stream->Finish();
  if (status.ok() && answered != 4) {
    tally.Unexpected(
        absl::StrCat("AttendStream: ", answered, " answers to 4 requests"));
  }
  return Outcome(tally, kStream, status, {Code::OK}, draining, 4);
}

bool SoakMix::InvalidAttend(Stub& stub, bool draining, SoakTally& tally) const {
  grpc::ClientContext context;
  Bound(context, draining);
  v1::AttendResponse response;
  const grpc::Status status = stub.Attend(&context, invalid_attend_, &response);
  return Outcome(tally, kInvalidAttend, status, {Code::INVALID_ARGUMENT},
                 draining, 1, "options.scale is nan, expected a finite number");
}

bool SoakMix::UnknownWeights(Stub& stub, bool draining,
                             SoakTally& tally) const {
  grpc::ClientContext context;
  Bound(context, draining);
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status =
      stub.MultiHeadAttention(&context, unknown_weights_, &response);
  return Outcome(tally, kUnknownWeights, status, {Code::NOT_FOUND}, draining, 1,
                 "weights_name 'no-such-weights' is not registered");
}

// The heaviest Attend with a deadline of 1 to 4 ms: it passes before the call
// is sent, while it waits behind the others, or not at all.
bool SoakMix::TinyDeadline(int64_t index, Stub& stub, bool draining,
                           SoakTally& tally) const {
  grpc::ClientContext context;
  Bound(context, draining, std::chrono::milliseconds(1 + index / 20 % 4));
  v1::AttendResponse response;
  const grpc::Status status = stub.Attend(&context, attend_[3], &response);
  if (status.ok() && !SameAnswer(response, attend_answers_[3])) {
    tally.Unexpected(
        "Attend with a deadline: the answer differs from the idle one");
  }
  return Outcome(tally, kDeadline, status, {Code::OK, Code::DEADLINE_EXCEEDED},
                 draining, 1);
}

// The heaviest Attend, cancelled 0 to 1.5 ms after it is sent: before it
// reaches the server, while it waits in the queue, or after its answer.
bool SoakMix::CancelWhileQueued(int64_t index, Stub& stub, bool draining,
                                SoakTally& tally) const {
  grpc::ClientContext context;
  Bound(context, draining);
  v1::AttendResponse response;
  std::promise<grpc::Status> done;
  stub.async()->Attend(
      &context, &attend_[3], &response,
      [&done](grpc::Status status) { done.set_value(std::move(status)); });
  absl::SleepFor(absl::Microseconds(500 * (index / 20 % 4)));
  context.TryCancel();
  const grpc::Status status = done.get_future().get();
  if (status.ok() && !SameAnswer(response, attend_answers_[3])) {
    tally.Unexpected("cancelled Attend: the answer differs from the idle one");
  }
  return Outcome(tally, kCancel, status, {Code::OK, Code::CANCELLED}, draining,
                 1);
}

// Three of the heaviest requests on a stream, then the client goes away after
// the first answer.
bool SoakMix::CancelStream(Stub& stub, const char* operation, bool draining,
                           SoakTally& tally) const {
  grpc::ClientContext context;
  Bound(context, draining);
  const auto stream = stub.AttendStream(&context);
  for (int i = 0; i < 3; ++i) {
    if (!stream->Write(attend_[3])) break;
  }
  v1::AttendStreamResponse answer;
  if (stream->Read(&answer) &&
      (answer.has_error() ||
       !SameAnswer(answer.response(), attend_answers_[3]))) {
    tally.Unexpected(absl::StrCat(
        operation, ": the first answer is wrong: ", answer.error().message()));
  }
  context.TryCancel();
  const grpc::Status status = stream->Finish();
  return Outcome(tally, operation, status, {Code::CANCELLED}, draining, 3);
}

bool SoakMix::Registry(Stub& stub, bool draining, SoakTally& tally) const {
  grpc::ClientContext put_context;
  Bound(put_context, draining);
  v1::PutWeightsResponse put;
  const grpc::Status put_status =
      stub.PutWeights(&put_context, put_weights_, &put);
  if (!Outcome(tally, kRegistry, put_status, {Code::OK}, draining, 1))
    return false;
  grpc::ClientContext list_context;
  Bound(list_context, draining);
  v1::ListWeightsResponse list;
  const grpc::Status list_status = stub.ListWeights(&list_context, {}, &list);
  if (list_status.ok() && list.weights_size() < 2) {
    tally.Unexpected(
        absl::StrCat("ListWeights lists ", list.weights_size(), " sets"));
  }
  return Outcome(tally, kRegistry, list_status, {Code::OK}, draining, 1);
}

}  // namespace attnserve::testing
