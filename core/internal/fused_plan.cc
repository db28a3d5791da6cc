#include "internal/fused_plan.h"

#include <algorithm>
#include <optional>

#include "attnserve/common/checked_math.h"
#include "internal/fused_attention.h"
#include "internal/tile_kernels.h"
#include "internal/visibility.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::internal {
namespace fused {

int64_t TileRows() {
  // oneDNN's ISAs are masks of features (avx2_vnni is numerically above
  // avx512_core), so AVX-512 is tested as a mask.
  static const int64_t rows = [] {
    const auto avx512 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core);
    const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    return (isa & avx512) == avx512 ? 256 : 64;
  }();
  return rows;
}

Geometry MakeGeometry(const AttentionShape& s, const AttentionOptions& options,
                      int threads, DataType source, int64_t tiling_batch) {
  Geometry g;
  g.group = s.heads / s.kv_heads;
  const KeyRules rules = RulesOf(options);
  const int64_t batch = tiling_batch > 0 ? tiling_batch : s.batch;
  int64_t queries = std::clamp<int64_t>(TileRows() / g.group, 1, s.query_len);
  // A call of fewer tiles than its threads can share (a short one on many
  // cores) takes smaller tiles, down to kMinTileRows rows, before it splits
  // its keys.
  const int64_t fewest = std::max<int64_t>(1, kMinTileRows / g.group);
  while (queries > fewest &&
         batch * s.kv_heads * CeilDiv(s.query_len, queries) <
             kSplitBelow * threads) {
    queries = std::max(fewest, CeilDiv(queries, 2));
  }
  g.q_block = queries;
  g.staggered = rules.causal || rules.Windowed();
  g.band = g.staggered ? std::min(queries, kStaggeredQueries) : queries;
  g.rows = g.group * g.q_block;
  g.q_blocks = CeilDiv(s.query_len, g.q_block);
  g.k_block = std::min(kKeyBlock, s.key_len);
  g.k_blocks = CeilDiv(s.key_len, g.k_block);
  g.tiles = s.batch * s.kv_heads * g.q_blocks;
  const int64_t tiling_tiles = batch * s.kv_heads * g.q_blocks;
  g.splits = 1;
  if (threads > 1 && tiling_tiles < kSplitBelow * threads && g.k_blocks > 1) {
    g.splits =
        std::min(g.k_blocks, CeilDiv(kSplitTarget * threads, tiling_tiles));
  }
  g.chunk = CeilDiv(g.k_blocks, g.splits);
  g.splits = CeilDiv(g.k_blocks, g.chunk);
  g.small = g.rows < kSmallRows;
  g.input = MatmulInputFor(options.precision);
  g.source = source;
  return g;
}

int64_t ScratchpadAllowance(const AttentionShape& s, const Geometry& g) {
  return 2 * g.k_block * std::max(s.key_dim, s.value_dim) * 4 + (64 << 10);
}

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
  t.keys = take(g.q_block * static_cast<int64_t>(sizeof(RowKeys)));
  t.widened =
      take(g.HalfSource() ? g.k_block * (s.key_dim + s.value_dim) * 4 : 0);
  t.scratchpad = take(scratchpad_bytes);
  t.total = at;
  return t;
}

int64_t PartialStatesOffset(const AttentionShape& s, const Geometry& g) {
  return AlignUp(g.tiles * g.splits * g.rows * s.value_dim * 4);
}

int64_t PartialBytes(const AttentionShape& s, const Geometry& g) {
  if (g.splits == 1) return 0;
  return PartialStatesOffset(s, g) +
         g.tiles * g.splits * g.rows * static_cast<int64_t>(sizeof(RowState));
}

int64_t PackedKeyValueBytes(const AttentionShape& s, const Geometry& g,
                            bool key_value_packed) {
  if (g.HalfSource()) {
    // Only native bf16 tiles over f16 or strided inputs read a (same-sized)
    // copy.
    return g.NativeBf16Tiles() &&
                   (g.source == DataType::kFloat16 || !key_value_packed)
               ? (s.KeyElements() + s.ValueElements()) * 2
               : 0;
  }
  if (!g.Bf16Tiles() && key_value_packed) return 0;
  return (s.KeyElements() + s.ValueElements()) *
         (g.Bf16Tiles() ? BytesOf(g.input) : 4);
}

}  // namespace fused

std::optional<int64_t> FusedWorkspaceBytes(const AttentionShape& s,
                                           const AttentionOptions& options,
                                           int threads, bool key_value_packed,
                                           DataType source, Tiling tiling) {
  // Every product below is of dims the caller validated (each tensor's
  // element count fits), times small constants.
  const auto bytes = [&](int team, int tiling_threads) {
    const fused::Geometry g =
        fused::MakeGeometry(s, options, tiling_threads, source, tiling.batch);
    const fused::ThreadLayout layout =
        MakeThreadLayout(s, g, g.small ? 0 : ScratchpadAllowance(s, g));
    return CheckedSum({CheckedProduct({layout.total, team}),
                       CheckedProduct({fused::AlignUp(PartialBytes(s, g)), 1}),
                       PackedKeyValueBytes(s, g, key_value_packed)});
  };
  // A batch tiled as its requests alone runs on at most `threads`.
  if (tiling.threads > 0) return bytes(threads, tiling.threads);
  // A call too small to share runs on one thread (the engine's TeamSize),
  // whose tiles may be larger than a team's.
  const std::optional<int64_t> team = bytes(threads, threads);
  const std::optional<int64_t> one = threads == 1 ? team : bytes(1, 1);
  if (!team || !one) return std::nullopt;
  return std::max(*team, *one);
}

}  // namespace attnserve::internal
