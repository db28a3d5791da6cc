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
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "attnserve/core/attention_engine.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

struct RequestLimits {
  // The largest message the server receives or sends. A response that would be
  // larger is refused with RESOURCE_EXHAUSTED before it is computed.
  int64_t max_message_bytes = int64_t{64} << 20;
  // The most elements any one tensor may have.
  int64_t max_elements = int64_t{1} << 28;
  // The most memory a request's compute may allocate: outputs, weights, lse,
  // f32 copies of non-f32 inputs, projections, and the attention's scratch.
  int64_t max_request_memory_bytes = int64_t{4} << 30;
  // The attention kernel's scratch limit (the engine's max_workspace_bytes): a
  // request whose scratch would exceed it is refused here rather than after
  // queueing.
  int64_t max_workspace_bytes = int64_t{1} << 30;
  // How long a unary call's request may take to arrive after its headers;
  // past it the call is cancelled and what was buffered of it dropped.
  absl::Duration message_timeout = absl::Seconds(30);
  // Whether compressed requests are taken (then inflated by InflateRequest,
  // bounded by max_message_bytes).
  bool accept_compressed_requests = false;
  // How long an AttendStream's next message may take to arrive; past it the
  // stream is cancelled.
  absl::Duration stream_idle_timeout = absl::Minutes(5);
  // The engine that will compute, which knows its own scratch needs (they
  // depend on its kernel and thread count). Null: validation alone, the
  // scratch is estimated as the unfused path's.
  const AttentionEngine* engine = nullptr;
};

// Validated options whose data (mask, key lengths) still lives in the request:
// BindOptions in tensor_codec.h points them at it when the work runs.
struct OptionsPlan {
  AttentionOptions options;  // mask and key_lengths unset
  std::optional<std::array<int64_t, 4>> mask_dims;  // left-padded to rank 4
  v1::DType output_dtype = v1::FLOAT32;
};

struct AttendWork {
  AttentionShape shape;
  OptionsPlan plan;
  // What the compute will allocate: outputs, weights, lse, conversions,
  // scratch (the figure checked against max_request_memory_bytes).
  int64_t memory_bytes = 0;
};

// The dimensions a set of projection weights implies.
struct WeightsShape {
  int64_t embed_dim = 0, kv_embed_dim = 0, heads = 0, kv_heads = 0, key_dim = 0,
          value_dim = 0;
};

struct MultiHeadWork {
  MultiHeadShape shape;
  OptionsPlan plan;
  bool self_attention = true;
  // What the compute will allocate, projections included.
  int64_t memory_bytes = 0;
};

// Returns the work an Attend request describes, INVALID_ARGUMENT for a
// malformed field, or RESOURCE_EXHAUSTED if its response would exceed `limits`.
absl::StatusOr<AttendWork> ValidateAttendRequest(
    const v1::AttendRequest& request, const RequestLimits& limits);

// Checks projection weights (inline in a request, or being registered) and
// returns the dimensions they imply. `field` prefixes every field name
// ("weights").
absl::StatusOr<WeightsShape> ValidateProjectionWeights(
    const v1::ProjectionWeights& weights, const std::string& field);

// Returns the work a MultiHeadAttention request describes against weights of
// `weights_shape`
// (`weights_origin` names them in messages: "weights" or "weights 'demo'").
absl::StatusOr<MultiHeadWork> ValidateMultiHeadRequest(
    const v1::MultiHeadAttentionRequest& request,
    const WeightsShape& weights_shape, const std::string& weights_origin,
    const RequestLimits& limits);

// A registered weights name: 1 to 128 characters of [A-Za-z0-9._-].
absl::Status ValidateWeightsName(const std::string& field,
                                 const std::string& name);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_REQUEST_VALIDATOR_H_
