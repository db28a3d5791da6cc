#include "internal/paged_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include "absl/strings/str_cat.h"
#include "internal/fast_exp.h"
#include "internal/tile_kernels.h"

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
// Units per thread the keys are split into when the steps alone give fewer.
constexpr int64_t kUnitsPerThread = 4;
constexpr int64_t kMaxSplits = 64;

float FloatOf(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

uint32_t BitsOf(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// Branch-free conversions, so that the loops around them vectorise.
inline float Bf16ToFloat(uint16_t h) { return FloatOf(uint32_t{h} << 16); }

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = (uint32_t{h} & 0x8000u) << 16;
  const uint32_t magnitude = uint32_t{h} & 0x7fffu;
  // The half's exponent and mantissa in a float's, scaled by 2^112 from the
  // bias difference: exact for normal and subnormal halves alike.
  uint32_t bits = BitsOf(FloatOf(magnitude << 13) * 0x1p112f);
  if (magnitude >= 0x7c00u) bits = (magnitude << 13) | 0x7f800000u;
  return FloatOf(bits | sign);
}

// x rounded to the nearest bf16, ties to even (NaN stays NaN).
inline float RoundToBf16(float x) {
  const uint32_t bits = BitsOf(x);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  return (bits & 0x7fffffffu) > 0x7f800000u ? x : FloatOf(rounded);
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
int64_t QueriesPerUnit(const PagedAttend& item) {
  return std::clamp<int64_t>(kUnitRows / GroupOf(item), 1, item.query_len);
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
  // Per row: its end (an int64_t, 2 floats), its state (4 floats), its
  // output, query and scores; then a block of keys and one of values. Whole
  // cache lines, so that threads never share one.
  const int64_t rows = plan.max_rows;
  plan.thread_floats =
      rows * (6 + plan.max_value_dim + plan.max_key_dim + kBlock) +
      kBlock * (plan.max_key_dim + plan.max_value_dim);
  plan.thread_floats = (plan.thread_floats + 15) / 16 * 16;
  return plan;
}

// A thread's buffers as one unit uses them.
struct UnitBuffers {
  float* output;     // [rows, Dv] accumulated
  float* query;      // [rows, Dk]
  float* scores;     // [rows, kBlock]
  float* keys;       // [kBlock, Dk]
  float* values;     // [kBlock, Dv]
  RowState* states;  // [rows]
  int64_t* ends;     // [rows] one past the last key each row sees
};

UnitBuffers BuffersOf(float* base, const Plan& plan) {
  static_assert(sizeof(RowState) <= 4 * sizeof(float));
  UnitBuffers b;
  const int64_t rows = plan.max_rows;
  b.ends = reinterpret_cast<int64_t*>(base);
  b.states = reinterpret_cast<RowState*>(base + 2 * rows);
  b.output = base + 6 * rows;
  b.query = b.output + rows * plan.max_value_dim;
  b.scores = b.query + rows * plan.max_key_dim;
  b.keys = b.scores + rows * kBlock;
  b.values = b.keys + kBlock * plan.max_key_dim;
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

// The unit's work, inlined into one function per instruction set (below) so
// that its loops vectorise at that set's width.
__attribute__((always_inline)) inline void ConvertRows(const char* source,
                                                       int64_t count,
                                                       DataType dtype,
                                                       bool round,
                                                       float* destination) {
  switch (dtype) {
    case DataType::kFloat32: {
      const float* f = reinterpret_cast<const float*>(source);
      if (round) {
#pragma omp simd
        for (int64_t i = 0; i < count; ++i) destination[i] = RoundToBf16(f[i]);
      } else {
        std::memcpy(destination, f, static_cast<size_t>(count) * 4);
      }
      break;
    }
    case DataType::kBFloat16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(source);
#pragma omp simd
      for (int64_t i = 0; i < count; ++i) destination[i] = Bf16ToFloat(h[i]);
      break;
    }
    case DataType::kFloat16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(source);
      if (round) {
#pragma omp simd
        for (int64_t i = 0; i < count; ++i) {
          destination[i] = RoundToBf16(HalfToFloat(h[i]));
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < count; ++i) destination[i] = HalfToFloat(h[i]);
      }
      break;
    }
  }
}

// Folds one block's raw scores s[0, n) of a row into `state` (keys at or past
// `visible` masked); writes the probabilities over s and returns the factor
// by which the row's accumulated output must be multiplied.
__attribute__((always_inline)) inline float FoldScores(float* s, int64_t n,
                                                       int64_t visible,
                                                       float scale, bool round,
                                                       RowState* state) {
  float block_max = kNegativeInfinity;
  bool nan = false;
#pragma omp simd reduction(max : block_max) reduction(|| : nan)
  for (int64_t j = 0; j < n; ++j) {
    const float x = j < visible ? s[j] * scale : kNegativeInfinity;
    nan = nan || x != x;
    block_max = std::max(block_max, x);
    s[j] = x;
  }
  if (nan) state->nan = true;
  const float new_max = std::max(state->max, block_max);
  if (new_max == kNegativeInfinity) {
    std::fill(s, s + n, 0.0f);
    return 1.0f;
  }
  const float alpha = state->max == kNegativeInfinity
                          ? 0.0f
                          : ExpNonPositive(state->max - new_max);
  state->max = new_max;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float p = ExpNonPositive(s[j] - new_max);
    sum += p;
    s[j] = round ? RoundToBf16(p) : p;
  }
  state->sum = state->sum * alpha + sum;
  return alpha;
}

__attribute__((always_inline)) inline void UnitBody(const PagedAttend& item,
                                                    const Unit& unit,
                                                    int64_t splits,
                                                    const UnitBuffers& b,
                                                    float* partial) {
  const PageLayout& layout = item.layout;
  const int64_t dk = layout.key_dim;
  const int64_t dv = layout.value_dim;
  const int64_t group = GroupOf(item);
  const int64_t rows = group * unit.qn;
  const bool round = item.precision == Precision::kBFloat16;
  int64_t tile_end = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = unit.kv_head * group + r / unit.qn;
    const int64_t i = unit.q0 + r % unit.qn;
    const float* q = item.query.data() + (h * item.query_len + i) * dk;
    float* row = b.query + r * dk;
    if (round) {
#pragma omp simd
      for (int64_t d = 0; d < dk; ++d) row[d] = RoundToBf16(q[d]);
    } else {
      std::memcpy(row, q, static_cast<size_t>(dk) * sizeof(float));
    }
    b.ends[r] = std::clamp<int64_t>(i + item.length - item.query_len + 1, 0,
                                    item.length);
    tile_end = std::max(tile_end, b.ends[r]);
    std::fill(b.output + r * dv, b.output + (r + 1) * dv, 0.0f);
    b.states[r] = {kNegativeInfinity, 0.0f, false};
  }
  int64_t first, last;
  SplitRange(item.length, splits, unit.split, &first, &last);
  last = std::min(last, tile_end);
  const int64_t page_tokens = layout.page_tokens;
  const int64_t element = DataTypeBytes(layout.dtype);
  for (int64_t k0 = first; k0 < last;) {
    const int64_t page = k0 / page_tokens;
    const int64_t offset = k0 % page_tokens;
    const int64_t n = std::min({kBlock, page_tokens - offset, last - k0});
    const char* base = item.pages[static_cast<size_t>(page)];
    const int64_t row0 = unit.kv_head * page_tokens + offset;
    ConvertRows(base + row0 * dk * element, n * dk, layout.dtype, round,
                b.keys);
    for (int64_t r = 0; r < rows; ++r) {
      const float* q = b.query + r * dk;
      float* s = b.scores + r * kBlock;
      for (int64_t j = 0; j < n; ++j) {
        const float* k = b.keys + j * dk;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dk; ++d) dot += q[d] * k[d];
        s[j] = dot;
      }
      const int64_t visible = std::clamp<int64_t>(b.ends[r] - k0, 0, n);
      const float alpha =
          FoldScores(s, n, visible, item.scale, round, &b.states[r]);
      if (alpha != 1.0f) {
        float* o = b.output + r * dv;
#pragma omp simd
        for (int64_t c = 0; c < dv; ++c) o[c] *= alpha;
      }
    }
    ConvertRows(base + layout.KeyBytes() + row0 * dv * element, n * dv,
                layout.dtype, round, b.values);
    for (int64_t r = 0; r < rows; ++r) {
      const float* p = b.scores + r * kBlock;
      float* o = b.output + r * dv;
      for (int64_t j = 0; j < n; ++j) {
        const float w = p[j];
        if (w == 0.0f) continue;
        const float* v = b.values + j * dv;
#pragma omp simd
        for (int64_t c = 0; c < dv; ++c) o[c] += w * v[c];
      }
    }
    k0 += n;
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
                              const UnitBuffers&, float*);

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) void
UnitAvx512(const PagedAttend& item, const Unit& unit, int64_t splits,
           const UnitBuffers& b, float* partial) {
  UnitBody(item, unit, splits, b, partial);
}

__attribute__((target("avx2,fma"))) void UnitAvx2(const PagedAttend& item,
                                                  const Unit& unit,
                                                  int64_t splits,
                                                  const UnitBuffers& b,
                                                  float* partial) {
  UnitBody(item, unit, splits, b, partial);
}

void UnitPortable(const PagedAttend& item, const Unit& unit, int64_t splits,
                  const UnitBuffers& b, float* partial) {
  UnitBody(item, unit, splits, b, partial);
}

UnitFunction SelectUnit(bool portable_only) {
  if (portable_only) return UnitPortable;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) {
    return UnitAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return UnitAvx2;
  }
  return UnitPortable;
}

// Writes rows [0, rows) of a unit from their accumulated output and state.
void WriteRows(const PagedAttend& item, const Unit& unit,
               const float* accumulated, const RowState* states) {
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
      for (int64_t c = 0; c < dv; ++c) out[c] = a[c] * inverse;
      lse = state.max + std::log(state.sum);
    }
    if (!item.lse.empty()) item.lse[static_cast<size_t>(at)] = lse;
  }
}

// Merges the splits of the unit whose first split is units[first].
void MergeSplits(absl::Span<const PagedAttend> items, const Plan& plan,
                 int64_t first, const float* partials, float* merged,
                 RowState* states) {
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
  WriteRows(item, unit, merged, states);
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
    for (int64_t p = 0; p < pages; ++p) {
      if (item.pages[static_cast<size_t>(p)] == nullptr) {
        return invalid("page ", p, " is null");
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

absl::Status RunPagedAttention(absl::Span<const PagedAttend> items, int threads,
                               bool portable_only) {
  if (items.empty()) return absl::OkStatus();
  threads = std::max(threads, 1);
  static const UnitFunction kUnit = SelectUnit(false);
  const UnitFunction unit_function = portable_only ? UnitPortable : kUnit;
  const Plan plan = MakePlan(items, threads);
  const int64_t units = static_cast<int64_t>(plan.units.size());
  const int team = static_cast<int>(std::min<int64_t>(threads, units));
  const size_t floats =
      static_cast<size_t>(plan.thread_floats * team + plan.partial_floats);
  std::unique_ptr<float[]> workspace(new (std::nothrow) float[floats]);
  if (workspace == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("paged attention: cannot allocate ",
                     floats * sizeof(float), " bytes of workspace"));
  }
  float* partials = workspace.get() + plan.thread_floats * team;
  const int64_t merges = plan.splits > 1 ? units / plan.splits : 0;
#pragma omp parallel num_threads(team) if (team > 1)
  {
    const UnitBuffers buffers = BuffersOf(
        workspace.get() + plan.thread_floats * omp_get_thread_num(), plan);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const Unit& unit = plan.units[static_cast<size_t>(u)];
      const PagedAttend& item = items[static_cast<size_t>(unit.item)];
      unit_function(item, unit, plan.splits, buffers,
                    plan.splits > 1 ? partials + unit.partial : nullptr);
      if (plan.splits == 1) {
        WriteRows(item, unit, buffers.output, buffers.states);
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t m = 0; m < merges; ++m) {
      MergeSplits(items, plan, m * plan.splits, partials, buffers.output,
                  buffers.states);
    }
  }
  return absl::OkStatus();
}

}  // namespace attnserve::internal
