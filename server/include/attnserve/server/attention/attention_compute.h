// The compute of validated attention requests: request tensors in, response
// tensors out. Runs on a compute executor; the engine does the arithmetic.
#ifndef ATTNSERVE_SERVER_ATTENTION_ATTENTION_COMPUTE_H_
#define ATTNSERVE_SERVER_ATTENTION_ATTENTION_COMPUTE_H_

#include "absl/status/status.h"
#include "attnserve/core/attention_engine.h"
#include "attnserve/server/attention/request_validator.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// Whether ComputeAttend, for a call it does not hand to AttendHalf
// (AttendWork::inputs_in_place), reads `request`'s keys and values in place, in
// their dtype (AttentionEngine::AttendDecode): a decode the engine takes that
// way (DecodeReadsInPlace: Lq = 1, no mask tensor, no weights, no top-left
// causal mask) over BFLOAT16 or FLOAT16 keys and values. Any other call's
// half-precision tensors are widened to f32 copies first, as are those of
// small calls batched together (AttendBatch).
bool AttendReadsKeysInPlace(const AttentionEngine& engine,
                            const AttendWork& work,
                            const v1::AttendRequest& request);

// Computes `request`, validated into `work`, into `response` (output, and
// weights and lse when asked); `stop` may end it early with its error. Errors
// are the engine's.
absl::Status ComputeAttend(AttentionEngine& engine, const AttendWork& work,
                           const v1::AttendRequest& request,
                           const StopCheck& stop, v1::AttendResponse* response);

// Computes a validated MultiHeadAttention `request` with `weights` into
// `response`; `stop` as for ComputeAttend.
absl::Status ComputeMultiHead(AttentionEngine& engine,
                              const MultiHeadWork& work,
                              const ProjectionWeights& weights,
                              const v1::MultiHeadAttentionRequest& request,
                              const StopCheck& stop,
                              v1::MultiHeadAttentionResponse* response);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_ATTENTION_COMPUTE_H_
