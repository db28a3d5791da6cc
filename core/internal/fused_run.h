// One call of the fused kernel (internal/fused_attention.h) while it runs.
// fused_attention.cc prepares the call (packed keys and values, tile plans,
// workspace, one context per thread), hands the tiles to the threads and merges
// split tiles; fused_tile.cc computes one tile, step by step.
#ifndef ATTNSERVE_CORE_INTERNAL_FUSED_RUN_H_
#define ATTNSERVE_CORE_INTERNAL_FUSED_RUN_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "attnserve/core/attention_types.h"
#include "internal/fused_plan.h"
#include "internal/scratch_pool.h"
#include "internal/sdpa_problem.h"
#include "internal/stopper.h"
#include "internal/tile_kernels.h"
#include "internal/tile_matmuls.h"
#include "internal/visibility.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::internal::fused {

inline constexpr float kNegativeInfinity =
    -std::numeric_limits<float>::infinity();
inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The row counts a call's tile matmuls may have: a full tile's, the last
// tile's, and under bands a band's and the last band of either tile.
inline constexpr int kTilePlans = 5;

// What one thread computes with during a call.
struct ThreadContext {
  char* buffer = nullptr;  // ThreadLayout's buffers
  dnnl::stream stream;
  // [FusedRun::PlanIndex(m)][KeyWidthIndex(n)].
  TileBinding bindings[kTilePlans][kKeyWidths];
};

// One tile: the query rows [q0, q0 + qn) of batch entry b, for every query
// head that reads kv head `kv_head`. Its row r is query Query(r) of head
// Head(r): the heads of a query are neighbours, so that the rows of a run of
// queries (a band) are a run of rows.
struct Tile {
  int64_t index;  // in [0, Geometry::tiles)
  int64_t b;
  int64_t kv_head;
  int64_t q0;
  int64_t qn;
  int64_t group;  // query heads per kv head
  int64_t rows;   // group · qn

  int64_t Head(int64_t r) const { return kv_head * group + r % group; }
  // The row's query among the tile's: [0, qn).
  int64_t LocalQuery(int64_t r) const { return r / group; }
  int64_t Query(int64_t r) const { return q0 + LocalQuery(r); }
};

// Rows [first, last) of a tile.
struct RowRange {
  int64_t first;
  int64_t last;

  int64_t size() const { return last - first; }
};

// A thread's buffers (ThreadLayout) as one tile uses them.
struct TileBuffers {
  char* query;              // the tile's query rows, as the scores matmul reads
                            // (the input's own rows if QueryInPlace)
  float* scores;            // [rows, n] scores, then probabilities
  uint16_t* probabilities;  // [rows, n] bf16 probabilities (NativeBf16Tiles)
  float* output;            // [rows, Dv] accumulated output
  RowState* states;         // [rows] online-softmax states
  RowKeys* keys;            // [qn] the keys each query may see
  float* widened;           // a block's keys then values widened (half inputs)
  char* scratchpad;         // the tile matmuls' scratchpad
};

// The key blocks a tile (or one split of it) walks: [first, last).
struct BlockRange {
  int64_t first;
  int64_t last;
};

// One block of keys as a tile reads it.
struct KeyBlock {
  int64_t k0;            // its first key
  int64_t n;             // keys in it
  int width;             // KeyWidthIndex(n)
  const char* keys;      // its first key row
  const char* values;    // its first value row
  int64_t key_stride;    // elements from one key row to the next
  int64_t value_stride;  // and from one value row to the next
  int64_t element;       // bytes per element of the rows
};

// The keys the rows of a tile see, in sum.
struct TileSpan {
  int64_t end;             // one past the last key any row sees
  int64_t least_end;       // the least end of a row's keys
  int64_t greatest_start;  // the greatest start of a row's window

  // Whether every row sees every key of [k0, k0 + n) in its window (a block
  // seen through sinks alone does not count).
  bool SeesWhole(int64_t k0, int64_t n) const {
    return greatest_start <= k0 && k0 + n <= least_end;
  }
};

// The running computation of one call.
class FusedRun {
 public:
  FusedRun(const SdpaProblem& p, const Geometry& g, const TileKernels& kernels);

  absl::Status Run(const dnnl::engine& engine, int threads,
                   TilePlanCache& cache, ScratchPool& pool);

 private:
  // Keys in the last block of the keys (a whole block or fewer).
  int64_t LastKeys() const {
    return s_.key_len - (g_.k_blocks - 1) * g_.k_block;
  }

  // Whether a tile may run key blocks short of a whole one: its last block
  // (causality, key_lengths, a window's right edge, sinks), and blocks that
  // the bands of a windowed tile see only the end of.
  bool ShortensBlocks() const {
    return g_.staggered || !p_.options->key_lengths.empty() ||
           p_.options->num_sink_tokens > 0;
  }

  // Whether the scores read a tile's query rows where the input holds them:
  // one head's rows (no group), dense, already in the type the tiles read
  // (f32 rows at f32 precision, bf16 rows for native bf16 tiles). Else
  // StartTile copies, widens or rounds them into the thread's buffer.
  bool QueryInPlace() const {
    const Strides4& qs = p_.query_strides;
    const bool own_type = g_.HalfSource() ? g_.source == DataType::kBFloat16 &&
                                                g_.NativeBf16Tiles()
                                          : !g_.Bf16();
    return own_type && g_.group == 1 && qs[3] == 1 && qs[2] == s_.key_dim;
  }

  // Bytes per element of the key and value rows (Rows): bf16 for the bf16
  // matmuls, 2 for half inputs read in place, else f32.
  int64_t PackedElementBytes() const {
    if (g_.HalfSource()) return 2;
    return g_.Bf16Tiles() ? BytesOf(g_.input) : 4;
  }

  // Run's steps (fused_attention.cc).

  // Copies the keys and values to dense rows in the matmuls' type if the tiles
  // cannot read them in place: on the calling thread's team, or, where one
  // tile alone reads each (batch entry, kv head) (pack_in_tiles_), in that
  // tile.
  absl::Status PackKeysAndValues(ScratchPool& pool);
  // Copies the keys and values of (batch entry b, kv head h) into the packed
  // copy; f16 rows are widened on `widened` (max(Dk, Dv) floats) first.
  void PackHead(int64_t b, int64_t h, float* widened) const;
  // Copies the rows of (b, h) of the [B, Hkv, Lk, dim] tensor at `of(p_, b)`
  // (f32 inputs) or `half` (half inputs), with `strides`, into `out`.
  void PackRows(const float* (*of)(const SdpaProblem&, int64_t),
                const uint16_t* half, const Strides4& strides, int64_t dim,
                int64_t b, int64_t h, float* widened, void* out) const;
  // Elements between the key (value) rows the tiles read: the strides' for
  // half inputs read in place, else dense rows of `dim`.
  int64_t RowStride(const Strides4& strides, int64_t dim) const {
    return g_.HalfSource() && packed_.get() == nullptr ? strides[2] : dim;
  }
  // Gets the tile plans of every tile shape the call can use from `cache`
  // (building the missing ones single-threaded), and the largest scratchpad
  // any of them needs.
  absl::Status GetTilePlans(const dnnl::engine& engine, int threads,
                            TilePlanCache& cache, int64_t* scratchpad_bytes);
  // Takes the workspace: every thread's buffers, then the split tiles'
  // partial results.
  absl::Status AllocateWorkspace(int threads, int64_t scratchpad_bytes,
                                 ScratchPool& pool);
  // One context per thread, each on its own buffers and stream.
  absl::Status MakeThreadContexts(const dnnl::engine& engine, int threads,
                                  std::vector<ThreadContext>* contexts);
  // Computes every tile (or split of one) on `threads` threads, each tile's
  // splits merged by the thread that ends its last.
  absl::Status RunTiles(int threads, std::vector<ThreadContext>& contexts);
  // Merges the splits of `tile` into the output, on `merged` (Dv floats).
  void MergeTile(int64_t tile, float* merged) const;
  // Writes one row's output and lse from its accumulated state.
  void WriteRow(int64_t b, int64_t h, int64_t i, const float* accumulated,
                const RowState& state) const;

  // The first rows of (batch entry b, kv head h) of the keys or the values
  // (`packed`, `half`, `of`, `strides`, `dim` naming which), as the tiles read
  // them: in the packed copy if there is one, else in place (at `half` for
  // half inputs).
  const char* Rows(const void* packed, const uint16_t* half,
                   const float* (*of)(const SdpaProblem&, int64_t),
                   const Strides4& strides, int64_t dim, int64_t b,
                   int64_t h) const;

  // RunTile and its steps (fused_tile.cc).

  // Computes tile `index` (all splits if `split` < 0, else that one) on the
  // calling thread. Returns a oneDNN status.
  dnnl_status_t RunTile(int64_t index, int64_t split, ThreadContext& context);
  Tile TileAt(int64_t index) const;
  // The buffers of `tile` in the thread's `buffer`, its query rows in the
  // input if QueryInPlace.
  TileBuffers BuffersOf(const Tile& tile, char* buffer) const;
  // Writes the keys each query of `tile` may see to buffers.keys, and returns
  // their span.
  TileSpan FindVisibleKeys(const Tile& tile, const TileBuffers& buffers) const;
  // Whether any query of `tile` sees a key of `keys` (a window or sinks leave
  // blocks that none does, which the tile skips).
  bool TileSees(const Tile& tile, const TileBuffers& buffers,
                const KeyBlock& keys) const;
  // One past the last sink any query of `tile` sees if the queries see
  // `keys` only through their sinks (the tile then runs the block only that
  // far); −1 otherwise.
  int64_t SinkOnlyEnd(const Tile& tile, const TileBuffers& buffers,
                      const KeyBlock& keys) const;
  // The key blocks of split `split` (all if < 0) up to `tile_end`.
  BlockRange BlocksToRun(int64_t tile_end, int64_t split) const;
  // Loads the query rows of `tile` unless QueryInPlace, and zeroes the rows'
  // output and softmax states.
  void StartTile(const Tile& tile, const TileBuffers& buffers) const;
  // Row r of `tile`'s query where the input holds it: f32, or half inputs.
  const float* QueryRow(const Tile& tile, int64_t r) const;
  const uint16_t* HalfQueryRow(const Tile& tile, int64_t r) const;
  // Copies the query rows of every head of the group into buffers.query in
  // the matmuls' type, widening or rounding them as it goes.
  void LoadQueryRows(const Tile& tile, const TileBuffers& buffers) const;
  // `count` half-input elements at `source` widened to f32 at `out`.
  void Widen(const uint16_t* source, int64_t count, float* out) const;
  // Points `keys` at its keys and values widened into the thread's buffers
  // (WidensBlocks).
  void WidenBlock(const TileBuffers& buffers, KeyBlock* keys) const;
  // Block `block` of the keys and values whose (b, kv head) rows start at
  // `key_rows` and `value_rows`, shortened to the granule past `tile_end`
  // when it is the last block a tile may see.
  KeyBlock BlockAt(int64_t block, int64_t tile_end, const char* key_rows,
                   const char* value_rows) const;
  // `keys` up to the granule past `end` if that is short of its end.
  static KeyBlock Shortened(KeyBlock keys, int64_t end);
  // `keys` from the granule at or before `first` on, if its width allows
  // (not the ragged last block of the keys).
  static KeyBlock Trimmed(KeyBlock keys, int64_t first);
  // Runs `keys` for the rows `rows` of `tile`: ScoreBlock, FoldBlock,
  // AccumulateBlock. Returns a oneDNN status.
  dnnl_status_t RunBlock(const Tile& tile, RowRange rows, const KeyBlock& keys,
                         const TileBuffers& buffers,
                         ThreadContext& context) const;
  // Runs `keys`, which some rows of a staggered tile do not wholly see, band
  // by band (one band if the tile has no more queries), each band over the
  // keys of it that its rows see (Shortened to its last, Trimmed to its
  // first) and not at all if they see none of it. Returns a oneDNN status.
  dnnl_status_t RunBlockByBands(const Tile& tile, const KeyBlock& keys,
                                const TileBuffers& buffers,
                                ThreadContext& context) const;
  // The slot of the tile plans of m-row matmuls.
  int PlanIndex(int64_t m) const;
  // The binding of the tile plan for `rows` and `keys` on `context`, bound on
  // its first use. Returns a oneDNN status.
  dnnl_status_t BindingFor(RowRange rows, const KeyBlock& keys,
                           const TileBuffers& buffers, ThreadContext& context,
                           TileBinding** binding) const;
  // scores = Q · K_blockᵀ for `rows`, from the scores buffer's first row, on
  // `binding` (BindingFor's; null for small tiles). Returns a oneDNN status.
  dnnl_status_t ScoreBlock(RowRange rows, const KeyBlock& keys,
                           const TileBuffers& buffers, TileBinding* binding,
                           ThreadContext& context) const;
  // Folds the block into the softmax of each row of `rows`; rescales what the
  // row has accumulated if its max moved.
  void FoldBlock(const Tile& tile, RowRange rows, const KeyBlock& keys,
                 const TileBuffers& buffers) const;
  // The mask entries of row (b, h, i) from key k0 on.
  RowMask RowMaskAt(int64_t b, int64_t h, int64_t i, int64_t k0) const;
  // output += P · V_block for `rows`, on `binding` as ScoreBlock. Returns a
  // oneDNN status.
  dnnl_status_t AccumulateBlock(RowRange rows, const KeyBlock& keys,
                                const TileBuffers& buffers,
                                TileBinding* binding,
                                ThreadContext& context) const;
  // Whether a value of the block is NaN or ±inf: the matmul would take
  // 0 · NaN into every row, also those that do not see it.
  bool ValuesNotFinite(const KeyBlock& keys) const;
  // AccumulateBlock without the matmul, over the keys each row sees (those of
  // probability above 0), as the small tiles' code accumulates.
  dnnl_status_t AccumulateSeenValues(RowRange rows, const KeyBlock& keys,
                                     const TileBuffers& buffers) const;
  // Keeps split `split`'s partial result of `tile` for MergeTile.
  void KeepPartial(const Tile& tile, int64_t split,
                   const TileBuffers& buffers) const;
  // Writes every row of a whole tile.
  void WriteRows(const Tile& tile, const TileBuffers& buffers) const;

  const SdpaProblem& p_;
  const AttentionShape& s_;
  const Geometry& g_;
  const TileKernels& kernels_;
  // The call's mask, if any, and its strides.
  const AttentionMask* const mask_;
  const MaskStrides mask_strides_;
  // Whether the call has a window, sinks, ALiBi or a softcap
  // (internal/score_mods.h), and the rules of its RowKeys.
  const bool mods_;
  const KeyRules rules_;
  ThreadLayout layout_{};
  // Packed keys and values, if the tiles read those: dense rows, f32 or bf16
  // (written by PackHead).
  char* key_ = nullptr;
  char* value_ = nullptr;
  ScratchPool::Lease packed_;
  // Whether each tile packs the keys and values it reads (PackKeysAndValues).
  bool pack_in_tiles_ = false;
  ScratchPool::Lease workspace_;
  // The tile plans by [PlanIndex(m)][KeyWidthIndex(n)], held for the call,
  // the m of each slot (0: unused), and the engine to bind them on.
  std::shared_ptr<const TilePlan> plans_[kTilePlans][kKeyWidths];
  int64_t plan_rows_[kTilePlans] = {};
  dnnl_engine_t engine_ = nullptr;
  char* partials_ = nullptr;
  // The call's stop check as the threads poll it: between tiles and between
  // key blocks.
  Stopper stopper_;
};

}  // namespace attnserve::internal::fused

#endif  // ATTNSERVE_CORE_INTERNAL_FUSED_RUN_H_
