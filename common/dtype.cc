#include "attnserve/common/dtype.h"

#include <cstring>

namespace attnserve {
namespace {

uint32_t BitsOf(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

float FloatOf(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

}  // namespace

int64_t DataTypeBytes(DataType type) {
  return type == DataType::kFloat32 ? 4 : 2;
}

uint16_t Float32ToBFloat16(float value) {
  const uint32_t bits = BitsOf(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((bits >> 16) |
                                 0x0040u);  // Quiet NaN, sign kept.
  }
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float BFloat16ToFloat32(uint16_t bits) { return FloatOf(uint32_t{bits} << 16); }

uint16_t Float32ToFloat16(float value) {
  const uint32_t bits = BitsOf(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u)
    return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (magnitude >= 0x477ff000u)
    return static_cast<uint16_t>(sign | 0x7c00u);  // ≥ 65520: inf
  if (magnitude < 0x38800000u) {
    // Below the smallest normal half (2^-14): a subnormal half, rounded to
    // nearest even by letting the FPU add the value to 0.5 (whose ulp is the
    // half subnormal step, 2^-24).
    const float shifted = FloatOf(magnitude) + 0.5f;
    return static_cast<uint16_t>(sign | (BitsOf(shifted) - BitsOf(0.5f)));
  }
  // Normal: rebias the exponent (127 → 15) and round the mantissa from 23 to 10
  // bits.
  const uint32_t odd = (magnitude >> 13) & 1u;
  const uint32_t rounded = magnitude + 0xfffu + odd - (uint32_t{112} << 23);
  return static_cast<uint16_t>(sign | (rounded >> 13));
}

float Float16ToFloat32(uint16_t half) {
  const uint32_t sign = uint32_t{half & 0x8000u} << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0x1f)
    return FloatOf(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent == 0) {
    // Zero or subnormal: mantissa · 2^-24, exact in f32.
    const float value = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    return FloatOf(sign | BitsOf(value));
  }
  return FloatOf(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

void ConvertToFloat32(DataType type, const void* source, int64_t count,
                      float* destination) {
  if (type == DataType::kFloat32) {
    std::memcpy(destination, source,
                static_cast<size_t>(count) * sizeof(float));
    return;
  }
  const auto* bytes = static_cast<const unsigned char*>(source);
  for (int64_t i = 0; i < count; ++i) {
    uint16_t bits;
    std::memcpy(&bits, bytes + 2 * i, sizeof(bits));
    destination[i] = type == DataType::kBFloat16 ? BFloat16ToFloat32(bits)
                                                 : Float16ToFloat32(bits);
  }
}

void ConvertFromFloat32(const float* source, int64_t count, DataType type,
                        void* destination) {
  if (type == DataType::kFloat32) {
    std::memcpy(destination, source,
                static_cast<size_t>(count) * sizeof(float));
    return;
  }
  auto* bytes = static_cast<unsigned char*>(destination);
  for (int64_t i = 0; i < count; ++i) {
    const uint16_t bits = type == DataType::kBFloat16
                              ? Float32ToBFloat16(source[i])
                              : Float32ToFloat16(source[i]);
    std::memcpy(bytes + 2 * i, &bits, sizeof(bits));
  }
}

}  // namespace attnserve
