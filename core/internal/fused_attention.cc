#include "internal/fused_attention.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/common/checked_math.h"
#include "attnserve/common/status_macros.h"
#include "internal/dnnl_status.h"
#include "internal/matmul.h"
#include "internal/visibility.h"

namespace attnserve::internal {
namespace {

using dnnl::memory;
using Dims = memory::dims;

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Query rows a tile aims for (all heads of a kv-head group together): enough
// to make each key block's matmuls efficient, few enough that the tile's
// scores, output and the key block stay in a core's L2.
constexpr int64_t kTileRows = 64;
// Keys per block.
constexpr int64_t kKeyBlock = 256;
// Under causality or key_lengths, a tile's last block stops at the first
// multiple of this many keys past the last key any of its rows sees, rather
// than at a whole block: causal tiles at short lengths would otherwise compute
// up to a block of keys nobody sees.
constexpr int64_t kKeyGranule = 64;
// Key-block widths a call may use: each multiple of kKeyGranule up to
// kKeyBlock, and the ragged last block of the keys.
constexpr int kKeyWidths = kKeyBlock / kKeyGranule + 1;
// Tiles of fewer rows use our own vector code, not oneDNN.
constexpr int64_t kSmallRows = 8;
// Split the keys of each tile when there are fewer tiles than this many per
// thread, aiming for about kSplitTarget work items per thread.
constexpr int64_t kSplitBelow = 2;
constexpr int64_t kSplitTarget = 4;
// Every per-thread buffer starts on its own cache line.
constexpr int64_t kAlign = 64;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t AlignUp(int64_t bytes) { return CeilDiv(bytes, kAlign) * kAlign; }

// How a problem is cut into tiles and key blocks.
struct Geometry {
  int64_t group;      // query heads per kv head
  int64_t q_block;    // queries per head in a full tile
  int64_t rows;       // rows of a full tile: group · q_block
  int64_t q_blocks;   // tiles along the queries
  int64_t k_block;    // keys per block
  int64_t k_blocks;   // blocks along the keys
  int64_t tiles;      // B · Hkv · q_blocks
  int64_t splits;     // key chunks per tile (1: no split)
  int64_t chunk;      // key blocks per chunk
  bool small;         // own vector code instead of oneDNN matmuls
  MatmulInput input;  // what matmuls read at this precision on this CPU

  bool Bf16() const { return input != MatmulInput::kF32; }  // BF16 precision
  // Whether the oneDNN tiles read bf16 values (packed keys and values, query
  // rows, probabilities): as bf16, or as f32 on a CPU without a bf16 matmul.
  bool Bf16Tiles() const { return Bf16() && !small; }
  // Whether they read them as bf16, through oneDNN's bf16 matmul.
  bool NativeBf16Tiles() const { return !small && input == MatmulInput::kBf16; }
};

Geometry MakeGeometry(const AttentionShape& s, Precision precision,
                      int threads) {
  Geometry g;
  g.group = s.heads / s.kv_heads;
  g.q_block = std::clamp<int64_t>(kTileRows / g.group, 1, s.query_len);
  g.rows = g.group * g.q_block;
  g.q_blocks = CeilDiv(s.query_len, g.q_block);
  g.k_block = std::min(kKeyBlock, s.key_len);
  g.k_blocks = CeilDiv(s.key_len, g.k_block);
  g.tiles = s.batch * s.kv_heads * g.q_blocks;
  g.splits = 1;
  if (threads > 1 && g.tiles < kSplitBelow * threads && g.k_blocks > 1) {
    g.splits = std::min(g.k_blocks, CeilDiv(kSplitTarget * threads, g.tiles));
  }
  g.chunk = CeilDiv(g.k_blocks, g.splits);
  g.splits = CeilDiv(g.k_blocks, g.chunk);
  g.small = g.rows < kSmallRows;
  g.input = MatmulInputFor(precision);
  return g;
}

// oneDNN's scratchpad for one tile matmul is the copy of a key or value block
// it repacks; this bounds it for the workspace check before any primitive is
// built (the real sizes are used when allocating).
int64_t ScratchpadAllowance(const AttentionShape& s, const Geometry& g) {
  return 2 * g.k_block * std::max(s.key_dim, s.value_dim) * 4 + (64 << 10);
}

// Byte offsets of one thread's buffers.
struct ThreadLayout {
  int64_t query, scores, probabilities, output, states, ends, scratchpad, total;
};

ThreadLayout MakeThreadLayout(const AttentionShape& s, const Geometry& g,
                              int64_t scratchpad_bytes) {
  ThreadLayout t;
  int64_t at = 0;
  auto take = [&at](int64_t bytes) {
    const int64_t offset = at;
    at += AlignUp(bytes);
    return offset;
  };
  t.query = take(g.rows * s.key_dim * 4);
  t.scores = take(g.rows * g.k_block * 4);
  t.probabilities = take(g.NativeBf16Tiles() ? g.rows * g.k_block * 2 : 0);
  t.output = take(g.rows * s.value_dim * 4);
  t.states = take(g.rows * static_cast<int64_t>(sizeof(RowState)));
  t.ends = take(g.q_block * 8);
  t.scratchpad = take(scratchpad_bytes);
  t.total = at;
  return t;
}

// The partial results of split tiles: every split's output rows, then (from
// this offset) their row states.
int64_t PartialStatesOffset(const AttentionShape& s, const Geometry& g) {
  return AlignUp(g.tiles * g.splits * g.rows * s.value_dim * 4);
}

int64_t PartialBytes(const AttentionShape& s, const Geometry& g) {
  if (g.splits == 1) return 0;
  return PartialStatesOffset(s, g) +
         g.tiles * g.splits * g.rows * static_cast<int64_t>(sizeof(RowState));
}

// Bytes of the packed key and value copies.
int64_t PackedKeyValueBytes(const AttentionShape& s, const Geometry& g,
                            bool key_value_packed) {
  if (!g.Bf16Tiles() && key_value_packed) return 0;
  return (s.KeyElements() + s.ValueElements()) *
         (g.Bf16Tiles() ? BytesOf(g.input) : 4);
}

std::string TileKey(int64_t m, int64_t n, const AttentionShape& s,
                    MatmulInput input) {
  return absl::StrCat(m, ",", n, ",", s.key_dim, ",", s.value_dim, ",",
                      static_cast<int>(input));
}

// Built for one thread: the caller holds omp_set_num_threads(1) around this,
// so oneDNN plans no parallelism inside the tile.
TilePlan MakeTilePlan(const dnnl::engine& engine, int64_t m, int64_t n,
                      const AttentionShape& s, MatmulInput input) {
  const auto f32 = memory::data_type::f32;
  const auto in = DataTypeOf(input);
  TilePlan plan;
  plan.query_md = memory::desc({m, s.key_dim}, in, Dims{s.key_dim, 1});
  plan.key_t_md = memory::desc({s.key_dim, n}, in, Dims{1, s.key_dim});
  plan.scores_md = memory::desc({m, n}, f32, Dims{n, 1});
  plan.probabilities_md = memory::desc({m, n}, in, Dims{n, 1});
  plan.value_md = memory::desc({n, s.value_dim}, in, Dims{s.value_dim, 1});
  plan.output_md = memory::desc({m, s.value_dim}, f32, Dims{s.value_dim, 1});
  dnnl::primitive_attr scores_attr;
  scores_attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const dnnl::matmul::primitive_desc scores_pd = MakeMatmulPrimitiveDesc(
      dnnl::matmul::desc(plan.query_md, plan.key_t_md, plan.scores_md),
      scores_attr, engine);
  dnnl::post_ops accumulate;
  accumulate.append_sum(1.0f);
  dnnl::primitive_attr context_attr;
  context_attr.set_post_ops(accumulate);
  context_attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const dnnl::matmul::primitive_desc context_pd = MakeMatmulPrimitiveDesc(
      dnnl::matmul::desc(plan.probabilities_md, plan.value_md, plan.output_md),
      context_attr, engine);
  plan.scores = dnnl::matmul(scores_pd);
  plan.context = dnnl::matmul(context_pd);
  plan.scores_scratchpad_md = scores_pd.scratchpad_desc();
  plan.context_scratchpad_md = context_pd.scratchpad_desc();
  return plan;
}

// A oneDNN memory object held through the C API, whose calls report errors
// as statuses: the tile loop runs inside an OpenMP region, where nothing may
// throw.
class MemoryHandle {
 public:
  MemoryHandle() = default;
  MemoryHandle(const MemoryHandle&) = delete;
  MemoryHandle& operator=(const MemoryHandle&) = delete;
  ~MemoryHandle() {
    if (handle_ != nullptr) dnnl_memory_destroy(handle_);
  }

  dnnl_status_t Create(const memory::desc& md, dnnl_engine_t engine,
                       void* data) {
    return dnnl_memory_create(&handle_, &md.data, engine, data);
  }
  dnnl_memory_t get() const { return handle_; }

 private:
  dnnl_memory_t handle_ = nullptr;
};

// One thread's handles on a tile plan, made on first use: memory objects
// whose data pointers move from block to block.
struct TileBinding {
  const TilePlan* plan = nullptr;
  MemoryHandle query, key_t, scores, probabilities, value, output,
      scores_scratchpad, context_scratchpad;

  dnnl_status_t Bind(const TilePlan& tile_plan, dnnl_engine_t engine,
                     char* scratchpad) {
    // Placeholder data pointers until each execution sets the real ones.
    const std::pair<MemoryHandle*, const memory::desc*> handles[] = {
        {&query, &tile_plan.query_md},
        {&key_t, &tile_plan.key_t_md},
        {&scores, &tile_plan.scores_md},
        {&probabilities, &tile_plan.probabilities_md},
        {&value, &tile_plan.value_md},
        {&output, &tile_plan.output_md},
        {&scores_scratchpad, &tile_plan.scores_scratchpad_md},
        {&context_scratchpad, &tile_plan.context_scratchpad_md}};
    for (const auto& [handle, md] : handles) {
      const dnnl_status_t status = handle->Create(*md, engine, scratchpad);
      if (status != dnnl_success) return status;
    }
    plan = &tile_plan;
    return dnnl_success;
  }
};

// What one thread computes with during a call.
struct ThreadContext {
  char* buffer = nullptr;
  dnnl::stream stream;
  // [m is full or last][KeyWidthIndex(n)].
  TileBinding bindings[2][kKeyWidths];
};

dnnl_status_t Execute(const dnnl::matmul& matmul, const dnnl::stream& stream,
                      dnnl_memory_t src, dnnl_memory_t weights,
                      dnnl_memory_t dst, dnnl_memory_t scratchpad) {
  dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, src},
                             {DNNL_ARG_WEIGHTS, weights},
                             {DNNL_ARG_DST, dst},
                             {DNNL_ARG_SCRATCHPAD, scratchpad}};
  return dnnl_primitive_execute(matmul.get(), stream.get(), 4, args);
}

// The running computation of one call.
class FusedRun {
 public:
  FusedRun(const SdpaProblem& p, const Geometry& g, const TileKernels& kernels)
      : p_(p), s_(p.shape), g_(g), kernels_(kernels) {}

  absl::Status Run(const dnnl::engine& engine, int threads,
                   TilePlanCache& cache, ScratchPool& pool);

 private:
  // Keys in the last block of the keys (a whole block or fewer).
  int64_t LastKeys() const {
    return s_.key_len - (g_.k_blocks - 1) * g_.k_block;
  }

  // Whether a tile's last block may stop short of a whole block.
  bool ShortensLastBlock() const {
    return p_.options->causal || !p_.options->key_lengths.empty();
  }

  // The slot of a key-block width: multiples of kKeyGranule by size, the
  // ragged last block of the keys after them.
  static int KeyWidthIndex(int64_t n) {
    return n % kKeyGranule == 0 ? static_cast<int>(n / kKeyGranule) - 1
                                : kKeyWidths - 1;
  }

  // Bytes per element of the keys and values the tiles read: bf16 for the
  // bf16 matmuls, else f32.
  int64_t PackedElementBytes() const {
    return g_.Bf16Tiles() ? BytesOf(g_.input) : 4;
  }

  // Copies the [B, Hkv, Lk, dim] tensor whose batch entry b starts at
  // `of(p_, b)` (with `strides`) into `out` as dense rows of the matmuls' type,
  // on the calling thread's team.
  void Pack(const float* (*of)(const SdpaProblem&, int64_t),
            const Strides4& strides, int64_t dim, char* out) const {
    const int64_t entry = s_.kv_heads * s_.key_len * dim;  // Elements.
    if (!g_.Bf16Tiles()) {
      for (int64_t b = 0; b < s_.batch; ++b) {
        CopyTensor4(of(p_, b), strides,
                    reinterpret_cast<float*>(out) + b * entry,
                    PackedStrides(s_.kv_heads, s_.key_len, dim),
                    {1, s_.kv_heads, s_.key_len, dim});
      }
      return;
    }
    uint16_t* packed = reinterpret_cast<uint16_t*>(out);
    float* rounded = reinterpret_cast<float*>(out);
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < s_.batch; ++b) {
      for (int64_t h = 0; h < s_.kv_heads; ++h) {
        for (int64_t j = 0; j < s_.key_len; ++j) {
          const float* row = of(p_, b) + h * strides[1] + j * strides[2];
          const int64_t at = b * entry + (h * s_.key_len + j) * dim;
          if (g_.NativeBf16Tiles()) {
            kernels_.to_bf16(row, dim, packed + at);
          } else {
            RoundToBf16Values(row, dim, rounded + at);
          }
        }
      }
    }
  }

  // The first rows of (batch entry b, kv head h) of the keys or the values
  // (`packed`, `of`, `strides`, `dim` naming which), as the tiles read them: in
  // the packed copy if there is one, else in place.
  const char* Rows(const void* packed,
                   const float* (*of)(const SdpaProblem&, int64_t),
                   const Strides4& strides, int64_t dim, int64_t b,
                   int64_t h) const {
    if (packed_.get() != nullptr) {
      return static_cast<const char*>(packed) +
             (b * s_.kv_heads + h) * s_.key_len * dim * PackedElementBytes();
    }
    return reinterpret_cast<const char*>(of(p_, b) + h * strides[1]);
  }

  // Computes tile `tile` (all splits if `split` < 0, else that one) on the
  // calling thread. Returns a oneDNN status.
  dnnl_status_t RunTile(int64_t tile, int64_t split, ThreadContext& context);
  // Merges the splits of every tile into the output.
  void MergeSplits(int threads);
  // Writes one row's output and lse from its accumulated state.
  void WriteRow(int64_t b, int64_t h, int64_t i, const float* accumulated,
                const RowState& state);

  const SdpaProblem& p_;
  const AttentionShape& s_;
  const Geometry& g_;
  const TileKernels& kernels_;
  ThreadLayout layout_{};
  // Packed keys and values, if the tiles read those: dense rows, f32 or bf16.
  const void* key_ = nullptr;
  const void* value_ = nullptr;
  ScratchPool::Lease packed_;
  ScratchPool::Lease workspace_;
  // The tile plans by [m is full or last][KeyWidthIndex(n)], and the engine
  // to bind them on.
  const TilePlan* plans_[2][kKeyWidths] = {};
  dnnl_engine_t engine_ = nullptr;
  char* partials_ = nullptr;
};

absl::Status FusedRun::Run(const dnnl::engine& engine, int threads,
                           TilePlanCache& cache, ScratchPool& pool) {
  // Keys and values with dense rows, in the matmuls' type (decode tiles
  // round f32 to bf16 as they read, so they only need dense rows).
  if (g_.Bf16Tiles() || !KeyValuePacked(p_)) {
    const int64_t element = PackedElementBytes();
    const int64_t key_bytes = AlignUp(s_.KeyElements() * element);
    packed_ = pool.Acquire(key_bytes + s_.ValueElements() * element);
    if (packed_.get() == nullptr) {
      return absl::ResourceExhaustedError(
          "fused attention: cannot allocate packed keys and values");
    }
    Pack(&KeyOf, p_.key_strides, s_.key_dim, packed_.get());
    Pack(&ValueOf, p_.value_strides, s_.value_dim, packed_.get() + key_bytes);
    key_ = packed_.get();
    value_ = packed_.get() + key_bytes;
  }  // Else the tiles read them in place (Rows).

  // Tile plans, built single-threaded and shared through the cache.
  const int64_t last_rows =
      g_.group * (s_.query_len - (g_.q_blocks - 1) * g_.q_block);
  const int64_t ms[2] = {g_.rows, last_rows};
  // The key-block widths this call can use.
  std::vector<int64_t> ns = {g_.k_block, LastKeys()};
  if (ShortensLastBlock()) {
    for (int64_t n = kKeyGranule; n < g_.k_block; n += kKeyGranule) {
      ns.push_back(n);
    }
  }
  std::shared_ptr<const TilePlan> plans[2][kKeyWidths];
  int64_t scratchpad_bytes = 0;
  if (!g_.small) {
    omp_set_num_threads(1);
    const absl::Status built = CallDnnl("building tile matmuls", [&] {
      for (int a = 0; a < 2; ++a) {
        for (const int64_t n : ns) {
          std::shared_ptr<const TilePlan>& plan = plans[a][KeyWidthIndex(n)];
          if (plan != nullptr) continue;
          plan = cache.GetOrCreate(TileKey(ms[a], n, s_, g_.input), [&] {
            return MakeTilePlan(engine, ms[a], n, s_, g_.input);
          });
          scratchpad_bytes = std::max<int64_t>(
              {scratchpad_bytes,
               static_cast<int64_t>(plan->scores_scratchpad_md.get_size()),
               static_cast<int64_t>(plan->context_scratchpad_md.get_size())});
        }
      }
    });
    omp_set_num_threads(threads);
    if (!built.ok()) return built;
  }

  layout_ = MakeThreadLayout(s_, g_, scratchpad_bytes);
  const int64_t partial_bytes = PartialBytes(s_, g_);
  const int64_t total = layout_.total * threads + AlignUp(partial_bytes);
  workspace_ = pool.Acquire(total);
  if (workspace_.get() == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "fused attention: cannot allocate ", total, " bytes of workspace"));
  }
  partials_ = workspace_.get() + layout_.total * threads;

  std::vector<ThreadContext> contexts(static_cast<size_t>(threads));
  ATTNSERVE_RETURN_IF_ERROR(CallDnnl("creating streams", [&] {
    for (int t = 0; t < threads; ++t) {
      ThreadContext& context = contexts[static_cast<size_t>(t)];
      context.buffer = workspace_.get() + layout_.total * t;
      context.stream = dnnl::stream(engine);
    }
  }));
  engine_ = engine.get();
  for (int a = 0; a < 2; ++a) {
    for (int c = 0; c < kKeyWidths; ++c) plans_[a][c] = plans[a][c].get();
  }

  // Tiles handed out one at a time, a head's in a row so that its keys and
  // values stay in cache from one tile to the next, and within a head the
  // heaviest first (under causality the last query blocks see the most keys).
  const int64_t items = g_.tiles * g_.splits;
  std::atomic<int> failure{dnnl_success};
#pragma omp parallel for num_threads(threads) \
    schedule(dynamic, 1) if (threads > 1 && items > 1)
  for (int64_t item = 0; item < items; ++item) {
    if (failure.load(std::memory_order_relaxed) != dnnl_success) continue;
    const int64_t split = item % g_.splits;
    const int64_t order = item / g_.splits;
    const int64_t q_block = g_.q_blocks - 1 - order % g_.q_blocks;
    const int64_t tile = (order / g_.q_blocks) * g_.q_blocks + q_block;
    const dnnl_status_t status =
        RunTile(tile, g_.splits == 1 ? -1 : split,
                contexts[static_cast<size_t>(omp_get_thread_num())]);
    if (status != dnnl_success) failure.store(status);
  }
  if (failure.load() != dnnl_success) {
    return absl::InternalError(absl::StrCat(
        "fused attention: a tile matmul failed with oneDNN status ",
        failure.load()));
  }
  if (g_.splits > 1) MergeSplits(threads);
  return absl::OkStatus();
}

dnnl_status_t FusedRun::RunTile(int64_t tile, int64_t split,
                                ThreadContext& context) {
  const int64_t q_block = tile % g_.q_blocks;
  const int64_t bh = tile / g_.q_blocks;
  const int64_t b = bh / s_.kv_heads;
  const int64_t kv_head = bh % s_.kv_heads;
  const int64_t q0 = q_block * g_.q_block;
  const int64_t qn = std::min(g_.q_block, s_.query_len - q0);
  const int64_t m = g_.group * qn;  // row r: head kv_head·group + r / qn,
                                    // query q0 + r % qn
  const int mi = m == g_.rows ? 0 : 1;

  char* buffer = context.buffer;
  float* scores = reinterpret_cast<float*>(buffer + layout_.scores);
  uint16_t* probabilities =
      reinterpret_cast<uint16_t*>(buffer + layout_.probabilities);
  float* output = reinterpret_cast<float*>(buffer + layout_.output);
  RowState* states = reinterpret_cast<RowState*>(buffer + layout_.states);
  int64_t* ends = reinterpret_cast<int64_t*>(buffer + layout_.ends);

  // The keys each query of the tile may see, and the blocks that any sees.
  int64_t tile_end = 0;
  for (int64_t i = 0; i < qn; ++i) {
    ends[i] = VisibleKeyEnd(s_, *p_.options, b, q0 + i);
    tile_end = std::max(tile_end, ends[i]);
  }
  int64_t first_block = 0;
  int64_t last_block = CeilDiv(tile_end, g_.k_block);
  if (split >= 0) {
    first_block = std::min(last_block, split * g_.chunk);
    last_block = std::min(last_block, first_block + g_.chunk);
  }

  // The query tile: rows of every head of the group, in the matmul's type.
  const Strides4& qs = p_.query_strides;
  float* query_f32 = reinterpret_cast<float*>(buffer + layout_.query);
  uint16_t* query_bf16 = reinterpret_cast<uint16_t*>(buffer + layout_.query);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t h = kv_head * g_.group + r / qn;
    const float* row = QueryOf(p_, b) + h * qs[1] + (q0 + r % qn) * qs[2];
    if (g_.NativeBf16Tiles()) {
      kernels_.to_bf16(row, s_.key_dim, query_bf16 + r * s_.key_dim);
    } else if (g_.Bf16()) {
      // Decode tiles, and the f32 matmuls of a CPU without bf16 ones, read
      // f32 rows holding bf16 values.
      RoundToBf16Values(row, s_.key_dim, query_f32 + r * s_.key_dim);
    } else {
      std::memcpy(query_f32 + r * s_.key_dim, row,
                  static_cast<size_t>(s_.key_dim) * 4);
    }
  }
  std::fill(output, output + m * s_.value_dim, 0.0f);
  std::fill(states, states + m, RowState{kNegativeInfinity, 0.0f, false});

  const AttentionMask* mask = p_.options->mask ? &*p_.options->mask : nullptr;
  const MaskStrides mask_strides =
      mask != nullptr ? StridesOf(*mask) : MaskStrides{0, 0, 0, 0};
  const int64_t element = PackedElementBytes();
  const char* const key_rows =
      Rows(key_, &KeyOf, p_.key_strides, s_.key_dim, b, kv_head);
  const char* const value_rows =
      Rows(value_, &ValueOf, p_.value_strides, s_.value_dim, b, kv_head);
  for (int64_t block = first_block; block < last_block; ++block) {
    const int64_t k0 = block * g_.k_block;
    int64_t n = std::min(g_.k_block, s_.key_len - k0);
    if (ShortensLastBlock() && tile_end - k0 < n) {
      n = std::min(n, CeilDiv(tile_end - k0, kKeyGranule) * kKeyGranule);
    }
    const int ni = KeyWidthIndex(n);
    const char* key_block = key_rows + k0 * s_.key_dim * element;
    const char* value_block = value_rows + k0 * s_.value_dim * element;

    if (g_.small) {
      if (g_.Bf16()) {
        kernels_.small_scores_bf16(query_f32, m, s_.key_dim,
                                   reinterpret_cast<const float*>(key_block), n,
                                   scores, n);
      } else {
        kernels_.small_scores_f32(query_f32, m, s_.key_dim,
                                  reinterpret_cast<const float*>(key_block), n,
                                  scores, n);
      }
    } else {
      TileBinding& binding = context.bindings[mi][ni];
      if (binding.plan == nullptr) {
        const dnnl_status_t status =
            binding.Bind(*plans_[mi][ni], engine_, buffer + layout_.scratchpad);
        if (status != dnnl_success) return status;
      }
      dnnl_memory_set_data_handle(binding.query.get(), buffer + layout_.query);
      dnnl_memory_set_data_handle(binding.key_t.get(),
                                  const_cast<char*>(key_block));
      dnnl_memory_set_data_handle(binding.scores.get(), scores);
      const dnnl_status_t status =
          Execute(binding.plan->scores, context.stream, binding.query.get(),
                  binding.key_t.get(), binding.scores.get(),
                  binding.scores_scratchpad.get());
      if (status != dnnl_success) return status;
    }

    // Fold the block into each row's softmax; rescale what the row has
    // accumulated if its max moved.
    for (int64_t r = 0; r < m; ++r) {
      const int64_t i = q0 + r % qn;
      const int64_t h = kv_head * g_.group + r / qn;
      const int64_t visible = std::clamp<int64_t>(ends[r % qn] - k0, 0, n);
      RowMask row_mask;
      if (mask != nullptr) {
        const int64_t offset = b * mask_strides.batch + h * mask_strides.head +
                               i * mask_strides.query + k0 * mask_strides.key;
        if (mask->bias != nullptr) {
          row_mask.bias = mask->bias + offset;
          row_mask.bias_stride = mask_strides.key;
        } else {
          row_mask.allowed = mask->allowed + offset;
          row_mask.allowed_stride = mask_strides.key;
        }
      }
      float* row_scores = scores + r * n;
      const float alpha = kernels_.softmax_block(
          row_scores, n, visible, p_.scale, row_mask, &states[r],
          g_.NativeBf16Tiles() ? probabilities + r * n : nullptr);
      if (g_.Bf16Tiles() && !g_.NativeBf16Tiles()) {
        RoundToBf16Values(row_scores, n, row_scores);
      }
      if (alpha != 1.0f) {
        float* out = output + r * s_.value_dim;
        for (int64_t c = 0; c < s_.value_dim; ++c) out[c] *= alpha;
      }
    }

    if (g_.small) {
      if (g_.Bf16()) {
        kernels_.small_accumulate_bf16(
            scores, n, m, n, reinterpret_cast<const float*>(value_block),
            s_.value_dim, output);
      } else {
        kernels_.small_accumulate_f32(
            scores, n, m, n, reinterpret_cast<const float*>(value_block),
            s_.value_dim, output);
      }
    } else {
      TileBinding& binding = context.bindings[mi][ni];
      dnnl_memory_set_data_handle(
          binding.probabilities.get(),
          g_.NativeBf16Tiles() ? static_cast<void*>(probabilities) : scores);
      dnnl_memory_set_data_handle(binding.value.get(),
                                  const_cast<char*>(value_block));
      dnnl_memory_set_data_handle(binding.output.get(), output);
      const dnnl_status_t status =
          Execute(binding.plan->context, context.stream,
                  binding.probabilities.get(), binding.value.get(),
                  binding.output.get(), binding.context_scratchpad.get());
      if (status != dnnl_success) return status;
    }
  }

  if (split >= 0) {
    // Keep the partial result for MergeSplits.
    const int64_t slot = (tile * g_.splits + split) * g_.rows;
    float* partial_output =
        reinterpret_cast<float*>(partials_) + slot * s_.value_dim;
    RowState* partial_states =
        reinterpret_cast<RowState*>(partials_ + PartialStatesOffset(s_, g_)) +
        slot;
    std::memcpy(partial_output, output,
                static_cast<size_t>(m * s_.value_dim) * 4);
    std::copy(states, states + m, partial_states);
    return dnnl_success;
  }
  for (int64_t r = 0; r < m; ++r) {
    WriteRow(b, kv_head * g_.group + r / qn, q0 + r % qn,
             output + r * s_.value_dim, states[r]);
  }
  return dnnl_success;
}

void FusedRun::MergeSplits(int threads) {
  const float* partial_outputs = reinterpret_cast<const float*>(partials_);
  const RowState* partial_states = reinterpret_cast<const RowState*>(
      partials_ + PartialStatesOffset(s_, g_));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> merged(static_cast<size_t>(s_.value_dim));
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < g_.tiles; ++tile) {
      const int64_t q_block = tile % g_.q_blocks;
      const int64_t bh = tile / g_.q_blocks;
      const int64_t b = bh / s_.kv_heads;
      const int64_t kv_head = bh % s_.kv_heads;
      const int64_t q0 = q_block * g_.q_block;
      const int64_t qn = std::min(g_.q_block, s_.query_len - q0);
      for (int64_t r = 0; r < g_.group * qn; ++r) {
        RowState state{kNegativeInfinity, 0.0f, false};
        for (int64_t split = 0; split < g_.splits; ++split) {
          const RowState& part =
              partial_states[(tile * g_.splits + split) * g_.rows + r];
          state.max = std::max(state.max, part.max);
          state.nan = state.nan || part.nan;
        }
        std::fill(merged.begin(), merged.end(), 0.0f);
        if (state.max != kNegativeInfinity && !state.nan) {
          for (int64_t split = 0; split < g_.splits; ++split) {
            const int64_t slot = (tile * g_.splits + split) * g_.rows + r;
            const RowState& part = partial_states[slot];
            if (part.max == kNegativeInfinity) continue;
            const float factor = std::exp(part.max - state.max);
            state.sum += part.sum * factor;
            const float* out = partial_outputs + slot * s_.value_dim;
            for (int64_t c = 0; c < s_.value_dim; ++c) {
              merged[static_cast<size_t>(c)] += out[c] * factor;
            }
          }
        }
        WriteRow(b, kv_head * g_.group + r / qn, q0 + r % qn, merged.data(),
                 state);
      }
    }
  }
}

void FusedRun::WriteRow(int64_t b, int64_t h, int64_t i,
                        const float* accumulated, const RowState& state) {
  const Strides4& os = p_.output_strides;
  float* out = OutputOf(p_, b) + h * os[1] + i * os[2];
  float lse;
  if (state.nan) {
    std::fill(out, out + s_.value_dim, kNaN);
    lse = kNaN;
  } else if (state.max == kNegativeInfinity) {
    // The row may see no key.
    std::fill(out, out + s_.value_dim, 0.0f);
    lse = kNegativeInfinity;
  } else {
    const float inverse = 1.0f / state.sum;
    for (int64_t c = 0; c < s_.value_dim; ++c)
      out[c] = accumulated[c] * inverse;
    lse = state.max + std::log(state.sum);
  }
  if (float* slot = LseOf(p_, b, h, i); slot != nullptr) *slot = lse;
}

}  // namespace

bool KeyValuePacked(const SdpaProblem& p) {
  return p.key_strides[2] == p.shape.key_dim && p.key_strides[3] == 1 &&
         p.value_strides[2] == p.shape.value_dim && p.value_strides[3] == 1;
}

std::optional<int64_t> FusedWorkspaceBytes(const AttentionShape& s,
                                           Precision precision, int threads,
                                           bool key_value_packed) {
  // Every product below is of dims the caller validated (each tensor's
  // element count fits), times small constants.
  const Geometry g = MakeGeometry(s, precision, threads);
  const ThreadLayout layout =
      MakeThreadLayout(s, g, g.small ? 0 : ScratchpadAllowance(s, g));
  return CheckedSum({CheckedProduct({layout.total, threads}),
                     CheckedProduct({AlignUp(PartialBytes(s, g)), 1}),
                     PackedKeyValueBytes(s, g, key_value_packed)});
}

absl::Status RunFusedAttention(const dnnl::engine& engine,
                               const SdpaProblem& problem, int threads,
                               const TileKernels& kernels, TilePlanCache& cache,
                               ScratchPool& pool) {
  const Geometry geometry =
      MakeGeometry(problem.shape, problem.options->precision, threads);
  FusedRun run(problem, geometry, kernels);
  return run.Run(engine, threads, cache, pool);
}

}  // namespace attnserve::internal
