// How the fused kernel (internal/fused_attention.h) cuts one call: tiles of
// query rows, key blocks and key splits (Geometry), and where each thread's
// buffers lie in the call's workspace (ThreadLayout). The workspace check
// before a call and the call itself size from the same functions, so they
// agree.
#ifndef ATTNSERVE_CORE_INTERNAL_FUSED_PLAN_H_
#define ATTNSERVE_CORE_INTERNAL_FUSED_PLAN_H_

#include <cstdint>

#include "attnserve/common/dtype.h"
#include "attnserve/core/attention_types.h"
#include "internal/matmul.h"

namespace attnserve::internal::fused {

// Query rows a tile aims for (all heads of a kv-head group together): enough
// to make each key block's matmuls efficient, few enough that the tile's
// scores, output and the key block stay in a core's L2 (about 700 KiB at
// D 128). 256 on AVX-512 CPUs, AMX or not: each key block's fixed costs,
// oneDNN's dispatch of the two matmuls and its repacking of the block on every
// execute, then spread over four times the rows of 64 (on a Zen 5, 7-11 % more
// GFLOP/s than 64 rows, more than 128; 512 rows slowed causal calls). 64 on
// CPUs without AVX-512, whose L2 may be half as large.
int64_t TileRows();
// Queries per head of a band: where a tile's rows see different spans of keys
// (causality, a window), the key blocks that only some of them see (the
// diagonal, a window's edges) run band by band, each band over only the keys
// its own rows see, so that a tile computes about band² / 2 masked scores a
// head there rather than queries² / 2 (tiles of 256 queries without bands made
// causal calls 3-7 % slower than tiles of 64 at L 1,024-2,048 on the Zen 5).
inline constexpr int64_t kStaggeredQueries = 64;
// The fewest rows a tile is cut to when a call has fewer tiles than its
// threads can share (kSplitBelow a thread): the tile rows of CPUs without
// AVX-512, and those of every CPU before tiles of 256.
inline constexpr int64_t kMinTileRows = 64;
// Keys per block.
inline constexpr int64_t kKeyBlock = 256;
// Under causality or key_lengths, a tile's last block stops at the first
// multiple of this many keys past the last key any of its rows sees, rather
// than at a whole block: causal tiles at short lengths would otherwise compute
// up to a block of keys nobody sees. A band under a window also starts at the
// multiple at or before its first key. 32 rather than 64: a tile of 32
// queries (groups of eight) under a 128-key window computes the 160 keys its
// rows span rather than up to 224, 15-17 % faster on the Zen 5, for up to
// twice the tile plans a call (the engine's cache holds two calls' worth).
inline constexpr int64_t kKeyGranule = 32;
// Key-block widths a call may use: each multiple of kKeyGranule up to
// kKeyBlock, and the ragged last block of the keys.
inline constexpr int kKeyWidths = kKeyBlock / kKeyGranule + 1;
// Tiles of fewer rows use our own vector code, not oneDNN.
inline constexpr int64_t kSmallRows = 8;
// Split the keys of each tile when there are fewer tiles than this many per
// thread, aiming for about kSplitTarget work items per thread.
inline constexpr int64_t kSplitBelow = 2;
inline constexpr int64_t kSplitTarget = 4;
// Every per-thread buffer starts on its own cache line.
inline constexpr int64_t kAlign = 64;

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t AlignUp(int64_t bytes) {
  return CeilDiv(bytes, kAlign) * kAlign;
}

// The slot of a key-block width: multiples of kKeyGranule by size, the ragged
// last block of the keys after them.
inline int KeyWidthIndex(int64_t n) {
  return n % kKeyGranule == 0 ? static_cast<int>(n / kKeyGranule) - 1
                              : kKeyWidths - 1;
}

// How a problem is cut into tiles and key blocks.
struct Geometry {
  int64_t group;      // query heads per kv head
  int64_t q_block;    // queries per head in a full tile
  int64_t band;       // queries per head of a band (q_block: no bands)
  bool staggered;     // rows see apart spans of keys (causality, a window)
  int64_t rows;       // rows of a full tile: group · q_block
  int64_t q_blocks;   // tiles along the queries
  int64_t k_block;    // keys per block
  int64_t k_blocks;   // blocks along the keys
  int64_t tiles;      // B · Hkv · q_blocks
  int64_t splits;     // key chunks per tile (1: no split)
  int64_t chunk;      // key blocks per chunk
  bool small;         // own vector code instead of oneDNN matmuls
  MatmulInput input;  // what matmuls read at this precision on this CPU
  DataType source;    // the dtype of the call's query, key and value

  // Whether tiles run the key blocks some of their rows do not wholly see
  // in more than one band (staggered tiles of more than a band's queries).
  bool Banded() const { return band < q_block; }
  // Queries in the last band of a tile of `queries` queries.
  int64_t LastBand(int64_t queries) const {
    return queries - (queries - 1) / band * band;
  }
  bool Bf16() const { return input != MatmulInput::kF32; }  // BF16 precision
  // Whether the oneDNN tiles read bf16 values (packed keys and values, query
  // rows, probabilities): as bf16, or as f32 on a CPU without a bf16 matmul.
  bool Bf16Tiles() const { return Bf16() && !small; }
  // Whether they read them as bf16, through oneDNN's bf16 matmul.
  bool NativeBf16Tiles() const { return !small && input == MatmulInput::kBf16; }
  // Whether the inputs arrive as bf16 or f16, and are read where they lie.
  bool HalfSource() const { return source != DataType::kFloat32; }
  // Whether the tiles widen half inputs a key block at a time into the
  // thread's buffers: whenever they read f32 (f32 precision, tiles of few
  // rows, a CPU without bf16 matmuls). Native bf16 tiles read dense bf16
  // inputs in place, and a packed bf16 copy of f16 or strided ones.
  bool WidensBlocks() const { return HalfSource() && !NativeBf16Tiles(); }
};

// The geometry of a call of `s` whose tiles and key splits are chosen for
// `threads` threads and a batch of `tiling_batch` entries (0: s.batch). A batch
// of requests of B entries each (AttendBatch) passes B and the threads each
// request would have alone, so that every request is cut, and its rows
// computed, exactly as alone, whatever it shares the call with.
Geometry MakeGeometry(const AttentionShape& s, const AttentionOptions& options,
                      int threads, DataType source = DataType::kFloat32,
                      int64_t tiling_batch = 0);

// oneDNN's scratchpad for one tile matmul is the copy of a key or value block
// it repacks; this bounds it for the workspace check before any primitive is
// built (the real sizes are used when allocating).
int64_t ScratchpadAllowance(const AttentionShape& s, const Geometry& g);

// Byte offsets of one thread's buffers.
// `widened`: a key block's keys then its values, widened from half inputs
// (HalfSource), the first row of it also a query row's.
struct ThreadLayout {
  int64_t query, scores, probabilities, output, states, keys, widened,
      scratchpad, total;
};

ThreadLayout MakeThreadLayout(const AttentionShape& s, const Geometry& g,
                              int64_t scratchpad_bytes);

// The partial results of split tiles: every split's output rows, then (from
// this offset) their row states.
int64_t PartialStatesOffset(const AttentionShape& s, const Geometry& g);

int64_t PartialBytes(const AttentionShape& s, const Geometry& g);

// Bytes of the packed key and value copies.
int64_t PackedKeyValueBytes(const AttentionShape& s, const Geometry& g,
                            bool key_value_packed);

}  // namespace attnserve::internal::fused

#endif  // ATTNSERVE_CORE_INTERNAL_FUSED_PLAN_H_
