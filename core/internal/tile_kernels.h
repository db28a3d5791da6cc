// The element-wise and small-matrix code of the fused attention kernel: the
// online-softmax update of a row of scores, the products of a few query rows
// with a block of keys or values (where a oneDNN matmul is too thin to pay),
// bf16 packing, and the widening of bf16 and f16 inputs. Each comes as AVX-512
// code and as portable C++; the engine picks one set per process from what the
// CPU supports (or the portable set on request, which tests use to cover it on
// any machine).
#ifndef ATTNSERVE_CORE_INTERNAL_TILE_KERNELS_H_
#define ATTNSERVE_CORE_INTERNAL_TILE_KERNELS_H_

#include <cstdint>

namespace attnserve::internal {

// The mask entries of one query row, starting at the block's first key, with
// their stride along the keys (0 when the mask broadcasts over keys, else 1).
// At most one of `bias` and `allowed` is set.
struct RowMask {
  const float* bias = nullptr;
  int64_t bias_stride = 0;
  const uint8_t* allowed = nullptr;
  int64_t allowed_stride = 0;
};

// A query row's online-softmax state across key blocks: its shift (the
// largest scaled score so far, or, for the AVX-512 kernels, at most 8·ln 2
// below it: see softmax_block), the sum of exp(score − shift) so far, and
// whether a NaN score appeared (which makes the row NaN, as IEEE arithmetic
// would).
struct RowState {
  float max;
  float sum;
  bool nan;
};

struct TileKernels {
  const char* name;  // "avx512" or "portable"

  // Folds one block of raw scores s[0, n) of a row into `state`: x_j = scale ·
  // s_j (+ bias_j), or −inf for j ≥ visible or a disallowed key; then writes
  // p_j = exp(x_j − new shift) over s_j (or as bf16 to p16 if not null; s is
  // then left undefined), and state->sum grows by Σ p_j (the f32 values).
  // Returns the factor exp(old shift − new shift) by which the row's
  // accumulated output must be multiplied (1 while the row has seen no key).
  // The new shift is the max of the x_j seen so far, except that the AVX-512
  // set keeps a row's shift while no x_j of an unmasked, wholly visible block
  // passes it by more than 8·ln 2 (its p_j then reach up to 2^8), and raises
  // it by whole powers of two: one pass over such a block, and most blocks
  // leave the output as it is.
  float (*softmax_block)(float* s, int64_t n, int64_t visible, float scale,
                         const RowMask& mask, RowState* state, uint16_t* p16);

  // s[r · lds + j] = Σ_d q[r · d_len + d] · k[j · d_len + d] for r < m, j < n:
  // the scores of a few query rows against a block of keys. The bf16 variant
  // rounds each key element to bf16 as it reads it (bf16 precision).
  void (*small_scores_f32)(const float* q, int64_t m, int64_t d_len,
                           const float* k, int64_t n, float* s, int64_t lds);
  void (*small_scores_bf16)(const float* q, int64_t m, int64_t d_len,
                            const float* k, int64_t n, float* s, int64_t lds);

  // o[r · dv + c] += Σ_j p[r · ldp + j] · v[j · dv + c] for r < m, c < dv;
  // the bf16 variant rounds each value element to bf16 as it reads it.
  void (*small_accumulate_f32)(const float* p, int64_t ldp, int64_t m,
                               int64_t n, const float* v, int64_t dv, float* o);
  void (*small_accumulate_bf16)(const float* p, int64_t ldp, int64_t m,
                                int64_t n, const float* v, int64_t dv,
                                float* o);

  // dst[i] = bf16(src[i]), rounding to nearest even; where the CPU has
  // AVX512_BF16, a subnormal src[i] becomes a zero of its sign, as its
  // VCVTNEPS2BF16 gives.
  void (*to_bf16)(const float* src, int64_t n, uint16_t* dst);

  // dst[i] = the f32 value of src[i], a bf16 or an f16 (exact: the inputs
  // the kernels read where they lie, widened a block at a time).
  void (*bf16_to_f32)(const uint16_t* src, int64_t n, float* dst);
  void (*f16_to_f32)(const uint16_t* src, int64_t n, float* dst);

  // Whether any of `rows` rows of `dim` elements, `stride` elements apart, is
  // NaN or ±inf: f32, or bf16 bit patterns. A block of values holding one
  // cannot go through a matmul, which would take 0 · NaN into the rows that
  // do not see it.
  bool (*any_non_finite_f32)(const float* v, int64_t rows, int64_t dim,
                             int64_t stride);
  bool (*any_non_finite_bf16)(const uint16_t* v, int64_t rows, int64_t dim,
                              int64_t stride);
};

// The portable set, correct on any CPU.
const TileKernels& PortableTileKernels();

// The AVX-512 set if this CPU has AVX-512 F, BW, VL and DQ, else the portable
// set; the portable set whenever `portable_only`.
const TileKernels& SelectTileKernels(bool portable_only);

// The AVX-512 set as a CPU with AVX-512 but without AVX512_BF16 runs it (its
// bf16 conversions in integer code), for tests on CPUs that have both; null
// without AVX-512.
const TileKernels* Avx512TileKernelsWithoutBf16();

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_TILE_KERNELS_H_
