// exp(x) for x ≤ 0, in plain C++ that compilers vectorise: the softmax of
// the unfused score pass and the portable fused kernels share it.
#ifndef ATTNSERVE_CORE_INTERNAL_FAST_EXP_H_
#define ATTNSERVE_CORE_INTERNAL_FAST_EXP_H_

#include <cstdint>
#include <cstring>

namespace attnserve::internal {

// Cody–Waite's ln 2 in two parts, the rounding constant and Cephes'
// polynomial, for ExpNonPositive and the vector code that computes it
// several lanes at a time (internal/paged_attention.cc).
inline constexpr float kExpLog2e = 1.44269504088896341f;
// 1.5·2^23: adding it rounds to an integer.
inline constexpr float kExpRoundMagic = 12582912.0f;
inline constexpr float kExpLn2High = 0.693359375f;
inline constexpr float kExpLn2Low = -2.12194440e-4f;
// Below it exp is subnormal in f32, and flushed to 0.
inline constexpr float kExpLowest = -87.3f;

// exp(r) − for |r| ≤ ln2/2, given n − as p(r), before the scaling by 2^n.
// `F` is float or a vector of floats (GCC/Clang vector extensions).
template <typename F>
inline F ExpPolynomial(F r) {
  F p = r * 0.0f + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) for the shifted scores x = s − max ≤ 0 (NaN passes through), written
// so that the compiler vectorises the loop around it: Cody–Waite reduction x =
// n·ln2 + r, |r| ≤ ln2/2, Cephes' degree-6 polynomial for exp(r) (relative
// error below 2e-7), then 2^n through the exponent bits. Below −87.3 the result
// would be subnormal; it is flushed to 0, as −inf is.
inline float ExpNonPositive(float x) {
  // NaN, like x below −87.3, computes exp(−87.3) below (keeping the integer
  // conversion defined) and is put back at the end.
  const float clamped = x >= kExpLowest ? x : kExpLowest;
  const float n = (clamped * kExpLog2e + kExpRoundMagic) - kExpRoundMagic;
  const float r = clamped - n * kExpLn2High - n * kExpLn2Low;
  const float p = ExpPolynomial(r);
  const int32_t exponent_bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent_bits, sizeof(scale));
  return x >= kExpLowest ? p * scale : (x != x ? x : 0.0f);
}

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_FAST_EXP_H_
