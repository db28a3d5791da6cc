#include "internal/bf16_buffer.h"

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace attnserve::internal {
namespace {

// Float32ToBFloat16 without branches (a NaN made quiet, every other value
// rounded to nearest even), inline so that the loops below vectorize.
inline uint16_t Bf16Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet
                                                                  : rounded);
}

inline float RoundedToBf16(float value) {
  const uint32_t bits = uint32_t{Bf16Bits(value)} << 16;
  float rounded;
  std::memcpy(&rounded, &bits, sizeof(rounded));
  return rounded;
}

}  // namespace

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
        const int64_t step = strides[3];
        if (as_bf16) {
          for (int64_t i3 = 0; i3 < d3; ++i3) {
            bf16[at + i3] = Bf16Bits(row[i3 * step]);
          }
        } else {
          for (int64_t i3 = 0; i3 < d3; ++i3) {
            rounded[at + i3] = RoundedToBf16(row[i3 * step]);
          }
        }
      }
    }
  }
  return buffer;
}

}  // namespace attnserve::internal
