#include "internal/bf16_buffer.h"

#include <cstddef>

#include "attnserve/common/dtype.h"

namespace attnserve::internal {

Bf16Buffer Bf16Buffer::Pack(const float* source, int64_t d0, int64_t d1,
                            int64_t d2, int64_t d3,
                            const std::array<int64_t, 4>& strides,
                            MatmulInput input) {
  Bf16Buffer buffer;
  const bool as_bf16 = input == MatmulInput::kBf16;
  const size_t elements = static_cast<size_t>(d0 * d1 * d2 * d3);
  if (as_bf16) {
    buffer.bf16_.resize(elements);
  } else {
    buffer.rounded_.resize(elements);
  }
  uint16_t* bf16 = buffer.bf16_.data();
  float* rounded = buffer.rounded_.data();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t i0 = 0; i0 < d0; ++i0) {
    for (int64_t i1 = 0; i1 < d1; ++i1) {
      for (int64_t i2 = 0; i2 < d2; ++i2) {
        const float* row =
            source + i0 * strides[0] + i1 * strides[1] + i2 * strides[2];
        const int64_t at = ((i0 * d1 + i1) * d2 + i2) * d3;
        for (int64_t i3 = 0; i3 < d3; ++i3) {
          const uint16_t value = Float32ToBFloat16(row[i3 * strides[3]]);
          if (as_bf16) {
            bf16[at + i3] = value;
          } else {
            rounded[at + i3] = BFloat16ToFloat32(value);
          }
        }
      }
    }
  }
  return buffer;
}

}  // namespace attnserve::internal
