// The config.txt of a weights folder (docs/api.md, "Weights registry"): one
// key=value a line, `num_heads=H` and optionally `num_kv_heads=Hkv`,
// `version=N` and RoPE's `rope_theta=T` (an integer; absent: no RoPE),
// `rotary_dim=R` and `rope_interleaved=0|1`; blank lines and lines starting
// with '#' are ignored. Read by the
// server's
// --weights_dir loader and by `attnctl weights put`.
#ifndef ATTNSERVE_COMMON_WEIGHTS_CONFIG_H_
#define ATTNSERVE_COMMON_WEIGHTS_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace attnserve {

// The largest version a folder may give: the registry counts its puts' versions
// on from the largest it holds, and 2^62 leaves that count room.
inline constexpr int64_t kMaxWeightsVersion = int64_t{1} << 62;

struct WeightsConfig {
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;  // 0: the same as num_heads.
  // The version the server registers the set under (positive); 0: none given,
  // the server derives one from the set's contents.
  int64_t version = 0;
  // RoPE (v1::RotaryEmbedding): rope_theta 0 means none.
  int64_t rope_theta = 0;
  int64_t rotary_dim = 0;
  bool rope_interleaved = false;
};

// Reads the file at `path`. NOT_FOUND if it is missing; INVALID_ARGUMENT,
// naming the file and the line, for a line that is not key=integer or an
// unknown key. The values themselves are checked where the weights are
// (ValidateProjectionWeights).
absl::StatusOr<WeightsConfig> ReadWeightsConfig(const std::string& path);

}  // namespace attnserve

#endif  // ATTNSERVE_COMMON_WEIGHTS_CONFIG_H_
