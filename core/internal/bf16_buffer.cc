#include "internal/bf16_buffer.h"

#include <cstddef>

#include "attnserve/common/dtype.h"

namespace attnserve::internal {

Bf16Buffer Bf16Buffer::Pack(const float* source, int64_t d0, int64_t d1,
                            int64_t d2, int64_t d3,
                            const std::array<int64_t, 4>& strides) {
  Bf16Buffer buffer;
  buffer.values_.resize(static_cast<size_t>(d0 * d1 * d2 * d3));
  uint16_t* out = buffer.values_.data();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t i0 = 0; i0 < d0; ++i0) {
    for (int64_t i1 = 0; i1 < d1; ++i1) {
      for (int64_t i2 = 0; i2 < d2; ++i2) {
        const float* row =
            source + i0 * strides[0] + i1 * strides[1] + i2 * strides[2];
        uint16_t* packed = out + ((i0 * d1 + i1) * d2 + i2) * d3;
        for (int64_t i3 = 0; i3 < d3; ++i3)
          packed[i3] = Float32ToBFloat16(row[i3 * strides[3]]);
      }
    }
  }
  return buffer;
}

}  // namespace attnserve::internal
