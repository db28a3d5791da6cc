#include "internal/tile_kernels.h"

// GCC 12 reports the deliberately undefined pass-through operand of its own
// AVX-512 intrinsics (_mm512_undefined_*) as uninitialised once they inline
// into a function with a target attribute (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attnserve/common/dtype.h"
#include "internal/fast_exp.h"

namespace attnserve::internal {
namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// What a block did to a row's state, given the block's largest score.
// Returns the factor for the accumulated output, and sets *shift to the max
// the block's probabilities subtract (−inf: the row has seen no key yet, and
// every probability of the block is 0).
float AdvanceMax(float block_max, RowState* state, float* shift) {
  // A score of +inf makes the row NaN, as exp(inf − inf) is (IEEE, and the
  // unfused path); its probability would otherwise come out 1.
  if (block_max == -kNegativeInfinity) state->nan = true;
  const float new_max = std::max(state->max, block_max);
  *shift = new_max;
  if (new_max == kNegativeInfinity) return 1.0f;
  const float alpha = state->max == kNegativeInfinity
                          ? 0.0f
                          : ExpNonPositive(state->max - new_max);
  state->max = new_max;
  state->sum *= alpha;
  return alpha;
}

// ---------------------------------------------------------------- portable

float SoftmaxBlockPortable(float* s, int64_t n, int64_t visible, float scale,
                           const RowMask& mask, RowState* state,
                           uint16_t* p16) {
  float block_max = kNegativeInfinity;
  for (int64_t j = 0; j < n; ++j) {
    float x = kNegativeInfinity;
    if (j < visible) {
      x = s[j] * scale;
      if (mask.bias != nullptr) x += mask.bias[j * mask.bias_stride];
      if (mask.allowed != nullptr && mask.allowed[j * mask.allowed_stride] == 0)
        x = kNegativeInfinity;
    }
    if (x != x) state->nan = true;
    block_max = std::max(block_max, x);
    s[j] = x;
  }
  float shift;
  const float alpha = AdvanceMax(block_max, state, &shift);
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float p =
        shift == kNegativeInfinity ? 0.0f : ExpNonPositive(s[j] - shift);
    sum += p;
    if (p16 != nullptr) {
      p16[j] = Float32ToBFloat16(p);
    } else {
      s[j] = p;
    }
  }
  state->sum += sum;
  return alpha;
}

template <typename KeyLoad>
void SmallScoresPortable(const float* q, int64_t m, int64_t d_len, int64_t n,
                         float* s, int64_t lds, KeyLoad key) {
  for (int64_t r = 0; r < m; ++r) {
    const float* q_row = q + r * d_len;
    for (int64_t j = 0; j < n; ++j) {
      float dot = 0.0f;
      for (int64_t d = 0; d < d_len; ++d) dot += q_row[d] * key(j * d_len + d);
      s[r * lds + j] = dot;
    }
  }
}

void SmallScoresF32Portable(const float* q, int64_t m, int64_t d_len,
                            const float* k, int64_t n, float* s, int64_t lds) {
  SmallScoresPortable(q, m, d_len, n, s, lds, [k](int64_t i) { return k[i]; });
}

// x rounded to bf16 and back.
float RoundToBf16(float x) { return BFloat16ToFloat32(Float32ToBFloat16(x)); }

void SmallScoresBf16Portable(const float* q, int64_t m, int64_t d_len,
                             const float* k, int64_t n, float* s, int64_t lds) {
  SmallScoresPortable(q, m, d_len, n, s, lds,
                      [k](int64_t i) { return RoundToBf16(k[i]); });
}

template <typename ValueLoad>
void SmallAccumulatePortable(const float* p, int64_t ldp, int64_t m, int64_t n,
                             int64_t dv, float* o, ValueLoad value) {
  for (int64_t r = 0; r < m; ++r) {
    float* o_row = o + r * dv;
    for (int64_t j = 0; j < n; ++j) {
      const float weight = p[r * ldp + j];
      if (weight == 0.0f) continue;
      for (int64_t c = 0; c < dv; ++c) o_row[c] += weight * value(j * dv + c);
    }
  }
}

void SmallAccumulateF32Portable(const float* p, int64_t ldp, int64_t m,
                                int64_t n, const float* v, int64_t dv,
                                float* o) {
  SmallAccumulatePortable(p, ldp, m, n, dv, o, [v](int64_t i) { return v[i]; });
}

void SmallAccumulateBf16Portable(const float* p, int64_t ldp, int64_t m,
                                 int64_t n, const float* v, int64_t dv,
                                 float* o) {
  SmallAccumulatePortable(p, ldp, m, n, dv, o,
                          [v](int64_t i) { return RoundToBf16(v[i]); });
}

void ToBf16Portable(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Float32ToBFloat16(src[i]);
}

void Bf16ToF32Portable(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = BFloat16ToFloat32(src[i]);
}

void F16ToF32Portable(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Float16ToFloat32(src[i]);
}

// An element is not finite when its exponent bits are all set.
template <typename Bits>
bool AnyNonFinitePortable(const Bits* v, int64_t rows, int64_t dim,
                          int64_t stride, Bits exponent) {
  for (int64_t j = 0; j < rows; ++j) {
    const Bits* row = v + j * stride;
    for (int64_t c = 0; c < dim; ++c) {
      if ((row[c] & exponent) == exponent) return true;
    }
  }
  return false;
}

bool AnyNonFiniteF32Portable(const float* v, int64_t rows, int64_t dim,
                             int64_t stride) {
  return AnyNonFinitePortable(reinterpret_cast<const uint32_t*>(v), rows, dim,
                              stride, uint32_t{0x7f800000});
}

bool AnyNonFiniteBf16Portable(const uint16_t* v, int64_t rows, int64_t dim,
                              int64_t stride) {
  return AnyNonFinitePortable(v, rows, dim, stride, uint16_t{0x7f80});
}

// ----------------------------------------------------------------- AVX-512

#define ATTNSERVE_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

// Lanes [0, count) of a 16-lane vector, count clamped to [0, 16].
ATTNSERVE_AVX512 inline __mmask16 FirstLanes(int64_t count) {
  if (count >= 16) return 0xffff;
  if (count <= 0) return 0;
  return static_cast<__mmask16>((1u << count) - 1);
}

// ExpNonPositive on 16 lanes, with FMA and the exponent applied by scalef;
// x below −87.3 (a masked key's −inf among them) gives exactly 0.
ATTNSERVE_AVX512 inline __m512 Exp512(__m512 x) {
  const __m512 floor = _mm512_set1_ps(-87.3f);
  const __m512 clamped = _mm512_max_ps(x, floor);
  const __m512 n = _mm512_roundscale_ps(
      _mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, floor, _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow),
                             _mm512_scalef_ps(p, n));
}

// 2^x on 16 lanes for any x (−inf excepted): x = n + r with n an integer and
// |r| ≤ 1/2, 2^r by its degree-6 Taylor polynomial (relative error below
// 1.3e-7), 2^n by scalef, which gives 0 once n is below the subnormals.
ATTNSERVE_AVX512 inline __m512 Exp2_512(__m512 x) {
  const __m512 n =
      _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558146e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 2^x on 16 lanes as Exp2_512, but with a degree-3 polynomial (relative error
// below 1.1e-4, a twentieth of bf16's rounding): for the probabilities the
// bf16 tiles round to bf16 before P·V reads them.
ATTNSERVE_AVX512 inline __m512 Exp2Bf16_512(__m512 x) {
  const __m512 n =
      _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(5.5008929223e-2f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4221102893e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9328296185e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// bf16 bits of 16 finite floats, rounded to nearest even.
ATTNSERVE_AVX512 inline __m256i ToBf16x16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd =
      _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// 16 floats rounded to bf16 (nearest even) and widened back, for the decode
// tiles of bf16 precision, which read f32 keys and values once rather than
// packing them first. Finite inputs only matter: a NaN stays a NaN.
ATTNSERVE_AVX512 inline __m512 LoadRoundedBf16x16(const float* p,
                                                  __mmask16 lanes) {
  const __m512i bits = _mm512_castps_si512(_mm512_maskz_loadu_ps(lanes, p));
  const __m512i odd =
      _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(
      rounded, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

ATTNSERVE_AVX512 inline __m512 LoadF32x16(const float* p, __mmask16 lanes) {
  return _mm512_maskz_loadu_ps(lanes, p);
}

// Writes 16 probabilities at key j as f32 over the scores s, or as bf16 to
// p16 if it is not null.
// The AVX-512 softmax's own target: AVX512_BF16 on top, used only by its
// kCvtBf16 instantiation, which runs only where the CPU has it.
#define ATTNSERVE_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")))

// Stores probabilities: as bf16 to p16 if given (by AVX512_BF16's
// VCVTNEPS2BF16 if kCvtBf16, which rounds to nearest even as ToBf16x16 does),
// else as f32 over the scores.
template <bool kCvtBf16>
ATTNSERVE_AVX512_BF16 inline void StoreProbabilities(float* s, uint16_t* p16,
                                                     int64_t j, __mmask16 lanes,
                                                     __m512 p) {
  if (p16 == nullptr && lanes == 0xffff) {
    _mm512_storeu_ps(s + j, p);
  } else if (p16 == nullptr) {
    _mm512_mask_storeu_ps(s + j, lanes, p);
  } else if constexpr (kCvtBf16) {
    _mm256_mask_storeu_epi16(p16 + j, lanes,
                             reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
  } else {
    _mm256_mask_storeu_epi16(p16 + j, lanes, ToBf16x16(p));
  }
}

// Writes 32 probabilities at key j, p0 then p1, as StoreProbabilities does:
// two bf16 halves by one VCVTNE2PS2BF16 where the CPU has it.
template <bool kCvtBf16>
ATTNSERVE_AVX512_BF16 inline void StoreProbabilityPair(float* s, uint16_t* p16,
                                                       int64_t j, __m512 p0,
                                                       __m512 p1) {
  if (p16 == nullptr) {
    _mm512_storeu_ps(s + j, p0);
    _mm512_storeu_ps(s + j + 16, p1);
  } else if constexpr (kCvtBf16) {
    _mm512_storeu_si512(p16 + j,
                        reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p16 + j), ToBf16x16(p0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p16 + j + 16),
                        ToBf16x16(p1));
  }
}

// The probabilities 2^(s·scale2 − shift2) of a block whose keys are all
// visible, stored as StoreProbabilities does; returns their lane sums. The
// exponent is Exp2Bf16_512 if kBf16Exp (bf16 probabilities), else Exp2_512.
// Whole pairs of vectors run unmasked with a sum each (masked operations, and
// one sum's chain of additions, cost a third of the time on a Zen 5).
template <bool kCvtBf16, bool kBf16Exp>
ATTNSERVE_AVX512_BF16 inline __m512 PlainProbabilities(float* s, int64_t n,
                                                       __m512 scale2,
                                                       __m512 shift2,
                                                       uint16_t* p16) {
  __m512 sum0 = _mm512_setzero_ps();
  __m512 sum1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 x0 = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), scale2, shift2);
    const __m512 x1 =
        _mm512_fmsub_ps(_mm512_loadu_ps(s + j + 16), scale2, shift2);
    const __m512 p0 = kBf16Exp ? Exp2Bf16_512(x0) : Exp2_512(x0);
    const __m512 p1 = kBf16Exp ? Exp2Bf16_512(x1) : Exp2_512(x1);
    sum0 = _mm512_add_ps(sum0, p0);
    sum1 = _mm512_add_ps(sum1, p1);
    StoreProbabilityPair<kCvtBf16>(s, p16, j, p0, p1);
  }
  for (; j < n; j += 16) {
    const __mmask16 lanes = FirstLanes(n - j);
    const __m512 x =
        _mm512_fmsub_ps(_mm512_maskz_loadu_ps(lanes, s + j), scale2, shift2);
    const __m512 p = kBf16Exp ? Exp2Bf16_512(x) : Exp2_512(x);
    sum0 = _mm512_mask_add_ps(sum0, lanes, sum0, p);
    StoreProbabilities<kCvtBf16>(s, p16, j, lanes, p);
  }
  return _mm512_add_ps(sum0, sum1);
}

// How far, in powers of two, a later block's probabilities may exceed 1
// before the row's shift is raised (LaterPlainBlock).
constexpr float kLazyShiftLimit = 8.0f;

// The scaled scores (natural units) up to which a block's exponents may be
// one FMA of the raw score against a rounded shift (PlainProbabilities,
// LaterPlainBlock): the two roundings differ by at most about 3 ulps of the
// shift in powers of two, 2^21 · log2(e) · 3 · 2^-24 ≈ 0.54 at the bound, and
// a whole power of two added to such a shift is exact. Real scores are far
// below it; past it (scale 1e9, an audit's) the max's 2^x had overflowed.
constexpr float kLargeScaledScore = 2097152.0f;  // 2^21

// A later block's running state (LaterPlainBlock): the shift in powers of
// two, the probabilities' two lane sums, and the factor of the row's output.
struct LaterBlockState {
  __m512 shift2;
  __m512 sum0;
  __m512 sum1;
  float alpha;
};

// Scales the probabilities a later block has written before key j (f32 over
// the scores, or bf16 to p16) by `factor`, as its shift is raised.
inline void ScaleWrittenProbabilities(float* s, uint16_t* p16, int64_t j,
                                      float factor) {
  for (int64_t k = 0; k < j; ++k) {
    if (p16 == nullptr) {
      s[k] *= factor;
    } else {
      p16[k] = Float32ToBFloat16(BFloat16ToFloat32(p16[k]) * factor);
    }
  }
}

// How RaiseShift left a later block.
enum class Raised {
  kRaised,  // The shift is raised; the block goes on with its FMA exponents.
  kNaN,     // A score of +inf: the row is NaN, the block's probabilities 0.
  kHuge,    // The rest of the block is written (FinishHugeBlock).
};

// The rest of a later block, from key j, whose largest score is past
// kLargeScaledScore: the FMA exponents against a shift that large lose more
// than a power of two, so the rest takes the masked blocks' exponents, the
// rounded scaled scores less their rounded max (exactly 0 for the max). The
// probabilities before j, the sums and the row's state scale to that max.
template <bool kCvtBf16>
ATTNSERVE_AVX512_BF16 void FinishHugeBlock(float* s, int64_t n, int64_t j,
                                           float scale, RowState* state,
                                           uint16_t* p16,
                                           LaterBlockState* block) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 high = _mm512_set1_ps(kNegativeInfinity);
  __mmask16 nan_lanes = 0;
  for (int64_t k = j; k < n; k += 16) {
    const __mmask16 rest = FirstLanes(n - k);
    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(rest, s + k), scale_v);
    const __mmask16 ordered = _mm512_mask_cmp_ps_mask(rest, x, x, _CMP_ORD_Q);
    nan_lanes |= rest & ~ordered;
    high = _mm512_mask_max_ps(high, ordered, high, x);
  }
  // Exp512 takes a NaN for the floor: the row is NaN as in the other passes.
  if (nan_lanes != 0) state->nan = true;
  const float new_max = std::max(state->max, _mm512_reduce_max_ps(high));
  const float factor = ExpNonPositive(state->max - new_max);
  ScaleWrittenProbabilities(s, p16, j, factor);
  const __m512 factor_v = _mm512_set1_ps(factor);
  __m512 sum = _mm512_add_ps(_mm512_mul_ps(block->sum0, factor_v),
                             _mm512_mul_ps(block->sum1, factor_v));
  state->sum *= factor;
  state->max = new_max;
  block->alpha *= factor;
  const __m512 shift = _mm512_set1_ps(new_max);
  for (int64_t k = j; k < n; k += 16) {
    const __mmask16 lanes = FirstLanes(n - k);
    const __m512 p = Exp512(_mm512_sub_ps(
        _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, s + k), scale_v), shift));
    sum = _mm512_mask_add_ps(sum, lanes, sum, p);
    StoreProbabilities<kCvtBf16>(s, p16, k, lanes, p);
  }
  block->sum0 = sum;
  block->sum1 = _mm512_setzero_ps();
}

// Raises a later block's shift by the whole powers of two below the largest of
// its scores from key j on (NaNs aside): it stays at most the row's max. The
// probabilities before j, the sums and the row's state scale with it. A score
// of +inf makes the row NaN (as inf − inf is), and the block's probabilities
// are all written as 0. A largest score past kLargeScaledScore has the rest of
// the block written by FinishHugeBlock.
template <bool kCvtBf16>
ATTNSERVE_AVX512_BF16 Raised RaiseShift(float* s, int64_t n, int64_t j,
                                        float scale, __m512 scale2,
                                        RowState* state, uint16_t* p16,
                                        LaterBlockState* block) {
  __m512 high = _mm512_set1_ps(kNegativeInfinity);
  for (int64_t k = j; k < n; k += 16) {
    const __mmask16 rest = FirstLanes(n - k);
    const __m512 y = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(rest, s + k), scale2,
                                     block->shift2);
    high = _mm512_mask_max_ps(
        high, _mm512_mask_cmp_ps_mask(rest, y, y, _CMP_ORD_Q), high, y);
  }
  const float raise = std::floor(_mm512_reduce_max_ps(high));
  if (!std::isfinite(raise)) {
    state->nan = true;
    for (int64_t k = 0; k < n; k += 16) {
      StoreProbabilities<kCvtBf16>(s, p16, k, FirstLanes(n - k),
                                   _mm512_setzero_ps());
    }
    return Raised::kNaN;
  }
  if (!(std::abs(state->max + raise / kExpLog2e) < kLargeScaledScore)) {
    FinishHugeBlock<kCvtBf16>(s, n, j, scale, state, p16, block);
    return Raised::kHuge;
  }
  const float factor =
      raise > 200.0f ? 0.0f : std::ldexp(1.0f, -static_cast<int>(raise));
  ScaleWrittenProbabilities(s, p16, j, factor);
  const __m512 factor_v = _mm512_set1_ps(factor);
  block->sum0 = _mm512_mul_ps(block->sum0, factor_v);
  block->sum1 = _mm512_mul_ps(block->sum1, factor_v);
  state->sum *= factor;
  state->max += raise / kExpLog2e;
  block->alpha *= factor;
  block->shift2 = _mm512_add_ps(block->shift2, _mm512_set1_ps(raise));
  return Raised::kRaised;
}

// A later block of a row (it has a shift) whose keys are all visible and
// unmasked, in one pass: the probabilities are 2^(s·scale2 − shift2) against
// the row's shift so far, which is raised only when a score passes it by more
// than kLazyShiftLimit powers of two (then by a whole power of two, so that
// the probabilities already written, the block's partial sum, the row's sum
// and its output scale exactly). The shift is no longer the row's exact max,
// only within that limit below it: what a shift must be (the probabilities,
// the sum and the output stay far from overflow), and what lse needs (it is
// shift + log(sum) for any shift). A block's max pass, and the rescaling of
// the output for most blocks, are saved. Whole pairs of vectors run unmasked,
// as in PlainProbabilities.
template <bool kCvtBf16, bool kBf16Exp>
ATTNSERVE_AVX512_BF16 float LaterPlainBlock(float* s, int64_t n, float scale,
                                            RowState* state, uint16_t* p16) {
  const __m512 scale2 = _mm512_set1_ps(scale * kExpLog2e);
  const __m512 limit = _mm512_set1_ps(kLazyShiftLimit);
  LaterBlockState block{_mm512_set1_ps(state->max * kExpLog2e),
                        _mm512_setzero_ps(), _mm512_setzero_ps(), 1.0f};
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 raw0 = _mm512_loadu_ps(s + j);
    const __m512 raw1 = _mm512_loadu_ps(s + j + 16);
    __m512 x0 = _mm512_fmsub_ps(raw0, scale2, block.shift2);
    __m512 x1 = _mm512_fmsub_ps(raw1, scale2, block.shift2);
    if ((_mm512_cmp_ps_mask(x0, limit, _CMP_GT_OQ) |
         _mm512_cmp_ps_mask(x1, limit, _CMP_GT_OQ)) != 0) {
      const Raised raised =
          RaiseShift<kCvtBf16>(s, n, j, scale, scale2, state, p16, &block);
      if (raised == Raised::kNaN) return 1.0f;
      if (raised == Raised::kHuge) {
        j = n;  // Every key is written.
        break;
      }
      x0 = _mm512_fmsub_ps(raw0, scale2, block.shift2);
      x1 = _mm512_fmsub_ps(raw1, scale2, block.shift2);
    }
    const __m512 p0 = kBf16Exp ? Exp2Bf16_512(x0) : Exp2_512(x0);
    const __m512 p1 = kBf16Exp ? Exp2Bf16_512(x1) : Exp2_512(x1);
    block.sum0 = _mm512_add_ps(block.sum0, p0);
    block.sum1 = _mm512_add_ps(block.sum1, p1);
    StoreProbabilityPair<kCvtBf16>(s, p16, j, p0, p1);
  }
  for (; j < n; j += 16) {
    const __mmask16 lanes = FirstLanes(n - j);
    const __m512 raw = _mm512_maskz_loadu_ps(lanes, s + j);
    __m512 x = _mm512_fmsub_ps(raw, scale2, block.shift2);
    if (_mm512_mask_cmp_ps_mask(lanes, x, limit, _CMP_GT_OQ) != 0) {
      const Raised raised =
          RaiseShift<kCvtBf16>(s, n, j, scale, scale2, state, p16, &block);
      if (raised == Raised::kNaN) return 1.0f;
      if (raised == Raised::kHuge) break;
      x = _mm512_fmsub_ps(raw, scale2, block.shift2);
    }
    const __m512 p = kBf16Exp ? Exp2Bf16_512(x) : Exp2_512(x);
    block.sum0 = _mm512_mask_add_ps(block.sum0, lanes, block.sum0, p);
    StoreProbabilities<kCvtBf16>(s, p16, j, lanes, p);
  }
  // A NaN score makes its probability, and so the sum, NaN (no other
  // probability is: each is finite, at most 2^kLazyShiftLimit).
  const float sum = _mm512_reduce_add_ps(_mm512_add_ps(block.sum0, block.sum1));
  if (sum != sum) state->nan = true;
  state->sum += sum;
  return block.alpha;
}

template <bool kCvtBf16>
ATTNSERVE_AVX512_BF16 float SoftmaxBlockAvx512(float* s, int64_t n,
                                               int64_t visible, float scale,
                                               const RowMask& mask,
                                               RowState* state, uint16_t* p16) {
  if (mask.bias == nullptr && mask.allowed == nullptr && visible < n) {
    // An unmasked block seen only up to a key (a causal diagonal's rows): the
    // keys past it have probability 0, and those before form a plain block.
    const int64_t seen = std::max<int64_t>(visible, 0);
    const float alpha = seen == 0 ? 1.0f
                                  : SoftmaxBlockAvx512<kCvtBf16>(
                                        s, seen, seen, scale, mask, state, p16);
    for (int64_t j = seen; j < n; j += 16) {
      StoreProbabilities<kCvtBf16>(s, p16, j, FirstLanes(n - j),
                                   _mm512_setzero_ps());
    }
    return alpha;
  }
  const __m512 minus_inf = _mm512_set1_ps(kNegativeInfinity);
  const __m512 scale_v = _mm512_set1_ps(scale);
  __mmask16 nan_lanes = 0;
  float block_max;
  // A block with every key visible and no mask (most blocks): the max of the
  // scaled scores is the scaled max (or min, for a negative scale) of the raw
  // ones, so the first pass only reads. Its exponents are s·scale2 − shift2 in
  // one FMA, the product unrounded and the shift rounded: at scaled scores
  // past kLargeScaledScore they differ by more than a power of two and the
  // max's 2^x could overflow, so such rows take the rounded scores of the
  // masked blocks' pass, whose max subtracts to exactly 0.
  bool plain = mask.bias == nullptr && mask.allowed == nullptr && visible >= n;
  if (plain && state->max != kNegativeInfinity && !state->nan) {
    if (std::abs(state->max) < kLargeScaledScore) {
      return p16 != nullptr
                 ? LaterPlainBlock<kCvtBf16, true>(s, n, scale, state, p16)
                 : LaterPlainBlock<kCvtBf16, false>(s, n, scale, state, p16);
    }
    plain = false;
  }
  if (plain) {
    __m512 high = minus_inf, low = _mm512_set1_ps(-kNegativeInfinity);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 lanes = FirstLanes(n - j);
      const __m512 v = _mm512_maskz_loadu_ps(lanes, s + j);
      high = _mm512_mask_max_ps(high, lanes, high, v);
      low = _mm512_mask_min_ps(low, lanes, low, v);
      nan_lanes |= _mm512_mask_cmp_ps_mask(lanes, v, v, _CMP_UNORD_Q);
    }
    block_max = scale >= 0.0f ? scale * _mm512_reduce_max_ps(high)
                              : scale * _mm512_reduce_min_ps(low);
    // Not below the bound: huge, infinite or NaN (the masked pass sorts
    // those out).
    if (!(std::abs(block_max) < kLargeScaledScore)) plain = false;
  }
  if (!plain) {
    __m512 max_v = minus_inf;
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 lanes = FirstLanes(n - j);
      const __mmask16 seen = FirstLanes(visible - j);
      __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, s + j), scale_v);
      if (mask.bias != nullptr) {
        x = _mm512_add_ps(x, mask.bias_stride == 0
                                 ? _mm512_set1_ps(mask.bias[0])
                                 : _mm512_maskz_loadu_ps(seen, mask.bias + j));
      }
      __mmask16 keep = seen;
      if (mask.allowed != nullptr) {
        if (mask.allowed_stride == 0) {
          if (mask.allowed[0] == 0) keep = 0;
        } else {
          const __m128i bytes = _mm_maskz_loadu_epi8(seen, mask.allowed + j);
          keep &= _mm_test_epi8_mask(bytes, bytes);
        }
      }
      x = _mm512_mask_mov_ps(minus_inf, keep, x);
      nan_lanes |= _mm512_mask_cmp_ps_mask(lanes, x, x, _CMP_UNORD_Q);
      max_v = _mm512_mask_max_ps(max_v, lanes, max_v, x);
      _mm512_mask_storeu_ps(s + j, lanes, x);
    }
    block_max = _mm512_reduce_max_ps(max_v);
  }
  if (nan_lanes != 0) state->nan = true;
  float shift;
  const float alpha = AdvanceMax(block_max, state, &shift);
  __m512 sum_v = _mm512_setzero_ps();
  const __m512 shift_v = _mm512_set1_ps(shift);
  if (shift == kNegativeInfinity) {
    // Nothing seen yet: every probability is 0.
    for (int64_t j = 0; j < n; j += 16) {
      StoreProbabilities<kCvtBf16>(s, p16, j, FirstLanes(n - j),
                                   _mm512_setzero_ps());
    }
  } else if (plain) {
    // exp(scale·s − shift) as 2^(s·scale·log2e − shift·log2e): one FMA
    // before the power of two, and no clamp since every s is finite or NaN.
    const __m512 scale2 = _mm512_set1_ps(scale * kExpLog2e);
    const __m512 shift2 = _mm512_set1_ps(shift * kExpLog2e);
    sum_v =
        p16 != nullptr
            ? PlainProbabilities<kCvtBf16, true>(s, n, scale2, shift2, p16)
            : PlainProbabilities<kCvtBf16, false>(s, n, scale2, shift2, p16);
  } else {
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 lanes = FirstLanes(n - j);
      const __m512 p =
          Exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + j), shift_v));
      sum_v = _mm512_mask_add_ps(sum_v, lanes, sum_v, p);
      StoreProbabilities<kCvtBf16>(s, p16, j, lanes, p);
    }
  }
  state->sum += _mm512_reduce_add_ps(sum_v);
  return alpha;
}

// Scores of m query rows against n keys, four keys at a time so that four
// independent FMA chains hide each other's latency.
template <typename Load, typename Key>
ATTNSERVE_AVX512 inline void SmallScoresAvx512(const float* q, int64_t m,
                                               int64_t d_len, const Key* k,
                                               int64_t n, float* s, int64_t lds,
                                               Load load) {
  for (int64_t r = 0; r < m; ++r) {
    const float* q_row = q + r * d_len;
    float* s_row = s + r * lds;
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(),
             acc2 = _mm512_setzero_ps(), acc3 = _mm512_setzero_ps();
      const Key* k0 = k + j * d_len;
      for (int64_t d = 0; d < d_len; d += 16) {
        const __mmask16 lanes = FirstLanes(d_len - d);
        const __m512 qv = _mm512_maskz_loadu_ps(lanes, q_row + d);
        acc0 = _mm512_fmadd_ps(qv, load(k0 + d, lanes), acc0);
        acc1 = _mm512_fmadd_ps(qv, load(k0 + d_len + d, lanes), acc1);
        acc2 = _mm512_fmadd_ps(qv, load(k0 + 2 * d_len + d, lanes), acc2);
        acc3 = _mm512_fmadd_ps(qv, load(k0 + 3 * d_len + d, lanes), acc3);
      }
      s_row[j] = _mm512_reduce_add_ps(acc0);
      s_row[j + 1] = _mm512_reduce_add_ps(acc1);
      s_row[j + 2] = _mm512_reduce_add_ps(acc2);
      s_row[j + 3] = _mm512_reduce_add_ps(acc3);
    }
    for (; j < n; ++j) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < d_len; d += 16) {
        const __mmask16 lanes = FirstLanes(d_len - d);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, q_row + d),
                              load(k + j * d_len + d, lanes), acc);
      }
      s_row[j] = _mm512_reduce_add_ps(acc);
    }
  }
}

ATTNSERVE_AVX512 void SmallScoresF32Avx512(const float* q, int64_t m,
                                           int64_t d_len, const float* k,
                                           int64_t n, float* s, int64_t lds) {
  SmallScoresAvx512(q, m, d_len, k, n, s, lds, LoadF32x16);
}

ATTNSERVE_AVX512 void SmallScoresBf16Avx512(const float* q, int64_t m,
                                            int64_t d_len, const float* k,
                                            int64_t n, float* s, int64_t lds) {
  SmallScoresAvx512(q, m, d_len, k, n, s, lds, LoadRoundedBf16x16);
}

// Accumulates p · V into up to 128 columns of a row at a time, held in
// registers across the block's keys.
template <typename Load, typename Value>
ATTNSERVE_AVX512 inline void SmallAccumulateAvx512(const float* p, int64_t ldp,
                                                   int64_t m, int64_t n,
                                                   const Value* v, int64_t dv,
                                                   float* o, Load load) {
  constexpr int kVectors = 8;
  for (int64_t r = 0; r < m; ++r) {
    const float* p_row = p + r * ldp;
    for (int64_t c0 = 0; c0 < dv; c0 += 16 * kVectors) {
      __mmask16 lanes[kVectors];
      __m512 acc[kVectors];
#pragma GCC unroll 8
      for (int u = 0; u < kVectors; ++u) {
        lanes[u] = FirstLanes(dv - c0 - 16 * u);
        acc[u] = _mm512_maskz_loadu_ps(lanes[u], o + r * dv + c0 + 16 * u);
      }
      for (int64_t j = 0; j < n; ++j) {
        if (p_row[j] == 0.0f) continue;
        const __m512 weight = _mm512_set1_ps(p_row[j]);
        const Value* v_row = v + j * dv + c0;
#pragma GCC unroll 8
        for (int u = 0; u < kVectors; ++u) {
          if (lanes[u] != 0) {
            acc[u] =
                _mm512_fmadd_ps(weight, load(v_row + 16 * u, lanes[u]), acc[u]);
          }
        }
      }
#pragma GCC unroll 8
      for (int u = 0; u < kVectors; ++u) {
        _mm512_mask_storeu_ps(o + r * dv + c0 + 16 * u, lanes[u], acc[u]);
      }
    }
  }
}

ATTNSERVE_AVX512 void SmallAccumulateF32Avx512(const float* p, int64_t ldp,
                                               int64_t m, int64_t n,
                                               const float* v, int64_t dv,
                                               float* o) {
  SmallAccumulateAvx512(p, ldp, m, n, v, dv, o, LoadF32x16);
}

ATTNSERVE_AVX512 void SmallAccumulateBf16Avx512(const float* p, int64_t ldp,
                                                int64_t m, int64_t n,
                                                const float* v, int64_t dv,
                                                float* o) {
  SmallAccumulateAvx512(p, ldp, m, n, v, dv, o, LoadRoundedBf16x16);
}

ATTNSERVE_AVX512 void ToBf16Avx512(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = FirstLanes(n - i);
    const __m512 x = _mm512_maskz_loadu_ps(lanes, src + i);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    // A NaN is truncated and made quiet (sign kept), as Float32ToBFloat16
    // does, rather than rounded.
    const __m256i quiet = _mm512_cvtepi32_epi16(
        _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 16),
                        _mm512_set1_epi32(0x40)));
    _mm256_mask_storeu_epi16(dst + i, lanes,
                             _mm256_mask_mov_epi16(ToBf16x16(x), nan, quiet));
  }
}

// With AVX512_BF16 the conversion is one instruction: round to nearest even
// and NaN made quiet, as Float32ToBFloat16 does, but subnormal inputs (below
// 1.2e-38) become zero. The softmax's target, a superset of FirstLanes', so
// that FirstLanes inlines (without AVX512DQ and FMA it was a call per 16
// values).
ATTNSERVE_AVX512_BF16 void ToBf16Avx512Bf16(const float* src, int64_t n,
                                            uint16_t* dst) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = FirstLanes(n - i);
    const __m256i bits = reinterpret_cast<__m256i>(
        _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(lanes, src + i)));
    _mm256_mask_storeu_epi16(dst + i, lanes, bits);
  }
}

ATTNSERVE_AVX512 void Bf16ToF32Avx512(const uint16_t* src, int64_t n,
                                      float* dst) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = FirstLanes(n - i);
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, src + i));
    _mm512_mask_storeu_ps(dst + i, lanes,
                          _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
}

// VCVTPH2PS widens every f16 exactly, subnormals included.
ATTNSERVE_AVX512 void F16ToF32Avx512(const uint16_t* src, int64_t n,
                                     float* dst) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = FirstLanes(n - i);
    _mm512_mask_storeu_ps(
        dst + i, lanes,
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, src + i)));
  }
}

ATTNSERVE_AVX512 bool AnyNonFiniteF32Avx512(const float* v, int64_t rows,
                                            int64_t dim, int64_t stride) {
  const __m512i exponent = _mm512_set1_epi32(0x7f800000);
  __mmask16 found = 0;
  for (int64_t j = 0; j < rows; ++j) {
    const float* row = v + j * stride;
    for (int64_t c = 0; c < dim; c += 16) {
      const __m512i bits =
          _mm512_maskz_loadu_epi32(FirstLanes(dim - c), row + c);
      found |=
          _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, exponent), exponent);
    }
    if (found != 0) return true;
  }
  return false;
}

ATTNSERVE_AVX512 bool AnyNonFiniteBf16Avx512(const uint16_t* v, int64_t rows,
                                             int64_t dim, int64_t stride) {
  const __m512i exponent = _mm512_set1_epi16(0x7f80);
  __mmask32 found = 0;
  for (int64_t j = 0; j < rows; ++j) {
    const uint16_t* row = v + j * stride;
    for (int64_t c = 0; c < dim; c += 32) {
      const int64_t left = dim - c;
      const __mmask32 lanes =
          left >= 32 ? ~__mmask32{0}
                     : static_cast<__mmask32>((uint32_t{1} << left) - 1);
      const __m512i bits = _mm512_maskz_loadu_epi16(lanes, row + c);
      found |=
          _mm512_cmpeq_epi16_mask(_mm512_and_si512(bits, exponent), exponent);
    }
    if (found != 0) return true;
  }
  return false;
}

#undef ATTNSERVE_AVX512

bool CpuHasAvx512Bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
}

bool CpuHasAvx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
}

// The AVX-512 set; its bf16 conversions by AVX512_BF16's instructions if
// `cvt_bf16` (the CPU must have them), else in integer code.
TileKernels Avx512TileKernels(const char* name, bool cvt_bf16) {
  return {
      name,
      cvt_bf16 ? SoftmaxBlockAvx512<true> : SoftmaxBlockAvx512<false>,
      SmallScoresF32Avx512,
      SmallScoresBf16Avx512,
      SmallAccumulateF32Avx512,
      SmallAccumulateBf16Avx512,
      cvt_bf16 ? ToBf16Avx512Bf16 : ToBf16Avx512,
      Bf16ToF32Avx512,
      F16ToF32Avx512,
      AnyNonFiniteF32Avx512,
      AnyNonFiniteBf16Avx512,
  };
}

}  // namespace

const TileKernels& PortableTileKernels() {
  static const TileKernels kernels = {
      "portable",
      SoftmaxBlockPortable,
      SmallScoresF32Portable,
      SmallScoresBf16Portable,
      SmallAccumulateF32Portable,
      SmallAccumulateBf16Portable,
      ToBf16Portable,
      Bf16ToF32Portable,
      F16ToF32Portable,
      AnyNonFiniteF32Portable,
      AnyNonFiniteBf16Portable,
  };
  return kernels;
}

const TileKernels& SelectTileKernels(bool portable_only) {
  static const TileKernels kAvx512 =
      Avx512TileKernels("avx512", CpuHasAvx512Bf16());
  static const bool has_avx512 = CpuHasAvx512();
  return has_avx512 && !portable_only ? kAvx512 : PortableTileKernels();
}

const TileKernels* Avx512TileKernelsWithoutBf16() {
  static const TileKernels kAvx512 =
      Avx512TileKernels("avx512_without_bf16", /*cvt_bf16=*/false);
  static const bool has_avx512 = CpuHasAvx512();
  return has_avx512 ? &kAvx512 : nullptr;
}

}  // namespace attnserve::internal
