// Attend and MultiHeadAttention requests built from attnctl's flags: inputs
// from .npy files or random values (--demo, the shape flags, --seed,
// --input_dtype), and every AttentionOptions field as a flag.
//
// The functions here read flags, and files the flags name; they make no calls.
#ifndef ATTNSERVE_CLIENT_ATTNCTL_REQUEST_FLAGS_H_
#define ATTNSERVE_CLIENT_ATTNCTL_REQUEST_FLAGS_H_

#include "absl/status/statusor.h"
#include "attnserve/client/session.h"
#include "attnserve/v1/attention.pb.h"
#include "tensor_io.h"

namespace attnserve {

// Where a command takes its inputs from when no input file is named.
enum class InputMode {
  // .npy files, or random values with --demo; one of them is required.
  kFilesOrDemo,
  // .npy files if named, else random values (bench).
  kFilesOrRandom,
};

// How .npy inputs are read: --bf16_as_uint16, and files up to
// MaxInputFileBytes().
TensorReadOptions InputReadOptions();

// --scale, --causal, --causal_alignment, --key_lengths, --attn_mask (a .npy
// file: float or bool), --return_weights, --return_lse, --precision,
// --output_dtype. INVALID_ARGUMENT naming the flag for a value that does not
// parse, and the file's error for a mask that cannot be read.
absl::StatusOr<v1::AttentionOptions> AttentionOptionsFromFlags();

// An Attend request: query, key and value from --query, --key, --value, or
// random [B, H, Lq, Dk], [B, Hkv, Lk, Dk], [B, Hkv, Lk, Dv] values in
// --input_dtype (uniform in [-1, 1) from --seed); options from the flags.
// INVALID_ARGUMENT for a missing or mixed input source or a dimension outside
// [1, 2^20].
absl::StatusOr<v1::AttendRequest> AttendRequestFromFlags(InputMode mode);

// A MultiHeadAttention request as the flags describe it, before any call.
struct MultiHeadDraft {
  // Weights (inline from --weights_dir, or --weights_name, "demo" by
  // default), options, and the inputs if they come from files.
  v1::MultiHeadAttentionRequest request;
  // The inputs are to be random: call AddRandomMultiHeadInputs once the
  // weights' dimensions are known.
  bool needs_random_inputs = false;
};

// --query_input [--kv_input], or random inputs; --weights_name or
// --weights_dir; options from the flags. INVALID_ARGUMENT for a missing or
// mixed input or weights source.
absl::StatusOr<MultiHeadDraft> MultiHeadDraftFromFlags(InputMode mode);

// Sets random inputs for weights of dimensions `weights`: query_input
// [B, Lq, E], and kv_input [B, Lk, Ekv] when Ekv differs from E (otherwise
// self-attention), in --input_dtype from --seed. INVALID_ARGUMENT for a
// dimension outside [1, 2^20].
absl::Status AddRandomMultiHeadInputs(const v1::WeightsInfo& weights,
                                      v1::MultiHeadAttentionRequest* request);

// KV-cache sessions.

// A CreateSession request: --layers, --heads (H), --kv_heads, --key_dim,
// --value_dim, --cache_dtype, --max_tokens, --ttl, and --scale as the
// session's default. INVALID_ARGUMENT for a value that does not parse or a
// dimension outside [1, 2^20].
absl::StatusOr<v1::CreateSessionRequest> CreateSessionRequestFromFlags();

// --ttl in whole seconds (0: unset). INVALID_ARGUMENT for a negative or
// fractional one.
absl::StatusOr<int64_t> TtlSecondsFromFlags();

// The options of a step: --scale, --precision, --return_lse,
// --output_dtype.
absl::StatusOr<v1::StepOptions> StepOptionsFromFlags();

// One step of the session `info` describes, on --layer: key and value from
// --key and --value ([Hkv, T, Dk], [Hkv, T, Dv]) and the query from --query
// ([H, Tq, Dk]), any of them absent; or random ones (--demo) of --tokens
// tokens (0: append nothing) and --query_tokens query rows (0: no query),
// in --input_dtype from --seed. Options from StepOptionsFromFlags.
absl::StatusOr<StepInputs> StepInputsFromFlags(const v1::SessionInfo& info);

// `tokens` random tokens' keys [Hkv, T, Dk] and values [Hkv, T, Dv] and
// `query_tokens` query rows [H, Tq, Dk] for the session `info` describes
// (no query for 0), in --input_dtype drawn from `seed`, options from
// StepOptionsFromFlags: what bench --rpc=step sends.
absl::StatusOr<StepInputs> RandomStepInputs(const v1::SessionInfo& info,
                                            int64_t layer, int64_t tokens,
                                            int64_t query_tokens,
                                            uint64_t seed);

// The stateless twin of a decode step over `batch` sessions that `info`
// describes: an Attend request with query [B, H, 1, Dk], key [B, Hkv, key_len,
// Dk] and value [B, Hkv, key_len, Dv], random in --input_dtype from `seed`,
// with the options of StepOptionsFromFlags. INVALID_ARGUMENT if a tensor would
// not fit in
// --max_message_bytes.
absl::StatusOr<v1::AttendRequest> RandomDecodeAttendRequest(
    const v1::SessionInfo& info, int64_t batch, int64_t key_len, uint64_t seed);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTNCTL_REQUEST_FLAGS_H_
