// Rotary position embedding (RoPE), as Llama, GPT-J and GPT-NeoX apply it to
// the projected queries and keys: each head's first rotary_dim features are
// taken as rotary_dim / 2 pairs, and pair m of a token at position p turns by
// the angle p · theta^(−2m / rotary_dim):
//
//   (x, y) → (x · cos − y · sin, x · sin + y · cos)
//
// Pairs are (2m, 2m + 1) when interleaved (GPT-J) and (m, m + rotary_dim / 2)
// otherwise (GPT-NeoX, Llama as Hugging Face ships it). Features past
// rotary_dim are left as they are.
#ifndef ATTNSERVE_CORE_ROTARY_H_
#define ATTNSERVE_CORE_ROTARY_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace attnserve {

struct RotaryEmbedding {
  float theta = 10000.0f;  // The base; finite and > 1.
  int64_t rotary_dim = 0;  // Even, 2 to the head dim; 0: the whole head.
  bool interleaved = false;
};

// The largest position RoPE takes: past 2^31, an f32 angle keeps no digit
// of the lower pairs' turns.
inline constexpr int64_t kMaxRotaryPosition = (int64_t{1} << 31) - 1;

// INVALID_ARGUMENT naming `field` unless `rope` fits heads of `head_dim`.
absl::Status ValidateRotary(const RotaryEmbedding& rope, int64_t head_dim,
                            const char* field);

// Rotates `rows` rows of `heads` heads of `head_dim` floats in place: row r
// starts at data + r · row_stride, its head h at + h · head_dim, and stands at
// position first_position + r, or positions[r] when positions is not empty
// (each in [0, kMaxRotaryPosition]). Computed in double, rounded once.
void ApplyRotary(const RotaryEmbedding& rope, int64_t head_dim, int64_t heads,
                 float* data, int64_t rows, int64_t row_stride,
                 int64_t first_position,
                 absl::Span<const int64_t> positions = {});

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_ROTARY_H_
