#include "internal/paged_attention.h"

// GCC and Clang warn that a function returning or taking a 32-byte vector
// would pass it differently with AVX enabled; the block kernels' helpers are
// always inlined, so no such value ever crosses a call.
#pragma GCC diagnostic ignored "-Wpsabi"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/common/dtype.h"
#include "internal/fast_exp.h"
#include "internal/score_mods.h"
#include "internal/scratch_pool.h"
#include "internal/stopper.h"
#include "internal/tile_kernels.h"
#include "internal/visibility.h"

namespace attnserve::internal {
namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Keys a unit folds into its softmax at a time: a block of f32 keys of
// Dk = 128 is 32 KiB, an L1 cache's worth.
constexpr int64_t kBlock = 64;
// Query rows a unit computes at most (a kv head's whole group when the group
// is larger): decode steps have group · Tq rows, far fewer.
constexpr int64_t kUnitRows = 64;
// Blocks a unit runs between polls of the call's stop check (1,024 keys).
constexpr int64_t kBlocksPerStopPoll = 16;
// Units per thread the keys are split into when the steps alone give fewer.
constexpr int64_t kUnitsPerThread = 4;
constexpr int64_t kMaxSplits = 64;

// x rounded to bf16 and back (BF16 precision), as the tile kernels do.
float RoundToBf16(float x) { return BFloat16ToFloat32(Float32ToBFloat16(x)); }

// The run of `item`'s blocks in the bf16 kernels' pairwise layout, or 0 for
// none: bf16 pages whose head dimensions are multiples of the run. Those
// kernels read a run of bf16 values as 32-bit words and widen the even and
// the odd ones with one instruction each, so the query rows they multiply,
// and the output rows they accumulate, hold each run of columns as its even
// columns then its odd ones (WriteRows puts them back in order). The run is
// 32 for the AVX-512 unit (`wide`: sixteen-lane vectors) where the dimensions
// allow, else 16 (eight-lane vectors).
int64_t PairwiseRun(const PagedAttend& item, bool wide) {
  if (item.layout.dtype != DataType::kBFloat16) return 0;
  for (const int64_t run : {int64_t{32}, int64_t{16}}) {
    if ((wide || run == 16) && item.layout.key_dim % run == 0 &&
        item.layout.value_dim % run == 0) {
      return run;
    }
  }
  return 0;
}

// The `run` columns at `row` as their even columns then their odd ones, into
// `out`.
void Deinterleave(const float* row, int64_t run, float* out) {
  for (int64_t i = 0; i < run / 2; ++i) {
    out[i] = row[2 * i];
    out[run / 2 + i] = row[2 * i + 1];
  }
}

// One unit of work: rows [q0, q0 + qn) of every query head reading kv head
// `kv_head` of item `item`, over the keys of split `split`.
struct Unit {
  int64_t item;
  int64_t kv_head;
  int64_t q0;
  int64_t qn;
  int64_t split;
  int64_t partial;  // Its partial result's offset, in floats (split runs).
};

// How a call is cut up, and the sizes of each thread's buffers.
struct Plan {
  std::vector<Unit> units;  // Splits of one unit are consecutive.
  int64_t splits = 1;
  int64_t max_rows = 1;  // Query rows of the largest unit.
  int64_t max_key_dim = 1;
  int64_t max_value_dim = 1;
  int64_t thread_floats = 0;   // Each thread's buffers, in floats.
  int64_t partial_floats = 0;  // Every split unit's result, in floats.
};

int64_t GroupOf(const PagedAttend& item) {
  return item.heads / item.layout.kv_heads;
}

// Query rows per unit for `item`: the whole group, times as many queries as
// fit in kUnitRows.
bool HasScoreMods(const PagedAttend& item) {
  return item.window_left >= 0 || item.num_sink_tokens > 0 ||
         item.softcap > 0.0f || !item.alibi_slopes.empty();
}

// The rules of an item's RowKeys: causal, bottom-right.
KeyRules RulesOf(const PagedAttend& item) {
  return {true, true, item.window_left, -1, item.num_sink_tokens};
}

// The keys between the sinks and the windows that none of the item's query
// rows [q0, q0 + qn) sees, [first, last) (empty if first >= last): the kernel
// skips them, and their pages may be null.
struct KeyGap {
  int64_t first = 0;
  int64_t last = 0;
};

KeyGap UnseenKeys(const PagedAttend& item, int64_t q0, int64_t qn) {
  KeyGap gap{0, item.length};
  const KeyRules rules = RulesOf(item);
  for (int64_t i = q0; i < q0 + qn; ++i) {
    const RowKeys keys = VisibleKeys(rules, item.length, item.query_len, i);
    if (keys.end == 0) continue;
    if (keys.sink_end == 0 && keys.start == 0) {
      gap.first = std::max(gap.first, keys.end);  // One run [0, end).
    } else {
      gap.first = std::max(gap.first, keys.sink_end);
      gap.last = std::min(gap.last, keys.start);
    }
  }
  return gap;
}

int64_t QueriesPerUnit(const PagedAttend& item) {
  return std::clamp<int64_t>(kUnitRows / GroupOf(item), 1, item.query_len);
}

// Where each of a thread's buffers starts (UnitBuffers), in floats from the
// thread's base, and where they end: each at a whole cache line (the base is
// one too), so that the kernels' vector loads of a query or output row never
// straddle two lines.
struct Offsets {
  int64_t states, output, query, scores, keys, values, end;
};

int64_t WholeLines(int64_t floats) { return (floats + 15) / 16 * 16; }

Offsets BufferOffsets(const Plan& plan) {
  const int64_t rows = (plan.max_rows + 3) / 4 * 4;
  Offsets o;
  o.states = WholeLines(6 * rows);
  o.output = o.states + WholeLines(4 * rows);
  o.query = o.output + WholeLines(rows * plan.max_value_dim);
  o.scores = o.query + WholeLines(rows * plan.max_key_dim);
  o.keys = o.scores + WholeLines(rows * kBlock);
  o.values = o.keys + WholeLines(kBlock * plan.max_key_dim);
  o.end = o.values + WholeLines(kBlock * plan.max_value_dim);
  return o;
}

Plan MakePlan(absl::Span<const PagedAttend> items, int threads) {
  Plan plan;
  int64_t base_units = 0;
  for (const PagedAttend& item : items) {
    const int64_t per_unit = QueriesPerUnit(item);
    base_units +=
        item.layout.kv_heads * ((item.query_len + per_unit - 1) / per_unit);
    plan.max_rows = std::max(plan.max_rows, GroupOf(item) * per_unit);
    plan.max_key_dim = std::max(plan.max_key_dim, item.layout.key_dim);
    plan.max_value_dim = std::max(plan.max_value_dim, item.layout.value_dim);
  }
  const int64_t target = kUnitsPerThread * threads;
  if (threads > 1 && base_units > 0 && base_units < target) {
    plan.splits =
        std::min<int64_t>(kMaxSplits, (target + base_units - 1) / base_units);
  }
  plan.units.reserve(static_cast<size_t>(base_units * plan.splits));
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
    const PagedAttend& item = items[static_cast<size_t>(i)];
    const int64_t per_unit = QueriesPerUnit(item);
    for (int64_t h = 0; h < item.layout.kv_heads; ++h) {
      for (int64_t q0 = 0; q0 < item.query_len; q0 += per_unit) {
        const int64_t qn = std::min(per_unit, item.query_len - q0);
        for (int64_t split = 0; split < plan.splits; ++split) {
          plan.units.push_back({i, h, q0, qn, split, plan.partial_floats});
          if (plan.splits > 1) {
            // Each row's output, then its state as three floats.
            plan.partial_floats +=
                GroupOf(item) * qn * (item.layout.value_dim + 3);
          }
        }
      }
    }
  }
  // Per row: its RowKeys (6 floats), its state (4 floats), its output, query
  // and scores; then a block of keys and one of values. Whole cache lines, so
  // that threads never share one and rows start on one (BufferOffsets).
  plan.thread_floats = BufferOffsets(plan).end;
  return plan;
}

// A thread's buffers as one unit uses them.
struct UnitBuffers {
  float* output;       // [rows, Dv] accumulated
  float* query;        // [rows, Dk]
  float* scores;       // [rows, kBlock]
  float* keys;         // [kBlock, Dk]
  float* values;       // [kBlock, Dv]
  RowState* states;    // [rows]
  RowKeys* keys_seen;  // [rows] the keys each row sees
};

UnitBuffers BuffersOf(float* base, const Plan& plan) {
  static_assert(sizeof(RowState) <= 4 * sizeof(float));
  static_assert(sizeof(RowKeys) <= 6 * sizeof(float));
  UnitBuffers b;
  const Offsets o = BufferOffsets(plan);
  b.keys_seen = reinterpret_cast<RowKeys*>(base);
  b.states = reinterpret_cast<RowState*>(base + o.states);
  b.output = base + o.output;
  b.query = base + o.query;
  b.scores = base + o.scores;
  b.keys = base + o.keys;
  b.values = base + o.values;
  return b;
}

// The key range [first, last) of split `split` of `length` keys, in whole
// blocks.
void SplitRange(int64_t length, int64_t splits, int64_t split, int64_t* first,
                int64_t* last) {
  const int64_t blocks = (length + kBlock - 1) / kBlock;
  const int64_t per_split = (blocks + splits - 1) / splits;
  *first = std::min(length, split * per_split * kBlock);
  *last = std::min(length, (split + 1) * per_split * kBlock);
}

// The block kernels: GCC/Clang vector extensions, eight floats a vector,
// inlined into one function per instruction set (UnitAvx512, UnitAvx2,
// UnitPortable) so that they compile to that set's instructions. Keys and
// values are read from the page in its dtype and widened in registers.
typedef float F8 __attribute__((vector_size(32)));
typedef float F4 __attribute__((vector_size(16)));
typedef uint32_t U8 __attribute__((vector_size(32)));
typedef uint16_t H8 __attribute__((vector_size(16)));

#define ATTNSERVE_PAGED_INLINE __attribute__((always_inline)) inline

// Prefetches bytes [begin, end) of `base`, a line at a time, of the next block
// a kernel will read. Into L1 (prefetcht0), not L2 (prefetcht1): on an AVX-512
// AMD EPYC (Zen 5) decode from DRAM reads faster so (BENCHMARKS.md,
// 2026-12-04); a block larger than L1 (an f32 block of 128 dimensions is 64
// KiB) loses only the lines evicted to L2.
ATTNSERVE_PAGED_INLINE void PrefetchLines(const char* base, int64_t begin,
                                          int64_t end) {
  for (int64_t at = begin; at < end; at += 64) {
    __builtin_prefetch(base + at, 0, 3);
  }
}

ATTNSERVE_PAGED_INLINE F8 LoadFloats(const float* p) {
  F8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

ATTNSERVE_PAGED_INLINE void StoreFloats(float* p, F8 v) {
  std::memcpy(p, &v, sizeof(v));
}

// Whether kF16c kernels widen f16 with F16C's instruction. GCC checks a
// builtin's instruction set in the function it is inlined into (UnitAvx2,
// compiled for F16C); Clang checks it in the template that calls it, so Clang
// builds (the fuzzers') keep the portable widening.
#if defined(__clang__)
constexpr bool kF16cBuiltin = false;
#else
constexpr bool kF16cBuiltin = true;
#endif

// Elements [index, index + 8) of `row` (in T) as f32; kF16c: f16 widened by
// one F16C instruction (the calling function must be compiled for F16C).
template <DataType T, bool kF16c = false>
ATTNSERVE_PAGED_INLINE F8 Load8(const char* row, int64_t index) {
  if constexpr (T == DataType::kFloat32) {
    return LoadFloats(reinterpret_cast<const float*>(row) + index);
  } else if constexpr (T == DataType::kFloat16 && kF16c && kF16cBuiltin) {
    typedef short S8 __attribute__((vector_size(16)));
    S8 h;
    std::memcpy(&h, row + 2 * index, sizeof(h));
    return (F8)__builtin_ia32_vcvtph2ps256(h);
  } else {
    H8 h;
    std::memcpy(&h, row + 2 * index, sizeof(h));
    const U8 u = __builtin_convertvector(h, U8);
    if constexpr (T == DataType::kBFloat16) {
      return (F8)(u << 16);
    } else {
      // Float16ToFloat32 (common/dtype.h) without branches, eight at a time:
      // the half's exponent and mantissa in a float's, scaled by 2^112 from
      // the bias difference (exact for normal and subnormal halves), infinity
      // and NaN put back.
      const U8 sign = (u & 0x8000u) << 16;
      const U8 magnitude = u & 0x7fffu;
      const U8 scaled = (U8)((F8)(magnitude << 13) * 0x1p112f);
      const U8 special = (U8)(magnitude >= 0x7c00u);
      const U8 bits =
          (scaled & ~special) | (((magnitude << 13) | 0x7f800000u) & special);
      return (F8)(bits | sign);
    }
  }
}

template <DataType T>
ATTNSERVE_PAGED_INLINE float Load1(const char* row, int64_t index) {
  if constexpr (T == DataType::kFloat32) {
    return reinterpret_cast<const float*>(row)[index];
  } else {
    uint16_t h;
    std::memcpy(&h, row + 2 * index, sizeof(h));
    return T == DataType::kBFloat16 ? BFloat16ToFloat32(h)
                                    : Float16ToFloat32(h);
  }
}

ATTNSERVE_PAGED_INLINE float Sum8(F8 v) {
  F4 x = __builtin_shufflevector(v, v, 0, 1, 2, 3) +
         __builtin_shufflevector(v, v, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2);
  return x[0];
}

typedef int32_t I8 __attribute__((vector_size(32)));

typedef float F16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));

// The fold's and the block kernels' vectors: kLanes (8 or 16) floats, and as
// many int32 lanes.
template <int kLanes>
using Floats = std::conditional_t<kLanes == 16, F16, F8>;
template <int kLanes>
using Ints = std::conditional_t<kLanes == 16, I16, I8>;

template <int kLanes>
ATTNSERVE_PAGED_INLINE Floats<kLanes> LoadVector(const float* p) {
  Floats<kLanes> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int kLanes>
ATTNSERVE_PAGED_INLINE void StoreVector(float* p, Floats<kLanes> v) {
  std::memcpy(p, &v, sizeof(v));
}

// Lanes of `a` where `mask` is set, else of `b`.
template <typename F, typename I>
ATTNSERVE_PAGED_INLINE F Select(I mask, F a, F b) {
  return (F)(((I)a & mask) | ((I)b & ~mask));
}

// The largest lane of a fold vector whose lanes are never NaN, and whether
// any lane of a mask is set: halves folded together, as SumOf does.
ATTNSERVE_PAGED_INLINE float MaxOf(F8 v) {
  F4 x = __builtin_shufflevector(v, v, 0, 1, 2, 3);
  const F4 y = __builtin_shufflevector(v, v, 4, 5, 6, 7);
  x = x > y ? x : y;
  const F4 z = __builtin_shufflevector(x, x, 2, 3, 0, 1);
  x = x > z ? x : z;
  return std::max(x[0], x[1]);
}
ATTNSERVE_PAGED_INLINE float MaxOf(F16 v) {
  const F8 x = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const F8 y = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return MaxOf(x > y ? x : y);
}

ATTNSERVE_PAGED_INLINE bool AnyOf(I8 mask) {
  typedef int32_t I4 __attribute__((vector_size(16)));
  I4 x = __builtin_shufflevector(mask, mask, 0, 1, 2, 3) |
         __builtin_shufflevector(mask, mask, 4, 5, 6, 7);
  x |= __builtin_shufflevector(x, x, 2, 3, 0, 1);
  return (x[0] | x[1]) != 0;
}
ATTNSERVE_PAGED_INLINE bool AnyOf(I16 mask) {
  return AnyOf(
      __builtin_shufflevector(mask, mask, 0, 1, 2, 3, 4, 5, 6, 7) |
      __builtin_shufflevector(mask, mask, 8, 9, 10, 11, 12, 13, 14, 15));
}

// The sum of a fold vector's lanes: halves added down to eight, then Sum8.
ATTNSERVE_PAGED_INLINE float SumOf(F8 v) { return Sum8(v); }
ATTNSERVE_PAGED_INLINE float SumOf(F16 v) {
  return Sum8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

// ExpNonPositive (internal/fast_exp.h), a vector of lanes at a time: the
// same reduction and polynomial, so the same results.
template <typename F, typename I>
ATTNSERVE_PAGED_INLINE F ExpNonPositiveLanes(F x) {
  const I in_range = x >= kExpLowest;  // False for NaN.
  const F clamped = Select(in_range, x, F{} + kExpLowest);
  const F n = (clamped * kExpLog2e + kExpRoundMagic) - kExpRoundMagic;
  const F r = clamped - n * kExpLn2High - n * kExpLn2Low;
  const I exponent = (__builtin_convertvector(n, I) + 127) << 23;
  const F result = ExpPolynomial(r) * (F)exponent;
  return Select(in_range, result, Select(x != x, x, F{}));
}

// x rounded to bf16 (nearest even) and back, as RoundToBf16 does lane by
// lane; NaN stays NaN.
template <typename F, typename I>
ATTNSERVE_PAGED_INLINE F RoundLanesToBf16(F x) {
  const I bits = (I)x;
  const I rounded = (bits + 0x7fff + ((bits >> 16) & 1)) & ~0xffff;
  return Select(x != x, x, (F)rounded);
}

// Folds one block's raw scores s[0, n) of a row into `state` (keys at or
// past `visible` masked); writes the probabilities over s (and zeros up to
// the next multiple of kLanes, within kBlock) and returns the factor by which
// the row's accumulated output must be multiplied. kLanes 16: the AVX-512
// unit's.
template <int kLanes = 8>
ATTNSERVE_PAGED_INLINE float FoldScores(float* s, int64_t n, int64_t visible,
                                        float scale, bool round,
                                        RowState* state) {
  using F = Floats<kLanes>;
  using I = Ints<kLanes>;
  const int64_t end = (n + kLanes - 1) / kLanes * kLanes;
  I lanes{};
  for (int i = 0; i < kLanes; ++i) lanes[i] = i;  // Folded to a constant.
  const F minus_infinity = F{} + kNegativeInfinity;
  F maxima = minus_infinity;
  I nans{};
  for (int64_t j = 0; j < end; j += kLanes) {
    const I seen =
        lanes + static_cast<int32_t>(j) < static_cast<int32_t>(visible);
    const F x = Select(seen, LoadVector<kLanes>(s + j) * scale, minus_infinity);
    nans |= x != x;
    maxima = Select(x > maxima, x, maxima);
    StoreVector<kLanes>(s + j, x);
  }
  if (AnyOf(nans)) state->nan = true;
  const float block_max = MaxOf(maxima);
  // A score of +inf makes the row NaN, as exp(inf − inf) is.
  if (block_max == -kNegativeInfinity) state->nan = true;
  const float new_max = std::max(state->max, block_max);
  if (new_max == kNegativeInfinity) {
    std::fill(s, s + end, 0.0f);
    return 1.0f;
  }
  const float alpha = state->max == kNegativeInfinity
                          ? 0.0f
                          : ExpNonPositive(state->max - new_max);
  state->max = new_max;
  F sums{};
  for (int64_t j = 0; j < end; j += kLanes) {
    F p = ExpNonPositiveLanes<F, I>(LoadVector<kLanes>(s + j) - new_max);
    sums += p;
    if (round) p = RoundLanesToBf16<F, I>(p);
    StoreVector<kLanes>(s + j, p);
  }
  state->sum = state->sum * alpha + SumOf(sums);
  return alpha;
}

// BF16 precision over f32 or f16 pages: `count` elements of `source` (in
// `dtype`) rounded to bf16, as f32, into `destination` (a thread buffer),
// eight at a time; kF16c: f16 widened by F16C's instruction.
template <bool kF16c>
ATTNSERVE_PAGED_INLINE void RoundBlockToBf16(const char* source, int64_t count,
                                             DataType dtype,
                                             float* destination) {
  const bool f32 = dtype == DataType::kFloat32;
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const F8 x = f32 ? Load8<DataType::kFloat32>(source, i)
                     : Load8<DataType::kFloat16, kF16c>(source, i);
    StoreFloats(destination + i, RoundLanesToBf16<F8, I8>(x));
  }
  for (; i < count; ++i) {
    destination[i] = RoundToBf16(f32 ? Load1<DataType::kFloat32>(source, i)
                                     : Load1<DataType::kFloat16>(source, i));
  }
}

// Sixteen elements of a row, from `d`, as two vectors: those that pair with
// the query's (or accumulate into the output's) columns [d, d + 8) and
// [d + 8, d + 16). Pairwise (bf16 rows of an item that is Deinterleaved):
// eight 32-bit words, each two bf16 values, the even ones widened with one
// instruction and the odd ones with another; the query and output rows hold
// each run of sixteen columns as its even columns then its odd ones.
template <DataType T, bool kPairwise, bool kF16c = false>
ATTNSERVE_PAGED_INLINE void Load16(const char* row, int64_t d, F8* first,
                                   F8* second) {
  if constexpr (kPairwise) {
    U8 u;
    std::memcpy(&u, row + 2 * d, sizeof(u));
    *first = (F8)(u << 16);
    *second = (F8)(u & 0xffff0000u);
  } else {
    *first = Load8<T, kF16c>(row, d);
    *second = Load8<T, kF16c>(row, d + 8);
  }
}

// The same for eight columns.
ATTNSERVE_PAGED_INLINE void Dot8(const float* q, F8 key0, F8 key1, F8& a0,
                                 F8& a1) {
  const F8 y = LoadFloats(q);
  a0 += y * key0;
  a1 += y * key1;
}

// The AVX-512 unit's pairwise vectors: sixteen lanes, runs of 32 bf16
// columns (PairwiseRun).
typedef uint32_t U16 __attribute__((vector_size(64)));

// A run of 2 · kLanes elements of a row from `d`, as Load16 does. Sixteen
// lanes (the AVX-512 unit): bf16 rows in runs of 32 pairwise, the even columns
// then the odd ones; f32 rows, and f16 rows widened by AVX-512's form of
// F16C's instruction, in order.
template <DataType T, bool kPairwise, bool kF16c, int kLanes>
ATTNSERVE_PAGED_INLINE void LoadRun(const char* row, int64_t d,
                                    Floats<kLanes>* first,
                                    Floats<kLanes>* second) {
  if constexpr (kLanes == 16 && T == DataType::kFloat32) {
    std::memcpy(first, row + 4 * d, sizeof(*first));
    std::memcpy(second, row + 4 * d + sizeof(*first), sizeof(*second));
  } else if constexpr (kLanes == 16 && T == DataType::kFloat16) {
    static_assert(kF16c && kF16cBuiltin);
    typedef short S16 __attribute__((vector_size(32)));
    S16 low, high;
    std::memcpy(&low, row + 2 * d, sizeof(low));
    std::memcpy(&high, row + 2 * d + sizeof(low), sizeof(high));
    *first = __builtin_ia32_vcvtph2ps512_mask(low, F16{}, -1, 4);
    *second = __builtin_ia32_vcvtph2ps512_mask(high, F16{}, -1, 4);
  } else if constexpr (kLanes == 16) {
    static_assert(T == DataType::kBFloat16 && kPairwise);
    U16 u;
    std::memcpy(&u, row + 2 * d, sizeof(u));
    *first = (F16)(u << 16);
    *second = (F16)(u & 0xffff0000u);
  } else {
    Load16<T, kPairwise, kF16c>(row, d, first, second);
  }
}

// One query row's run of 2 · kLanes columns at `q` against two keys' (first
// and second halves: LoadRun), into the row's two accumulators.
template <int kLanes>
ATTNSERVE_PAGED_INLINE void DotRun(const float* q, Floats<kLanes> first0,
                                   Floats<kLanes> second0,
                                   Floats<kLanes> first1,
                                   Floats<kLanes> second1, Floats<kLanes>& a0,
                                   Floats<kLanes>& a1) {
  const Floats<kLanes> y = LoadVector<kLanes>(q);
  const Floats<kLanes> z = LoadVector<kLanes>(q + kLanes);
  a0 += y * first0;
  a0 += z * second0;
  a1 += y * first1;
  a1 += z * second1;
}

// Sixteen accumulators a[4 · key + row] summed across their lanes by one
// transpose tree (45 instructions where sixteen sums one by one take 128): lane
// 4 · row + key of the result is the sum of a[4 · key + row]. Each level adds
// the two halves of every accumulator while packing two accumulators into one
// vector: halves of 256 bits, then 128, 64 and 32.
ATTNSERVE_PAGED_INLINE F16 SumAcross16(const F16* a) {
  F16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {
    const F16 x = a[2 * i], y = a[2 * i + 1];
    b[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                   20, 21, 22, 23) +
           __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    const F16 x = b[2 * i], y = b[2 * i + 1];
    c[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    const F16 x = c[2 * i], y = c[2 * i + 1];
    d[i] = __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24,
                                   25, 12, 13, 28, 29) +
           __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26,
                                   27, 14, 15, 30, 31);
  }
  return __builtin_shufflevector(d[0], d[1], 0, 2, 16, 18, 4, 6, 20, 22, 8, 10,
                                 24, 26, 12, 14, 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 17, 19, 5, 7, 21, 23, 9, 11,
                                 25, 27, 13, 15, 29, 31);
}

// The scores BlockScores computes (below), in the AVX-512 unit's sixteen
// lanes (dk % 32 == 0, runs of 32 columns as LoadRun reads them): four keys
// and four rows a step, sixteen accumulators summed across their lanes by one
// SumAcross16, where pairs of keys took eight sums one by one: those had cost
// as many instructions as the products.
template <DataType T, bool kPairwise, bool kF16c>
ATTNSERVE_PAGED_INLINE void BlockScoresFourKeys(const float* q, int64_t rows4,
                                                int64_t dk, const char* keys,
                                                int64_t n, float* s,
                                                const char* next_keys) {
  const int64_t row_bytes = dk * (T == DataType::kFloat32 ? 4 : 2);
  for (int64_t r0 = 0; r0 < rows4; r0 += 4) {
    const float* q0 = q + r0 * dk;
    float* s0 = s + r0 * kBlock;
    for (int64_t j = 0; j < n; j += 4) {
      // Keys past the block repeat its last; their scores are not stored.
      const char* k[4];
      for (int64_t i = 0; i < 4; ++i) {
        k[i] = keys + std::min(j + i, n - 1) * row_bytes;
      }
      if (r0 == 0 && next_keys != nullptr) {
        PrefetchLines(next_keys, j * row_bytes, (j + 4) * row_bytes);
      }
      F16 a[16] = {};  // a[4 · key + row]
      for (int64_t d = 0; d < dk; d += 32) {
        F16 first[4], second[4];
        for (int i = 0; i < 4; ++i) {
          LoadRun<T, kPairwise, kF16c, 16>(k[i], d, &first[i], &second[i]);
        }
        for (int r = 0; r < 4; ++r) {
          const F16 y = LoadVector<16>(q0 + r * dk + d);
          const F16 z = LoadVector<16>(q0 + r * dk + d + 16);
          for (int i = 0; i < 4; ++i) {
            a[4 * i + r] += y * first[i];
            a[4 * i + r] += z * second[i];
          }
        }
      }
      const F16 sums = SumAcross16(a);
      if (j + 4 <= n) {
        // Each row's four scores by one 128-bit store from the vector: a
        // copy of a length known only at run time here compiled to a byte
        // loop that took ~13 % of a bf16 decode's time.
        const F4 row0 = __builtin_shufflevector(sums, sums, 0, 1, 2, 3);
        const F4 row1 = __builtin_shufflevector(sums, sums, 4, 5, 6, 7);
        const F4 row2 = __builtin_shufflevector(sums, sums, 8, 9, 10, 11);
        const F4 row3 = __builtin_shufflevector(sums, sums, 12, 13, 14, 15);
        std::memcpy(s0 + j, &row0, sizeof(row0));
        std::memcpy(s0 + kBlock + j, &row1, sizeof(row1));
        std::memcpy(s0 + 2 * kBlock + j, &row2, sizeof(row2));
        std::memcpy(s0 + 3 * kBlock + j, &row3, sizeof(row3));
      } else {
        for (int r = 0; r < 4; ++r) {
          for (int64_t i = 0; i < n - j; ++i)
            s0[r * kBlock + j + i] = sums[4 * r + i];
        }
      }
    }
  }
}

// s[r · kBlock + j] = q_r · k_j for every row r of `q` ([rows4, dk], rows4 a
// multiple of 4, rows past the unit's zero) and key j < n of `keys`
// ([n, dk] in T): four rows and two keys at a time, eight accumulators of
// eight lanes; the next block's rows prefetched as these are used (a
// page's rows are too short a run for the hardware prefetcher to catch). The
// AVX-512 unit runs BlockScoresFourKeys instead.
template <DataType T, bool kPairwise, bool kF16c = false>
ATTNSERVE_PAGED_INLINE void BlockScores(const float* q, int64_t rows4,
                                        int64_t dk, const char* keys, int64_t n,
                                        float* s, const char* next_keys) {
  constexpr int kLanes = 8;
  using V = Floats<kLanes>;
  const int64_t element = T == DataType::kFloat32 ? 4 : 2;
  const int64_t end_runs = dk / (2 * kLanes) * (2 * kLanes);
  const int64_t end8 = dk / 8 * 8;  // Pairwise: dk % 16 == 0.
  for (int64_t r0 = 0; r0 < rows4; r0 += 4) {
    const float* q0 = q + r0 * dk;
    const float* q1 = q0 + dk;
    const float* q2 = q1 + dk;
    const float* q3 = q2 + dk;
    float* s0 = s + r0 * kBlock;
    for (int64_t j = 0; j < n; j += 2) {
      // The last odd key pairs with itself; its second result is dropped.
      const int64_t j1 = j + 1 < n ? j + 1 : j;
      const char* k0 = keys + j * dk * element;
      const char* k1 = keys + j1 * dk * element;
      if (r0 == 0 && next_keys != nullptr) {
        PrefetchLines(next_keys, j * dk * element, (j + 2) * dk * element);
      }
      V a00{}, a01{}, a10{}, a11{}, a20{}, a21{}, a30{}, a31{};
      for (int64_t d = 0; d < end_runs; d += 2 * kLanes) {
        V e0, o0, e1, o1;
        LoadRun<T, kPairwise, kF16c, kLanes>(k0, d, &e0, &o0);
        LoadRun<T, kPairwise, kF16c, kLanes>(k1, d, &e1, &o1);
        DotRun<kLanes>(q0 + d, e0, o0, e1, o1, a00, a01);
        DotRun<kLanes>(q1 + d, e0, o0, e1, o1, a10, a11);
        DotRun<kLanes>(q2 + d, e0, o0, e1, o1, a20, a21);
        DotRun<kLanes>(q3 + d, e0, o0, e1, o1, a30, a31);
      }
      for (int64_t d = end_runs; d < end8; d += 8) {
        const F8 x0 = Load8<T, kF16c>(k0, d);
        const F8 x1 = Load8<T, kF16c>(k1, d);
        Dot8(q0 + d, x0, x1, a00, a01);
        Dot8(q1 + d, x0, x1, a10, a11);
        Dot8(q2 + d, x0, x1, a20, a21);
        Dot8(q3 + d, x0, x1, a30, a31);
      }
      float t[8] = {Sum8(a00), Sum8(a01), Sum8(a10), Sum8(a11),
                    Sum8(a20), Sum8(a21), Sum8(a30), Sum8(a31)};
      for (int64_t d = end8; d < dk; ++d) {
        const float x0 = Load1<T>(k0, d);
        const float x1 = Load1<T>(k1, d);
        const float* rows[4] = {q0, q1, q2, q3};
        for (int r = 0; r < 4; ++r) {
          t[2 * r] += rows[r][d] * x0;
          t[2 * r + 1] += rows[r][d] * x1;
        }
      }
      for (int64_t r = 0; r < 4; ++r) {
        s0[r * kBlock + j] = t[2 * r];
        if (j + 1 < n) s0[r * kBlock + j + 1] = t[2 * r + 1];
      }
    }
  }
}

// kVectors · kLanes consecutive keys' values of one key dimension, from
// `at` (in T), as vectors across the keys: in order, except bf16, whose 32-bit
// words widen as the even keys of each 2 · kLanes then the odd ones, one
// instruction each (StoreInOrder puts their scores back in order).
template <DataType T, bool kF16c, int kLanes, int kVectors>
ATTNSERVE_PAGED_INLINE void LoadKeys(const char* at, Floats<kLanes>* k) {
  using U = std::conditional_t<kLanes == 16, U16, U8>;
  using V = Floats<kLanes>;
  if constexpr (T == DataType::kBFloat16) {
    for (int w = 0; w < kVectors / 2; ++w) {
      U u;
      std::memcpy(&u, at + sizeof(U) * w, sizeof(u));
      k[2 * w] = (V)(u << 16);
      k[2 * w + 1] = (V)(u & 0xffff0000u);
    }
  } else if constexpr (kLanes == 16 && T == DataType::kFloat16) {
    static_assert(kF16c && kF16cBuiltin);
    typedef short S16 __attribute__((vector_size(32)));
    for (int v = 0; v < kVectors; ++v) {
      S16 h;
      std::memcpy(&h, at + 32 * v, sizeof(h));
      k[v] = __builtin_ia32_vcvtph2ps512_mask(h, F16{}, -1, 4);
    }
  } else if constexpr (kLanes == 16) {
    static_assert(T == DataType::kFloat32);
    std::memcpy(k, at, kVectors * sizeof(F16));
  } else {
    for (int v = 0; v < kVectors; ++v) k[v] = Load8<T, kF16c>(at, 8 * v);
  }
}

// The scores of 2 · kLanes keys from their even keys' `even` and odd keys'
// `odd` (LoadKeys of bf16), in key order at `out`.
ATTNSERVE_PAGED_INLINE void StoreInOrder(F16 even, F16 odd, float* out) {
  StoreVector<16>(
      out, __builtin_shufflevector(even, odd, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20,
                                   5, 21, 6, 22, 7, 23));
  StoreVector<16>(
      out + 16, __builtin_shufflevector(even, odd, 8, 24, 9, 25, 10, 26, 11, 27,
                                        12, 28, 13, 29, 14, 30, 15, 31));
}

ATTNSERVE_PAGED_INLINE void StoreInOrder(F8 even, F8 odd, float* out) {
  StoreVector<8>(out,
                 __builtin_shufflevector(even, odd, 0, 8, 1, 9, 2, 10, 3, 11));
  StoreVector<8>(
      out + 8, __builtin_shufflevector(even, odd, 4, 12, 5, 13, 6, 14, 7, 15));
}

// The same scores for keys laid out by dimension (PageLayout::keys_
// transposed): dimension d of key j at keys + d · stride + j · element bytes.
// A pass takes kVectors · kLanes keys as the lanes of its vectors, four rows
// at a time: per dimension one load of the keys and one multiply-add per row
// and vector with the row's element broadcast, and no sum across lanes. Keys
// past `room` (the end of the page's rows) are read from a zeroed copy; lanes
// past n read the page's unused slots, and their scores are never used (the
// fold masks them). The next block's rows are prefetched as these are read.
// Sixteen lanes take 64 keys a pass, eight lanes (AVX2's registers hold
// fewer accumulators) 16.
template <DataType T, bool kF16c, int kLanes>
ATTNSERVE_PAGED_INLINE void BlockScoresByDim(const float* q, int64_t rows4,
                                             int64_t dk, const char* keys,
                                             int64_t stride, int64_t n,
                                             int64_t room, float* s,
                                             const char* next_keys) {
  using V = Floats<kLanes>;
  constexpr int kVectors = kLanes == 16 ? 4 : 2;
  constexpr int64_t kChunk = kVectors * kLanes;
  static_assert(kBlock % kChunk == 0);
  constexpr int64_t kElement = T == DataType::kFloat32 ? 4 : 2;
  alignas(64) char padded[kChunk * kElement];
  for (int64_t r0 = 0; r0 < rows4; r0 += 4) {
    const float* q0 = q + r0 * dk;
    const float* q1 = q0 + dk;
    const float* q2 = q1 + dk;
    const float* q3 = q2 + dk;
    float* s0 = s + r0 * kBlock;
    for (int64_t j = 0; j < n; j += kChunk) {
      const bool whole = j + kChunk <= room;
      const bool prefetch = r0 == 0 && j == 0 && next_keys != nullptr;
      V a0[kVectors] = {}, a1[kVectors] = {}, a2[kVectors] = {},
        a3[kVectors] = {};
      for (int64_t d = 0; d < dk; ++d) {
        const char* at = keys + d * stride + j * kElement;
        if (!whole) {
          std::memset(padded, 0, sizeof(padded));
          std::memcpy(padded, at,
                      static_cast<size_t>(std::min(kChunk, n - j) * kElement));
          at = padded;
        }
        if (prefetch) {
          PrefetchLines(next_keys + d * stride, 0, kBlock * kElement);
        }
        V k[kVectors];
        LoadKeys<T, kF16c, kLanes, kVectors>(at, k);
        const float x0 = q0[d], x1 = q1[d], x2 = q2[d], x3 = q3[d];
#pragma GCC unroll 4
        for (int v = 0; v < kVectors; ++v) {
          a0[v] += x0 * k[v];
          a1[v] += x1 * k[v];
          a2[v] += x2 * k[v];
          a3[v] += x3 * k[v];
        }
      }
      V* rows[4] = {a0, a1, a2, a3};
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        float* out = s0 + r * kBlock + j;
        const V* a = rows[r];
        if constexpr (T == DataType::kBFloat16) {
#pragma GCC unroll 2
          for (int v = 0; v < kVectors; v += 2) {
            StoreInOrder(a[v], a[v + 1], out + kLanes * v);
          }
        } else {
#pragma GCC unroll 4
          for (int v = 0; v < kVectors; ++v) {
            StoreVector<kLanes>(out + kLanes * v, a[v]);
          }
        }
      }
    }
  }
}

// o_r += Σ_j p[r · kBlock + j] · v_j for every row r of `o` ([rows4, dv])
// and value j < n of `values` ([n, dv] in T): four rows and 2 · kLanes
// columns at a time, eight accumulators, the values taken four rows at a
// time, each walked front to back, so the block streams through the cache in
// order; the next block's rows prefetched as these are used.
template <DataType T, bool kPairwise, bool kF16c = false, int kLanes = 8>
ATTNSERVE_PAGED_INLINE void BlockAccumulate(const float* p, int64_t rows4,
                                            int64_t n, const char* values,
                                            int64_t dv, float* o,
                                            const char* next_values) {
  using V = Floats<kLanes>;
  const int64_t element = T == DataType::kFloat32 ? 4 : 2;
  const int64_t row_bytes = dv * element;
  // Pairwise: dv a multiple of the run.
  const int64_t end_runs = dv / (2 * kLanes) * (2 * kLanes);
  for (int64_t r0 = 0; r0 < rows4; r0 += 4) {
    const float* p0 = p + r0 * kBlock;
    const float* p1 = p0 + kBlock;
    const float* p2 = p1 + kBlock;
    const float* p3 = p2 + kBlock;
    float* o0 = o + r0 * dv;
    float* o1 = o0 + dv;
    float* o2 = o1 + dv;
    float* o3 = o2 + dv;
    for (int64_t j0 = 0; j0 < n; j0 += 4) {
      const int64_t j_end = std::min<int64_t>(j0 + 4, n);
      if (r0 == 0 && next_values != nullptr) {
        PrefetchLines(next_values, j0 * row_bytes, j_end * row_bytes);
      }
      for (int64_t c = 0; c < end_runs; c += 2 * kLanes) {
        V a0 = LoadVector<kLanes>(o0 + c),
          b0 = LoadVector<kLanes>(o0 + c + kLanes);
        V a1 = LoadVector<kLanes>(o1 + c),
          b1 = LoadVector<kLanes>(o1 + c + kLanes);
        V a2 = LoadVector<kLanes>(o2 + c),
          b2 = LoadVector<kLanes>(o2 + c + kLanes);
        V a3 = LoadVector<kLanes>(o3 + c),
          b3 = LoadVector<kLanes>(o3 + c + kLanes);
        for (int64_t j = j0; j < j_end; ++j) {
          V x, y;
          LoadRun<T, kPairwise, kF16c, kLanes>(values + j * row_bytes, c, &x,
                                               &y);
          a0 += p0[j] * x;
          b0 += p0[j] * y;
          a1 += p1[j] * x;
          b1 += p1[j] * y;
          a2 += p2[j] * x;
          b2 += p2[j] * y;
          a3 += p3[j] * x;
          b3 += p3[j] * y;
        }
        StoreVector<kLanes>(o0 + c, a0);
        StoreVector<kLanes>(o0 + c + kLanes, b0);
        StoreVector<kLanes>(o1 + c, a1);
        StoreVector<kLanes>(o1 + c + kLanes, b1);
        StoreVector<kLanes>(o2 + c, a2);
        StoreVector<kLanes>(o2 + c + kLanes, b2);
        StoreVector<kLanes>(o3 + c, a3);
        StoreVector<kLanes>(o3 + c + kLanes, b3);
      }
    }
    float* rows[4] = {o0, o1, o2, o3};
    const float* weights[4] = {p0, p1, p2, p3};
    for (int64_t c = end_runs; c < dv; ++c) {
      for (int r = 0; r < 4; ++r) {
        float a = rows[r][c];
        for (int64_t j = 0; j < n; ++j) {
          a += weights[r][j] * Load1<T>(values + j * row_bytes, c);
        }
        rows[r][c] = a;
      }
    }
  }
}

// Where a block's keys lie: rows from `data`, or (stride > 0) laid out by
// dimension, dimension d at data + d · stride bytes, `room` keys readable in
// each dimension's row.
struct BlockKeys {
  const char* data;
  int64_t stride;
  int64_t room;
};

// One block of a unit: scores, their fold into each row's softmax (and the
// rows' rescaling), then the values, for keys and values in T.
template <DataType T, bool kPairwise, bool kF16c = false, bool kWide = false>
ATTNSERVE_PAGED_INLINE void RunBlock(const PagedAttend& item, const Unit& unit,
                                     const UnitBuffers& b, int64_t rows,
                                     int64_t rows4, int64_t k0, int64_t n,
                                     bool round, const BlockKeys& keys,
                                     const char* values, const char* next_keys,
                                     const char* next_values) {
  const int64_t dk = item.layout.key_dim;
  const int64_t dv = item.layout.value_dim;
  if (keys.stride > 0) {
    BlockScoresByDim<T, kF16c, kWide ? 16 : 8>(b.query, rows4, dk, keys.data,
                                               keys.stride, n, keys.room,
                                               b.scores, next_keys);
  } else if constexpr (kWide) {
    BlockScoresFourKeys<T, kPairwise, kF16c>(b.query, rows4, dk, keys.data, n,
                                             b.scores, next_keys);
  } else {
    BlockScores<T, kPairwise, kF16c>(b.query, rows4, dk, keys.data, n, b.scores,
                                     next_keys);
  }
  constexpr int kFoldLanes = kWide ? 16 : 8;
  const bool mods = HasScoreMods(item);
  for (int64_t r = 0; r < rows; ++r) {
    const RowKeys& keys_seen = b.keys_seen[r];
    float* s = b.scores + r * kBlock;
    float alpha;
    if (mods) {
      // The modified scores are final: FoldScores scales them by 1.
      const int64_t head = unit.kv_head * GroupOf(item) + r / unit.qn;
      const int64_t position =
          unit.q0 + r % unit.qn + item.length - item.query_len;
      RowScoreMods row_mods;
      row_mods.softcap = item.softcap;
      row_mods.position = position;
      if (!item.alibi_slopes.empty()) {
        row_mods.slope = item.alibi_slopes[static_cast<size_t>(head)];
      }
      ModifyScores(s, n, k0, item.scale, keys_seen, row_mods, RowMask());
      alpha = FoldScores<kFoldLanes>(s, n, n, 1.0f, round, &b.states[r]);
    } else {
      const int64_t visible = std::clamp<int64_t>(keys_seen.end - k0, 0, n);
      alpha = FoldScores<kFoldLanes>(s, n, visible, item.scale, round,
                                     &b.states[r]);
    }
    if (alpha != 1.0f) {
      float* o = b.output + r * dv;
      for (int64_t c = 0; c < dv; c += 8) {
        if (c + 8 <= dv) {
          StoreFloats(o + c, LoadFloats(o + c) * alpha);
        } else {
          for (int64_t i = c; i < dv; ++i) o[i] *= alpha;
        }
      }
    }
  }
  BlockAccumulate<T, kPairwise, kF16c, kWide ? 16 : 8>(
      b.scores, rows4, n, values, dv, b.output, next_values);
}

// Computes `unit` into b's buffers (and `partial`, for a split). Returns
// early, its results undefined, once `stopper` says stop. kF16c: the caller is
// compiled for F16C, which widens f16 pages; kWide: for AVX-512, whose
// pairwise kernels take runs of 32 (PairwiseRun).
template <bool kF16c, bool kWide = false>
__attribute__((always_inline)) inline void UnitBody(
    const PagedAttend& item, const Unit& unit, int64_t splits,
    const UnitBuffers& b, float* partial, Stopper& stopper) {
  const PageLayout& layout = item.layout;
  const int64_t dk = layout.key_dim;
  const int64_t dv = layout.value_dim;
  const int64_t group = GroupOf(item);
  const int64_t rows = group * unit.qn;
  const bool round = item.precision == Precision::kBFloat16;
  const int64_t run = PairwiseRun(item, kWide);
  const bool pairwise = run > 0;
  const bool by_dim = layout.keys_transposed;
  // f32 and f16 blocks (f16 where the compiler widens them with F16C's
  // instruction) in sixteen-lane runs of 32 columns on AVX-512, read in order.
  constexpr bool kWideF16 = kWide && kF16c && kF16cBuiltin;
  const bool wide_in_order = kWide && dk % 32 == 0 && dv % 32 == 0;
  int64_t tile_end = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = unit.kv_head * group + r / unit.qn;
    const int64_t i = unit.q0 + r % unit.qn;
    const float* q = item.query.data() + (h * item.query_len + i) * dk;
    float* row = b.query + r * dk;
    if (round) {
      for (int64_t d = 0; d < dk; ++d) row[d] = RoundToBf16(q[d]);
    } else {
      std::memcpy(row, q, static_cast<size_t>(dk) * sizeof(float));
    }
    if (pairwise && !by_dim) {
      float ordered[32];
      for (int64_t c = 0; c < dk; c += run) {
        std::memcpy(ordered, row + c, static_cast<size_t>(run) * sizeof(float));
        Deinterleave(ordered, run, row + c);
      }
    }
    b.keys_seen[r] = VisibleKeys(RulesOf(item), item.length, item.query_len, i);
    tile_end = std::max(tile_end, b.keys_seen[r].end);
    std::fill(b.output + r * dv, b.output + (r + 1) * dv, 0.0f);
    b.states[r] = {kNegativeInfinity, 0.0f, false};
  }
  // The block kernels take rows four at a time: the rows past the unit's
  // are zero (their scores and output are computed and never read).
  const int64_t rows4 = (rows + 3) / 4 * 4;
  std::fill(b.query + rows * dk, b.query + rows4 * dk, 0.0f);
  std::fill(b.output + rows * dv, b.output + rows4 * dv, 0.0f);
  std::fill(b.scores + rows * kBlock, b.scores + rows4 * kBlock, 0.0f);
  int64_t first, last;
  SplitRange(item.length, splits, unit.split, &first, &last);
  last = std::min(last, tile_end);
  const int64_t page_tokens = layout.page_tokens;
  const int64_t element = DataTypeBytes(layout.dtype);
  // Where the unit's head lies in a page: after each earlier head's keys and
  // values (PageLayout), or, with value_pages, keys and values each [Hkv, ...]
  // in pages of their own.
  const bool apart = !item.value_pages.empty();
  const absl::Span<const char* const> value_pages =
      apart ? item.value_pages : item.pages;
  const int64_t head_keys = apart ? unit.kv_head * layout.HeadKeyBytes()
                                  : layout.KeysAt(unit.kv_head);
  const int64_t head_values = apart ? unit.kv_head * layout.HeadValueBytes()
                                    : layout.ValuesAt(unit.kv_head);
  // Keys no row of the unit sees are skipped, never read: their pages may be
  // null (evicted).
  const KeyGap gap =
      HasScoreMods(item) ? UnseenKeys(item, unit.q0, unit.qn) : KeyGap{};
  // The first key at or past `k` that a row sees.
  const auto seen_from = [&gap](int64_t k) {
    return k >= gap.first && k < gap.last ? gap.last : k;
  };
  for (int64_t k0 = seen_from(first), blocks = 0; k0 < last; ++blocks) {
    if (blocks % kBlocksPerStopPoll == kBlocksPerStopPoll - 1 &&
        stopper.ShouldStop()) {
      return;
    }
    const int64_t page = k0 / page_tokens;
    const int64_t offset = k0 % page_tokens;
    const int64_t block_last = k0 < gap.first && gap.first < gap.last
                                   ? std::min(last, gap.first)
                                   : last;
    const int64_t n = std::min({kBlock, page_tokens - offset, block_last - k0});
    // The unit's head's key and value `at_offset` of page `at_page`.
    const auto key_at = [&](int64_t at_page, int64_t at_offset) {
      return item.pages[static_cast<size_t>(at_page)] + head_keys +
             (by_dim ? at_offset : at_offset * dk) * element;
    };
    const auto value_at = [&](int64_t at_page, int64_t at_offset) {
      return value_pages[static_cast<size_t>(at_page)] + head_values +
             at_offset * dv * element;
    };
    BlockKeys keys{key_at(page, offset), by_dim ? page_tokens * element : 0,
                   page_tokens - offset};
    const char* values = value_at(page, offset);
    DataType type = layout.dtype;
    if (round && type != DataType::kBFloat16) {
      // BF16 precision on f32 or f16 pages: the block rounded to bf16 in the
      // thread's buffers, in the page's layout (keys by dimension: kBlock
      // keys a dimension), then read as f32.
      if (by_dim) {
        for (int64_t d = 0; d < dk; ++d) {
          RoundBlockToBf16<kF16c>(keys.data + d * keys.stride, n, type,
                                  b.keys + d * kBlock);
        }
        keys = {reinterpret_cast<const char*>(b.keys),
                kBlock * static_cast<int64_t>(sizeof(float)), kBlock};
      } else {
        RoundBlockToBf16<kF16c>(keys.data, n * dk, type, b.keys);
        keys = {reinterpret_cast<const char*>(b.keys), 0, n};
      }
      RoundBlockToBf16<kF16c>(values, n * dv, type, b.values);
      values = reinterpret_cast<const char*>(b.values);
      type = DataType::kFloat32;
    }
    // Where the next block lies, to prefetch it.
    const char* next_keys = nullptr;
    const char* next_values = nullptr;
    if (const int64_t next = seen_from(k0 + n);
        next < last && type == layout.dtype) {
      next_keys = key_at(next / page_tokens, next % page_tokens);
      next_values = value_at(next / page_tokens, next % page_tokens);
    }
    if (pairwise && run == 32) {
      RunBlock<DataType::kBFloat16, true, false, kWide>(
          item, unit, b, rows, rows4, k0, n, round, keys, values, next_keys,
          next_values);
    } else if (pairwise) {
      RunBlock<DataType::kBFloat16, true>(item, unit, b, rows, rows4, k0, n,
                                          round, keys, values, next_keys,
                                          next_values);
    } else if (wide_in_order && type == DataType::kFloat32) {
      if constexpr (kWide) {
        RunBlock<DataType::kFloat32, false, false, true>(
            item, unit, b, rows, rows4, k0, n, round, keys, values, next_keys,
            next_values);
      }
    } else if (kWideF16 && wide_in_order && type == DataType::kFloat16) {
      if constexpr (kWideF16) {
        RunBlock<DataType::kFloat16, false, kF16c, true>(
            item, unit, b, rows, rows4, k0, n, round, keys, values, next_keys,
            next_values);
      }
    } else if (type == DataType::kFloat32) {
      RunBlock<DataType::kFloat32, false>(item, unit, b, rows, rows4, k0, n,
                                          round, keys, values, next_keys,
                                          next_values);
    } else if (type == DataType::kBFloat16) {
      RunBlock<DataType::kBFloat16, false>(item, unit, b, rows, rows4, k0, n,
                                           round, keys, values, next_keys,
                                           next_values);
    } else {
      RunBlock<DataType::kFloat16, false, kF16c>(item, unit, b, rows, rows4, k0,
                                                 n, round, keys, values,
                                                 next_keys, next_values);
    }
    k0 = seen_from(k0 + n);
  }
  if (partial != nullptr) {
    std::memcpy(partial, b.output,
                static_cast<size_t>(rows * dv) * sizeof(float));
    float* states = partial + rows * dv;
    for (int64_t r = 0; r < rows; ++r) {
      states[3 * r] = b.states[r].max;
      states[3 * r + 1] = b.states[r].sum;
      states[3 * r + 2] = b.states[r].nan ? 1.0f : 0.0f;
    }
  }
}

using UnitFunction = void (*)(const PagedAttend&, const Unit&, int64_t,
                              const UnitBuffers&, float*, Stopper&);

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))) void
UnitAvx512(const PagedAttend& item, const Unit& unit, int64_t splits,
           const UnitBuffers& b, float* partial, Stopper& stopper) {
  UnitBody<true, true>(item, unit, splits, b, partial, stopper);
}

__attribute__((target("avx2,fma,f16c"))) void UnitAvx2(
    const PagedAttend& item, const Unit& unit, int64_t splits,
    const UnitBuffers& b, float* partial, Stopper& stopper) {
  UnitBody<true>(item, unit, splits, b, partial, stopper);
}

void UnitPortable(const PagedAttend& item, const Unit& unit, int64_t splits,
                  const UnitBuffers& b, float* partial, Stopper& stopper) {
  UnitBody<false>(item, unit, splits, b, partial, stopper);
}

bool CpuHasAvx2() {
  __builtin_cpu_init();
  // Every CPU with AVX2 and FMA has F16C, which the unit is also built for
  // (and which clang's __builtin_cpu_supports cannot name).
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

UnitFunction SelectUnit(PagedCode code) {
  if (code == PagedCode::kPortable) return UnitPortable;
  if (code == PagedCode::kAvx2) return UnitAvx2;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) {
    return UnitAvx512;
  }
  return CpuHasAvx2() ? UnitAvx2 : UnitPortable;
}

// Writes rows [0, rows) of a unit from their accumulated output and state.
// `wide`: the AVX-512 unit computed them (PairwiseRun).
void WriteRows(const PagedAttend& item, const Unit& unit,
               const float* accumulated, const RowState* states, bool wide) {
  const int64_t run = PairwiseRun(item, wide);
  const int64_t group = GroupOf(item);
  const int64_t dv = item.layout.value_dim;
  for (int64_t r = 0; r < group * unit.qn; ++r) {
    const int64_t h = unit.kv_head * group + r / unit.qn;
    const int64_t i = unit.q0 + r % unit.qn;
    const int64_t at = h * item.query_len + i;
    float* out = item.output.data() + at * dv;
    const RowState& state = states[r];
    float lse;
    if (state.nan) {
      std::fill(out, out + dv, kNaN);
      lse = kNaN;
    } else if (state.max == kNegativeInfinity) {
      std::fill(out, out + dv, 0.0f);  // The row sees no key.
      lse = kNegativeInfinity;
    } else {
      const float inverse = 1.0f / state.sum;
      const float* a = accumulated + r * dv;
      if (run > 0) {
        for (int64_t c = 0; c < dv; c += run) {
          for (int64_t e = 0; e < run / 2; ++e) {
            out[c + 2 * e] = a[c + e] * inverse;
            out[c + 2 * e + 1] = a[c + run / 2 + e] * inverse;
          }
        }
      } else {
        for (int64_t c = 0; c < dv; ++c) out[c] = a[c] * inverse;
      }
      lse = state.max + std::log(state.sum);
    }
    if (!item.lse.empty()) item.lse[static_cast<size_t>(at)] = lse;
  }
}

// Merges the splits of the unit whose first split is units[first].
void MergeSplits(absl::Span<const PagedAttend> items, const Plan& plan,
                 int64_t first, const float* partials, float* merged,
                 RowState* states, bool wide) {
  const Unit& unit = plan.units[static_cast<size_t>(first)];
  const PagedAttend& item = items[static_cast<size_t>(unit.item)];
  const int64_t rows = GroupOf(item) * unit.qn;
  const int64_t dv = item.layout.value_dim;
  for (int64_t r = 0; r < rows; ++r) {
    RowState state{kNegativeInfinity, 0.0f, false};
    for (int64_t s = 0; s < plan.splits; ++s) {
      const float* part = partials +
                          plan.units[static_cast<size_t>(first + s)].partial +
                          rows * dv + 3 * r;
      state.max = std::max(state.max, part[0]);
      state.nan = state.nan || part[2] != 0.0f;
    }
    float* out = merged + r * dv;
    std::fill(out, out + dv, 0.0f);
    if (state.max != kNegativeInfinity && !state.nan) {
      for (int64_t s = 0; s < plan.splits; ++s) {
        const float* base =
            partials + plan.units[static_cast<size_t>(first + s)].partial;
        const float* part = base + rows * dv + 3 * r;
        if (part[0] == kNegativeInfinity) continue;
        const float factor = std::exp(part[0] - state.max);
        state.sum += part[1] * factor;
        const float* o = base + r * dv;
        for (int64_t c = 0; c < dv; ++c) out[c] += o[c] * factor;
      }
    }
    states[r] = state;
  }
  WriteRows(item, unit, merged, states, wide);
}

}  // namespace

absl::Status ValidatePagedAttend(absl::Span<const PagedAttend> items) {
  for (size_t i = 0; i < items.size(); ++i) {
    const PagedAttend& item = items[i];
    const PageLayout& layout = item.layout;
    const auto invalid = [i](auto&&... parts) {
      return absl::InvalidArgumentError(
          absl::StrCat("paged attention item ", i, ": ", parts...));
    };
    if (layout.page_tokens < 1 || layout.kv_heads < 1 || layout.key_dim < 1 ||
        layout.value_dim < 1) {
      return invalid(
          "page_tokens, kv_heads, key_dim and value_dim must be "
          "positive");
    }
    if (item.heads < 1 || item.heads % layout.kv_heads != 0) {
      return invalid("heads is ", item.heads,
                     ", expected a positive multiple "
                     "of kv_heads ",
                     layout.kv_heads);
    }
    if (item.query_len < 1 || item.length < 0) {
      return invalid("query_len is ", item.query_len, " and length ",
                     item.length, ", expected query_len >= 1, length >= 0");
    }
    const int64_t pages =
        (item.length + layout.page_tokens - 1) / layout.page_tokens;
    if (static_cast<int64_t>(item.pages.size()) < pages) {
      return invalid(item.pages.size(), " pages for ", item.length,
                     " tokens, expected at least ", pages);
    }
    if (item.window_left < -1 || item.num_sink_tokens < 0 ||
        !(item.softcap >= 0.0f) || !std::isfinite(item.softcap)) {
      return invalid("window_left is ", item.window_left, ", num_sink_tokens ",
                     item.num_sink_tokens, " and softcap ", item.softcap,
                     ", expected >= -1, >= 0 and finite >= 0");
    }
    if (!item.alibi_slopes.empty() &&
        static_cast<int64_t>(item.alibi_slopes.size()) != item.heads) {
      return invalid(item.alibi_slopes.size(), " ALiBi slopes, expected ",
                     item.heads, " (heads)");
    }
    // A page no query row sees may be null (evicted).
    const KeyGap gap =
        HasScoreMods(item) ? UnseenKeys(item, 0, item.query_len) : KeyGap{};
    for (int64_t p = 0; p < pages; ++p) {
      const int64_t first = p * layout.page_tokens;
      const int64_t last = std::min(first + layout.page_tokens, item.length);
      if (item.pages[static_cast<size_t>(p)] == nullptr &&
          !(first >= gap.first && last <= gap.last)) {
        return invalid("page ", p, " is null, and a query row sees it");
      }
    }
    if (!item.value_pages.empty()) {
      if (static_cast<int64_t>(item.value_pages.size()) < pages) {
        return invalid(item.value_pages.size(), " value pages for ",
                       item.length, " tokens, expected at least ", pages);
      }
      for (int64_t p = 0; p < pages; ++p) {
        if (item.value_pages[static_cast<size_t>(p)] == nullptr) {
          return invalid("value page ", p, " is null");
        }
      }
    }
    const int64_t rows = item.heads * item.query_len;
    if (static_cast<int64_t>(item.query.size()) != rows * layout.key_dim ||
        static_cast<int64_t>(item.output.size()) != rows * layout.value_dim ||
        (!item.lse.empty() && static_cast<int64_t>(item.lse.size()) != rows)) {
      return invalid("query, output or lse does not hold [H, Tq, D] = [",
                     item.heads, ", ", item.query_len, ", D] elements");
    }
    if (!std::isfinite(item.scale)) return invalid("scale is not finite");
  }
  return absl::OkStatus();
}

int64_t PagedWorkspaceBytes(absl::Span<const PagedAttend> items, int threads) {
  const Plan plan = MakePlan(items, std::max(threads, 1));
  return (plan.thread_floats * std::max(threads, 1) + plan.partial_floats) *
         static_cast<int64_t>(sizeof(float));
}

bool PagedKeysTransposedOnThisCpu() {
  static const bool transposed = SelectUnit(PagedCode::kNative) == UnitAvx512;
  return transposed;
}

bool PagedAvx2OnThisCpu() {
  static const bool avx2 = CpuHasAvx2();
  return avx2;
}

absl::Status RunPagedAttention(absl::Span<const PagedAttend> items, int threads,
                               PagedCode code, const StopCheck& stop) {
  if (items.empty()) return absl::OkStatus();
  threads = std::max(threads, 1);
  static const UnitFunction kNativeUnit = SelectUnit(PagedCode::kNative);
  const UnitFunction unit_function =
      code == PagedCode::kNative ? kNativeUnit : SelectUnit(code);
  const bool wide = unit_function == UnitAvx512;
  const Plan plan = MakePlan(items, threads);
  const int64_t units = static_cast<int64_t>(plan.units.size());
  const int team = static_cast<int>(std::min<int64_t>(threads, units));
  const size_t floats =
      static_cast<size_t>(plan.thread_floats * team + plan.partial_floats);
  // Whole cache lines, from a line's start (BufferOffsets).
  const size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
  const ScratchPool::Buffer buffer(
      static_cast<char*>(std::aligned_alloc(64, bytes)));
  float* const workspace = reinterpret_cast<float*>(buffer.get());
  if (workspace == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("paged attention: cannot allocate ",
                     floats * sizeof(float), " bytes of workspace"));
  }
  float* partials = workspace + plan.thread_floats * team;
  const int64_t merges = plan.splits > 1 ? units / plan.splits : 0;
  Stopper stopper(stop);
#pragma omp parallel num_threads(team) if (team > 1)
  {
    const UnitBuffers buffers =
        BuffersOf(workspace + plan.thread_floats * omp_get_thread_num(), plan);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      if (stopper.ShouldStop()) continue;
      const Unit& unit = plan.units[static_cast<size_t>(u)];
      const PagedAttend& item = items[static_cast<size_t>(unit.item)];
      unit_function(item, unit, plan.splits, buffers,
                    plan.splits > 1 ? partials + unit.partial : nullptr,
                    stopper);
      if (plan.splits == 1 && !stopper.stopped()) {
        WriteRows(item, unit, buffers.output, buffers.states, wide);
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t m = 0; m < merges; ++m) {
      if (stopper.stopped()) continue;
      MergeSplits(items, plan, m * plan.splits, partials, buffers.output,
                  buffers.states, wide);
    }
  }
  return stopper.status();
}

}  // namespace attnserve::internal
