#include "attnserve/server/sessions/session_steps.h"

#include <cmath>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attnserve/common/allocation_failures.h"
#include "attnserve/common/echo.h"
#include "attnserve/common/flops.h"
#include "attnserve/common/refusals.h"
#include "attnserve/server/sessions/session_requests.h"
#include "attnserve/server/tensors/tensor_checks.h"
#include "attnserve/server/tensors/tensor_codec.h"

namespace attnserve {
namespace {

// Bytes of a result's framing on the wire beyond its tensors' data: tags,
// lengths, the output's and lse's dtypes and shapes, the length field (about
// 100 at most).
constexpr int64_t kResultOverheadBytes = 128;
// And the response's own: the timing, the results' tags.
constexpr int64_t kResponseOverheadBytes = 128;

// The attention FLOPs of a step's `query_len` rows over a layer of `length`
// tokens: the last rows of a causal sequence, aligned at the bottom right.
double StepFlops(const SessionConfig& config, int64_t query_len,
                 int64_t length) {
  return AttentionFlops(
      {1.0, static_cast<double>(config.heads), static_cast<double>(query_len),
       static_cast<double>(length), static_cast<double>(config.key_dim),
       static_cast<double>(config.value_dim)},
      /*causal=*/true, /*bottom_right=*/true);
}

// Keeps the result's length: what the layer holds, set before the error by
// whoever knows it. The message names the step, unless it names one of the
// step's fields already ("steps[2].key ...").
void SetError(int index, const absl::Status& status, v1::StepResult* result) {
  const int64_t length = result->length();
  result->Clear();
  result->set_length(length);
  result->mutable_error()->set_code(static_cast<int32_t>(status.code()));
  const std::string step = absl::StrCat("steps[", index, "]");
  result->mutable_error()->set_message(
      absl::StartsWith(status.message(), step + ".")
          ? std::string(status.message())
          : absl::StrCat(step, ": ", status.message()));
}

absl::Status CheckDims(const std::string& field, const v1::Tensor& tensor,
                       int dim, const char* name, int64_t expected,
                       absl::string_view why) {
  return CheckDimEquals(DimField(field, dim, name), tensor.shape(dim), expected,
                        why);
}

// Checks one step's fields against its session's config and the limits, and
// fills `work` with what it asks.
absl::Status CheckStep(const v1::SessionStep& step, const std::string& prefix,
                       const SessionConfig& config, const StepLimits& limits,
                       StepWork* work) {
  if (step.layer() < 0 || step.layer() >= config.layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "layer is ", step.layer(), ", expected 0 to ",
        config.layers - 1, " (the session's num_layers ", config.layers, ")"));
  }
  work->layer = step.layer();
  // No layer holds more than max_tokens: a larger expectation can never be
  // met (and would overflow the sums below).
  if (step.expected_length() < 0 ||
      step.expected_length() > config.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "expected_length is ", step.expected_length(),
        ", expected 0 to the session's max_tokens ", config.max_tokens,
        " (the tokens the layer holds before this step)"));
  }
  work->expected_length = step.expected_length();
  if (step.has_key() != step.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix,
                     step.has_key() ? "key is set but value is missing"
                                    : "value is set but key is missing",
                     ", expected both (the tokens to append) or neither"));
  }
  if (step.has_key()) {
    const std::string key = prefix + "key";
    const std::string value = prefix + "value";
    if (absl::Status s = CheckTensor(key, true, step.key(), kFloatDTypes,
                                     {"Hkv", "T", "Dk"});
        !s.ok()) {
      return s;
    }
    if (absl::Status s = CheckTensor(value, true, step.value(), kFloatDTypes,
                                     {"Hkv", "T", "Dv"});
        !s.ok()) {
      return s;
    }
    const std::string key_tokens = DimField(key, 1, "T");
    for (absl::Status s :
         {CheckElementLimit(key, step.key(), limits.max_elements),
          CheckElementLimit(value, step.value(), limits.max_elements),
          CheckDims(key, step.key(), 0, "Hkv", config.kv_heads,
                    "the session's num_kv_heads"),
          CheckDims(key, step.key(), 2, "Dk", config.key_dim,
                    "the session's key_dim"),
          CheckDims(value, step.value(), 0, "Hkv", config.kv_heads,
                    "the session's num_kv_heads"),
          CheckDims(value, step.value(), 1, "T", step.key().shape(1),
                    key_tokens),
          CheckDims(value, step.value(), 2, "Dv", config.value_dim,
                    "the session's value_dim")}) {
      if (!s.ok()) return s;
    }
    const int64_t tokens = step.key().shape(1);
    if (tokens > config.max_tokens) {
      return Permanent(absl::ResourceExhaustedError(
          absl::StrCat(DimField(key, 1, "T"), " is ", tokens,
                       ", over the session's max_tokens ", config.max_tokens)));
    }
    work->append.tokens = tokens;
    work->append.key = step.key().data().data();
    work->append.key_dtype = ToDataType(step.key().dtype());
    work->append.value = step.value().data().data();
    work->append.value_dtype = ToDataType(step.value().dtype());
  }
  const v1::StepOptions& options = step.options();
  if (step.has_query()) {
    const std::string query = prefix + "query";
    if (absl::Status s = CheckTensor(query, true, step.query(), kFloatDTypes,
                                     {"H", "Tq", "Dk"});
        !s.ok()) {
      return s;
    }
    for (absl::Status s :
         {CheckElementLimit(query, step.query(), limits.max_elements),
          CheckDims(query, step.query(), 0, "H", config.heads,
                    "the session's num_heads"),
          CheckDims(query, step.query(), 2, "Dk", config.key_dim,
                    "the session's key_dim")}) {
      if (!s.ok()) return s;
    }
    work->query = &step.query();
    work->query_len = step.query().shape(1);
    if (work->query_len > config.max_tokens) {
      return Permanent(absl::ResourceExhaustedError(
          absl::StrCat(DimField(query, 1, "Tq"), " is ", work->query_len,
                       ", over the session's max_tokens ", config.max_tokens)));
    }
    const int64_t outputs = config.heads * work->query_len * config.value_dim;
    if (outputs > limits.max_elements) {
      return Permanent(absl::ResourceExhaustedError(absl::StrCat(
          DimField(query, 1, "Tq"), " is ", work->query_len,
          ": the output [H, Tq, Dv] = [", config.heads, ", ", work->query_len,
          ", ", config.value_dim, "] would hold ", outputs,
          " elements, over the max_elements limit of ", limits.max_elements)));
    }
  } else if (options.return_lse()) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix,
                     "options.return_lse is set but the step has no "
                     "query, expected a query to return lse for"));
  }
  if (options.has_scale()) {
    if (!std::isfinite(options.scale())) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, "options.scale is ", options.scale(),
                       ", expected a finite number"));
    }
    work->scale = options.scale();
  } else {
    work->scale = config.scale.value_or(
        1.0f / std::sqrt(static_cast<float>(config.key_dim)));
  }
  switch (options.precision()) {
    case v1::AttentionOptions::F32:
      work->precision = Precision::kFloat32;
      break;
    case v1::AttentionOptions::BF16:
      work->precision = Precision::kBFloat16;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, "options.precision is ", options.precision(),
                       ", expected F32 (0) or BF16 (1)"));
  }
  work->return_lse = options.return_lse();
  if (options.output_dtype() == v1::DTYPE_UNSPECIFIED) {
    work->output_dtype = step.has_query() ? step.query().dtype() : v1::FLOAT32;
  } else if (options.output_dtype() == v1::FLOAT32 ||
             options.output_dtype() == v1::BFLOAT16 ||
             options.output_dtype() == v1::FLOAT16) {
    work->output_dtype = options.output_dtype();
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "options.output_dtype is ", DTypeName(options.output_dtype()),
        ", expected FLOAT32, BFLOAT16 or FLOAT16 (unset: the query's)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StepCall> PrepareSteps(const v1::StepRequest& request,
                                      const std::string& owner,
                                      SessionStore& store,
                                      const AttentionEngine& engine,
                                      const StepLimits& limits,
                                      v1::StepResponse* response) {
  const int64_t count = request.steps_size();
  const int64_t most = store.options().max_steps_per_call;
  if (count == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "steps is empty, expected 1 to ", most, " steps (max_steps_per_call)"));
  }
  if (count > most) {
    return Permanent(absl::ResourceExhaustedError(
        absl::StrCat("steps holds ", count, " steps, over max_steps_per_call ",
                     most, "; split the call")));
  }
  const ReplicaIdentity& replica = store.replica();
  if (absl::Status same = CheckReplicaIncarnation(
          request.replica_incarnation(), replica, "the steps' sessions are");
      !same.ok()) {
    return same;
  }
  StepCall call;
  call.steps.reserve(static_cast<size_t>(count));
  response->mutable_results()->Reserve(static_cast<int>(count));
  // The answering replica's identity, with its field and length tags.
  int64_t response_bytes =
      kResponseOverheadBytes +
      static_cast<int64_t>(replica.name.size() + replica.incarnation.size()) +
      16;
  std::vector<PagedAttend> sizes;  // The kernel's view of the queries' sizes.
  for (int i = 0; i < static_cast<int>(count); ++i) {
    const v1::SessionStep& step = request.steps(i);
    v1::StepResult* result = response->add_results();
    const std::string prefix = absl::StrCat("steps[", i, "].");
    if (absl::Status id =
            ValidateSessionId(prefix + "session_id", step.session_id());
        !id.ok()) {
      SetError(i, id, result);
      continue;
    }
    absl::StatusOr<SessionStore::Pin> pin =
        store.Acquire(owner, step.session_id());
    if (!pin.ok()) {
      SetError(i, pin.status(), result);
      continue;
    }
    StepWork work(i, *std::move(pin));
    const SessionConfig& config = work.pin.config();
    if (absl::Status s = CheckStep(step, prefix, config, limits, &work);
        !s.ok()) {
      // What the layer holds, as for a failed append (if the layer exists).
      if (step.layer() >= 0 && step.layer() < config.layers) {
        result->set_length(work.pin.Length(step.layer()));
      }
      SetError(i, s, result);
      continue;
    }
    if (config.rope) {  // the keys' rotated f32 copy
      call.memory_bytes +=
          work.append.tokens * config.kv_heads * config.key_dim * 4;
    }
    if (work.query != nullptr) {
      const int64_t rows = config.heads * work.query_len;
      const int64_t output_bytes =
          rows * config.value_dim * (work.output_dtype == v1::FLOAT32 ? 4 : 2);
      const int64_t lse_bytes = work.return_lse ? rows * 4 : 0;
      response_bytes += output_bytes + lse_bytes + kResultOverheadBytes;
      call.memory_bytes += output_bytes + lse_bytes;
      if (work.query->dtype() != v1::FLOAT32 || config.rope) {
        call.memory_bytes += rows * config.key_dim * 4;  // f32 (rotated) copy
      }
      if (work.output_dtype != v1::FLOAT32) {
        call.memory_bytes += rows * config.value_dim * 4;
      }
      call.flops += StepFlops(config, work.query_len,
                              work.expected_length + work.append.tokens);
      PagedAttend size;
      size.layout = PageLayoutOf(config, store.options());
      size.heads = config.heads;
      size.query_len = work.query_len;
      sizes.push_back(size);
    } else {
      response_bytes += kResultOverheadBytes;
    }
    call.steps.push_back(std::move(work));
  }
  if (response_bytes > limits.max_message_bytes) {
    return Permanent(absl::ResourceExhaustedError(absl::StrCat(
        "the response would take about ", response_bytes,
        " bytes, over the message limit of ", limits.max_message_bytes,
        " bytes (max_message_bytes); split the call or ask for fewer query "
        "rows")));
  }
  const int64_t workspace = engine.PagedWorkspaceBytes(sizes);
  if (workspace > engine.options().max_workspace_bytes) {
    return Permanent(absl::ResourceExhaustedError(
        absl::StrCat("the call's attention needs ", workspace,
                     " bytes of scratch, over the engine's workspace limit of ",
                     engine.options().max_workspace_bytes,
                     " bytes (max_workspace_bytes); split the call")));
  }
  call.memory_bytes += workspace;
  if (call.memory_bytes > limits.max_request_memory_bytes) {
    return Permanent(absl::ResourceExhaustedError(absl::StrCat(
        "the call's compute would need ", call.memory_bytes,
        " bytes, over the limit of ", limits.max_request_memory_bytes,
        " bytes (max_request_memory_bytes); split the call")));
  }
  return call;
}

namespace {

// A step whose query is being computed, and where its results go.
struct Computing {
  int index;
  double flops;
  SessionStore::View view;
  std::vector<float> query_storage;
  std::unique_ptr<OutputTensor> output;
  std::unique_ptr<OutputTensor> lse;
};

// What RunSteps does for one step: its append, then the item of its
// attention, if it has a query. `appended` is set once the append landed.
void PrepareStep(StepWork& work, SessionStore& store, v1::StepResult* result,
                 std::optional<int64_t>* appended,
                 std::vector<Computing>* computing,
                 std::vector<PagedAttend>* items) {
  int64_t length = 0;
  const SessionConfig& config = work.pin.config();
  std::vector<float> rotated_keys;
  if (config.rope && work.append.tokens > 0) {
    // The keys turned at the positions they will hold (a step expecting
    // another length appends nothing).
    const int64_t tokens = work.append.tokens;
    rotated_keys.resize(
        static_cast<size_t>(config.kv_heads * tokens * config.key_dim));
    ConvertToFloat32(work.append.key_dtype, work.append.key,
                     static_cast<int64_t>(rotated_keys.size()),
                     rotated_keys.data());
    for (int64_t h = 0; h < config.kv_heads; ++h) {
      ApplyRotary(*config.rope, config.key_dim, 1,
                  rotated_keys.data() + h * tokens * config.key_dim, tokens,
                  config.key_dim, work.expected_length);
    }
    work.append.key = reinterpret_cast<const char*>(rotated_keys.data());
    work.append.key_dtype = DataType::kFloat32;
  }
  absl::StatusOr<SessionStore::View> view = store.AppendAndView(
      work.pin, work.layer, work.expected_length, work.append,
      work.query == nullptr ? 0 : work.query_len, &length);
  if (!view.ok()) {
    // What the layer holds, so that a client retrying can tell whether its
    // first attempt landed without asking GetSession.
    if (view.status().code() != absl::StatusCode::kNotFound) {
      result->set_length(length);
    }
    SetError(work.index, view.status(), result);
    return;
  }
  *appended = view->length;
  result->set_length(view->length);
  if (work.query == nullptr) return;
  Computing& c = computing->emplace_back();
  c.index = work.index;
  c.flops = StepFlops(config, work.query_len, view->length);
  c.view = *std::move(view);
  PagedAttend item;
  item.layout = c.view.layout;
  item.pages = c.view.data;
  item.length = c.view.length;
  item.heads = config.heads;
  item.query_len = work.query_len;
  item.query = FloatElements(*work.query, &c.query_storage);
  if (config.rope) {
    // Query row i stands at L − Tq + i; rotated in a copy of its own.
    if (c.query_storage.empty()) {
      c.query_storage.assign(item.query.begin(), item.query.end());
    }
    for (int64_t h = 0; h < config.heads; ++h) {
      ApplyRotary(*config.rope, config.key_dim, 1,
                  c.query_storage.data() + h * work.query_len * config.key_dim,
                  work.query_len, config.key_dim,
                  c.view.length - work.query_len);
    }
    item.query = c.query_storage;
  }
  item.scale = work.scale;
  item.window_left = config.window_left;
  item.num_sink_tokens = config.num_sink_tokens;
  item.softcap = config.softcap.value_or(0.0f);
  item.alibi_slopes = config.alibi_slopes;
  item.precision = work.precision;
  const int64_t output_shape[] = {config.heads, work.query_len,
                                  config.value_dim};
  c.output = std::make_unique<OutputTensor>(work.output_dtype, output_shape,
                                            result->mutable_output());
  item.output = c.output->values();
  if (work.return_lse) {
    const int64_t lse_shape[] = {config.heads, work.query_len};
    c.lse = std::make_unique<OutputTensor>(v1::FLOAT32, lse_shape,
                                           result->mutable_lse());
    item.lse = c.lse->values();
  }
  items->push_back(item);
}

}  // namespace

absl::Status RunSteps(StepCall& call, SessionStore& store,
                      AttentionEngine& engine, const StopCheck& stop,
                      v1::StepResponse* response) {
  std::vector<Computing> computing;
  computing.reserve(call.steps.size());  // The items point into them.
  std::vector<PagedAttend> items;
  for (StepWork& work : call.steps) {
    v1::StepResult* result = response->mutable_results(work.index);
    // A failed allocation fails this step alone, saying whether its append
    // landed (one escaping failed the whole call, the appends standing
    // without their lengths).
    std::optional<int64_t> appended;
    const size_t computing_before = computing.size();
    try {
      PrepareStep(work, store, result, &appended, &computing, &items);
    } catch (const std::bad_alloc&) {
      if (computing.size() > computing_before) {
        store.Drop(computing.back().view);
        computing.pop_back();
      }
      result->set_length(appended.value_or(work.expected_length));
      SetError(work.index,
               AllocationFailed(
                   appended ? absl::StrCat("attend after the append (the "
                                           "layer now holds ",
                                           *appended, " tokens)")
                            : std::string("prepare the step (nothing was "
                                          "appended)")),
               result);
    }
  }
  const absl::Status computed = engine.AttendPaged(items, stop);
  // The kernel is done with the pages (SessionStore::Drop).
  for (Computing& c : computing) store.Drop(c.view);
  if (computed.code() == absl::StatusCode::kCancelled ||
      computed.code() == absl::StatusCode::kDeadlineExceeded) {
    // Stopped: the caller is gone or past its deadline; the appends stand.
    return computed;
  }
  call.flops = 0;
  for (Computing& c : computing) {
    v1::StepResult* result = response->mutable_results(c.index);
    if (!computed.ok()) {
      SetError(c.index,
               absl::Status(computed.code(),
                            absl::StrCat("the attention failed after the "
                                         "append (the layer now holds ",
                                         c.view.length,
                                         " tokens): ", computed.message())),
               result);
      continue;
    }
    c.output->Finish();
    if (c.lse != nullptr) c.lse->Finish();
    call.flops += c.flops;
  }
  return absl::OkStatus();
}

}  // namespace attnserve
