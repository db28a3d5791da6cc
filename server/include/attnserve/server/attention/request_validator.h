// Validation of every request field, before any work is queued or anything
// large allocated.
//
// Every error names the field and says what was expected and what arrived, e.g.
//   INVALID_ARGUMENT: key.shape[3] (Dk) is 32, expected 64 (query.shape[3]
//   (Dk))
#ifndef ATTNSERVE_SERVER_ATTENTION_REQUEST_VALIDATOR_H_
#define ATTNSERVE_SERVER_ATTENTION_REQUEST_VALIDATOR_H_

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attnserve/core/attention_engine.h"
#include "attnserve/server/weights/weights_registry.h"
#include "attnserve/server/weights/weights_validator.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// Per-request limits, checked before anything is allocated.
struct RequestLimits {
  // The most elements any one tensor may have.
  int64_t max_elements = int64_t{1} << 28;
  // The most memory a request's compute may allocate: outputs, weights, lse,
  // f32 copies of non-f32 inputs, projections, and the attention's scratch.
  int64_t max_request_memory_bytes = int64_t{4} << 30;
};

// What a request is checked against.
struct RequestChecks {
  RequestLimits limits;
  // The largest message the server sends: a response that would be larger is
  // refused with RESOURCE_EXHAUSTED before it is computed.
  int64_t max_message_bytes = int64_t{64} << 20;
  // The engine that will compute, which knows its own scratch needs (they
  // depend on its kernel and thread count) and their limit
  // (EngineOptions::max_workspace_bytes): a request over it is refused here
  // rather than after queueing. Required.
  const AttentionEngine* engine = nullptr;
  // Whether the response carries the output: an Open Inference Protocol
  // request may ask for its WEIGHTS or LSE alone, and the output (computed
  // all the same) then counts in no message.
  bool response_carries_output = true;
};

// Validated options whose data (mask, key lengths) still lives in the request:
// BindOptions in response_tensors.h points them at it when the work runs.
struct OptionsPlan {
  AttentionOptions options;  // mask, key_lengths and alibi_slopes unset
  std::optional<std::array<int64_t, 4>> mask_dims;  // left-padded to rank 4
  std::vector<float> alibi_slopes;                  // [H] decoded, or empty
  v1::DType output_dtype = v1::FLOAT32;
};

// `plan.options` with its ALiBi slopes bound to `plan.alibi_slopes` (so valid
// while `plan` lives): what the engine's choice of route and its scratch
// figures must see (ALiBi rules out the decode paths).
AttentionOptions RoutedOptions(const OptionsPlan& plan);

struct AttendWork {
  // Packed sequences (options.cu_seqlens_q/k): `shape` is then [B = 1, H,
  // Hkv, Lq = total_q, Lk = total_k, Dk, Dv].
  bool packed = false;
  AttentionShape shape;
  OptionsPlan plan;
  // Query, key and value all BFLOAT16 or all FLOAT16: computed by
  // AttentionEngine::AttendHalf (AttendPackedHalf for packed sequences) where
  // they lie, never batched with others.
  bool inputs_in_place = false;
  // What the compute will allocate: outputs, weights, lse, conversions,
  // scratch (the figure checked against max_request_memory_bytes).
  int64_t memory_bytes = 0;
};

struct MultiHeadWork {
  MultiHeadShape shape;
  OptionsPlan plan;
  bool self_attention = true;
  // What the compute will allocate, projections included.
  int64_t memory_bytes = 0;
};

// Returns the work an Attend request describes, INVALID_ARGUMENT for a
// malformed field, or RESOURCE_EXHAUSTED if it is over `checks`.
absl::StatusOr<AttendWork> ValidateAttendRequest(
    const v1::AttendRequest& request, const RequestChecks& checks);

// The projection weights a MultiHeadAttention request names or carries.
struct MultiHeadWeights {
  std::shared_ptr<const WeightSet> registered;  // Null for inline weights.
  int64_t version = 0;  // The registered set's version; 0 for inline ones.
  std::string origin;   // "weights" or "weights 'NAME'", for messages.
  WeightsShape shape;
};

// Finds the weights of `request` in `registry`, or checks its inline ones.
// INVALID_ARGUMENT for neither, a malformed name or inline set, or a
// weights_version that is negative or comes without weights_name; NOT_FOUND
// for an unknown name; FAILED_PRECONDITION, naming both versions, for a
// weights_version other than the registered set's.
absl::StatusOr<MultiHeadWeights> ResolveMultiHeadWeights(
    const v1::MultiHeadAttentionRequest& request,
    const WeightsRegistry& registry);

// Returns the work a MultiHeadAttention request describes against weights of
// `weights_shape`
// (`weights_origin` names them in messages: "weights" or "weights 'demo'").
absl::StatusOr<MultiHeadWork> ValidateMultiHeadRequest(
    const v1::MultiHeadAttentionRequest& request,
    const WeightsShape& weights_shape, const std::string& weights_origin,
    const RequestChecks& checks);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_REQUEST_VALIDATOR_H_
