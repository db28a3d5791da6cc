// Attend and MultiHeadAttention requests built from attnctl's flags: inputs
// from .npy files or random values (--demo, the shape flags, --seed,
// --input_dtype), and every AttentionOptions field as a flag.
//
// The functions here read flags, and files the flags name; they make no calls.
#ifndef ATTNSERVE_CLIENT_ATTNCTL_REQUEST_FLAGS_H_
#define ATTNSERVE_CLIENT_ATTNCTL_REQUEST_FLAGS_H_

#include "absl/status/statusor.h"
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

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTNCTL_REQUEST_FLAGS_H_
