// The checks of projection weights, inline in a MultiHeadAttention request or
// being registered, and of the names they are registered under. Every error
// names the field and says what was expected and what arrived.
#ifndef ATTNSERVE_SERVER_WEIGHTS_WEIGHTS_VALIDATOR_H_
#define ATTNSERVE_SERVER_WEIGHTS_WEIGHTS_VALIDATOR_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// The dimensions a set of projection weights implies.
struct WeightsShape {
  int64_t
      embed_dim = 0,
      kv_embed_dim = 0, heads = 0, kv_heads = 0, key_dim = 0,
      value_dim =
          0;  // Whether they carry RoPE (weights.rope), which positions need.
  bool rope = false;
};

// Checks projection weights and returns the dimensions they imply. `field`
// prefixes every field name ("weights").
absl::StatusOr<WeightsShape> ValidateProjectionWeights(
    const v1::ProjectionWeights& weights, const std::string& field);

// A registered weights name: 1 to 128 characters of [A-Za-z0-9._-].
absl::Status ValidateWeightsName(const std::string& field,
                                 const std::string& name);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_WEIGHTS_WEIGHTS_VALIDATOR_H_
