// One tile of the fused kernel: its queries against the key blocks they may
// see, one block at a time (scores, online softmax, accumulation), band by
// band where its rows see the block unequally, then its rows written out or,
// for a split tile, kept for MergeTile.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attnserve/common/dtype.h"
#include "internal/fused_plan.h"
#include "internal/fused_run.h"
#include "internal/matmul.h"
#include "internal/score_mods.h"
#include "internal/sdpa_problem.h"
#include "internal/tile_kernels.h"
#include "internal/tile_matmuls.h"
#include "internal/visibility.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::internal::fused {

dnnl_status_t FusedRun::RunTile(int64_t index, int64_t split,
                                ThreadContext& context) {
  const Tile tile = TileAt(index);
  const TileBuffers buffers = BuffersOf(tile, context.buffer);
  if (pack_in_tiles_) PackHead(tile.b, tile.kv_head, buffers.widened);
  const TileSpan span = FindVisibleKeys(tile, buffers);
  const BlockRange blocks = BlocksToRun(span.end, split);
  StartTile(tile, buffers);

  const char* const key_rows = Rows(key_, p_.half_key, &KeyOf, p_.key_strides,
                                    s_.key_dim, tile.b, tile.kv_head);
  const char* const value_rows =
      Rows(value_, p_.half_value, &ValueOf, p_.value_strides, s_.value_dim,
           tile.b, tile.kv_head);
  for (int64_t block = blocks.first; block < blocks.last; ++block) {
    // A stopped call's tile is abandoned; Run returns the stop's status.
    if (stopper_.ShouldStop()) return dnnl_success;
    KeyBlock keys = BlockAt(block, span.end, key_rows, value_rows);
    bool whole = !g_.staggered || span.SeesWhole(keys.k0, keys.n);
    if (mods_) {
      if (!TileSees(tile, buffers, keys)) continue;
      // A block before every window, seen for its sinks alone, runs only as
      // far as the sinks reach, for every row at once: all see those sinks
      // (bar the keys past a row's causal edge, which its mask hides).
      const int64_t sink_end = SinkOnlyEnd(tile, buffers, keys);
      if (sink_end > 0) {
        keys = BlockAt(block, sink_end, key_rows, value_rows);
        whole = true;
      }
    }
    if (g_.WidensBlocks()) WidenBlock(buffers, &keys);
    const dnnl_status_t status =
        whole ? RunBlock(tile, {0, tile.rows}, keys, buffers, context)
              : RunBlockByBands(tile, keys, buffers, context);
    if (status != dnnl_success) return status;
  }

  if (split >= 0) {
    KeepPartial(tile, split, buffers);
  } else {
    WriteRows(tile, buffers);
  }
  return dnnl_success;
}

Tile FusedRun::TileAt(int64_t index) const {
  Tile tile;
  tile.index = index;
  const int64_t q_block = index % g_.q_blocks;
  const int64_t bh = index / g_.q_blocks;
  tile.b = bh / s_.kv_heads;
  tile.kv_head = bh % s_.kv_heads;
  tile.q0 = q_block * g_.q_block;
  tile.qn = std::min(g_.q_block, s_.query_len - tile.q0);
  tile.group = g_.group;
  tile.rows = g_.group * tile.qn;
  return tile;
}

TileBuffers FusedRun::BuffersOf(const Tile& tile, char* buffer) const {
  TileBuffers buffers;
  buffers.query = buffer + layout_.query;
  if (QueryInPlace()) {
    // The matmuls only read it (oneDNN's data handles are not const).
    buffers.query =
        g_.HalfSource()
            ? reinterpret_cast<char*>(
                  const_cast<uint16_t*>(HalfQueryRow(tile, 0)))
            : reinterpret_cast<char*>(const_cast<float*>(QueryRow(tile, 0)));
  }
  buffers.scores = reinterpret_cast<float*>(buffer + layout_.scores);
  buffers.probabilities =
      reinterpret_cast<uint16_t*>(buffer + layout_.probabilities);
  buffers.output = reinterpret_cast<float*>(buffer + layout_.output);
  buffers.states = reinterpret_cast<RowState*>(buffer + layout_.states);
  buffers.keys = reinterpret_cast<RowKeys*>(buffer + layout_.keys);
  buffers.widened = reinterpret_cast<float*>(buffer + layout_.widened);
  buffers.scratchpad = buffer + layout_.scratchpad;
  return buffers;
}

TileSpan FusedRun::FindVisibleKeys(const Tile& tile,
                                   const TileBuffers& buffers) const {
  TileSpan span{0, s_.key_len, 0};
  for (int64_t i = 0; i < tile.qn; ++i) {
    const RowKeys row = VisibleKeys(s_, *p_.options, tile.b, tile.q0 + i);
    buffers.keys[i] = row;
    span.end = std::max(span.end, row.end);
    span.least_end = std::min(span.least_end, row.end);
    span.greatest_start = std::max(span.greatest_start, row.start);
  }
  return span;
}

bool FusedRun::TileSees(const Tile& tile, const TileBuffers& buffers,
                        const KeyBlock& keys) const {
  const int64_t first = keys.k0;
  const int64_t last = keys.k0 + keys.n;
  for (int64_t i = 0; i < tile.qn; ++i) {
    const RowKeys& row = buffers.keys[i];
    if (first < row.sink_end) return true;
    if (first < row.end && row.start < last) return true;
  }
  return false;
}

int64_t FusedRun::SinkOnlyEnd(const Tile& tile, const TileBuffers& buffers,
                              const KeyBlock& keys) const {
  const int64_t first = keys.k0;
  const int64_t last = keys.k0 + keys.n;
  int64_t sink_end = 0;
  for (int64_t i = 0; i < tile.qn; ++i) {
    const RowKeys& row = buffers.keys[i];
    if (first < row.end && row.start < last) return -1;  // its window
    sink_end = std::max(sink_end, row.sink_end);
  }
  return sink_end > first ? sink_end : -1;
}

BlockRange FusedRun::BlocksToRun(int64_t tile_end, int64_t split) const {
  BlockRange blocks{0, CeilDiv(tile_end, g_.k_block)};
  if (split >= 0) {
    blocks.first = std::min(blocks.last, split * g_.chunk);
    blocks.last = std::min(blocks.last, blocks.first + g_.chunk);
  }
  return blocks;
}

void FusedRun::StartTile(const Tile& tile, const TileBuffers& buffers) const {
  if (!QueryInPlace()) LoadQueryRows(tile, buffers);
  std::fill(buffers.output, buffers.output + tile.rows * s_.value_dim, 0.0f);
  std::fill(buffers.states, buffers.states + tile.rows,
            RowState{kNegativeInfinity, 0.0f, false});
}

const float* FusedRun::QueryRow(const Tile& tile, int64_t r) const {
  const Strides4& qs = p_.query_strides;
  return QueryOf(p_, tile.b) + tile.Head(r) * qs[1] + tile.Query(r) * qs[2];
}

const uint16_t* FusedRun::HalfQueryRow(const Tile& tile, int64_t r) const {
  const Strides4& qs = p_.query_strides;
  // Never batched: batch entries qs[0] apart.
  return p_.half_query + tile.b * qs[0] + tile.Head(r) * qs[1] +
         tile.Query(r) * qs[2];
}

void FusedRun::LoadQueryRows(const Tile& tile,
                             const TileBuffers& buffers) const {
  float* query_f32 = reinterpret_cast<float*>(buffers.query);
  uint16_t* query_bf16 = reinterpret_cast<uint16_t*>(buffers.query);
  for (int64_t r = 0; r < tile.rows; ++r) {
    if (g_.HalfSource()) {
      const uint16_t* half = HalfQueryRow(tile, r);
      if (g_.NativeBf16Tiles() && g_.source == DataType::kBFloat16) {
        std::memcpy(query_bf16 + r * s_.key_dim, half,
                    static_cast<size_t>(s_.key_dim) * 2);
        continue;
      }
      // Widened into the row (or, for bf16 tiles, the widening buffer and
      // then narrowed into the row).
      float* row =
          g_.NativeBf16Tiles() ? buffers.widened : query_f32 + r * s_.key_dim;
      Widen(half, s_.key_dim, row);
      if (g_.NativeBf16Tiles()) {
        kernels_.to_bf16(row, s_.key_dim, query_bf16 + r * s_.key_dim);
      } else if (g_.Bf16()) {
        RoundToBf16Values(row, s_.key_dim, row);
      }
      continue;
    }
    const float* row = QueryRow(tile, r);
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
}

void FusedRun::Widen(const uint16_t* source, int64_t count, float* out) const {
  if (g_.source == DataType::kBFloat16) {
    kernels_.bf16_to_f32(source, count, out);
  } else {
    kernels_.f16_to_f32(source, count, out);
  }
}

void FusedRun::WidenBlock(const TileBuffers& buffers, KeyBlock* keys) const {
  float* widened_keys = buffers.widened;
  float* widened_values = buffers.widened + g_.k_block * s_.key_dim;
  // Dense rows in one run, strided ones (packed sequences) row by row.
  const auto widen_rows = [this, keys](const char* rows, int64_t stride,
                                       int64_t dim, float* out) {
    const uint16_t* half = reinterpret_cast<const uint16_t*>(rows);
    if (stride == dim) {
      Widen(half, keys->n * dim, out);
      return;
    }
    for (int64_t j = 0; j < keys->n; ++j) {
      Widen(half + j * stride, dim, out + j * dim);
    }
  };
  widen_rows(keys->keys, keys->key_stride, s_.key_dim, widened_keys);
  widen_rows(keys->values, keys->value_stride, s_.value_dim, widened_values);
  keys->key_stride = s_.key_dim;
  keys->value_stride = s_.value_dim;
  keys->element = 4;
  if (g_.Bf16Tiles()) {
    // f32 matmuls of a CPU without bf16 ones read bf16 values.
    RoundToBf16Values(widened_keys, keys->n * s_.key_dim, widened_keys);
    RoundToBf16Values(widened_values, keys->n * s_.value_dim, widened_values);
  }
  keys->keys = reinterpret_cast<const char*>(widened_keys);
  keys->values = reinterpret_cast<const char*>(widened_values);
}

KeyBlock FusedRun::BlockAt(int64_t block, int64_t tile_end,
                           const char* key_rows, const char* value_rows) const {
  KeyBlock keys;
  keys.k0 = block * g_.k_block;
  keys.n = std::min(g_.k_block, s_.key_len - keys.k0);
  keys.width = KeyWidthIndex(keys.n);
  keys.element = PackedElementBytes();
  keys.key_stride = RowStride(p_.key_strides, s_.key_dim);
  keys.value_stride = RowStride(p_.value_strides, s_.value_dim);
  keys.keys = key_rows + keys.k0 * keys.key_stride * keys.element;
  keys.values = value_rows + keys.k0 * keys.value_stride * keys.element;
  return ShortensBlocks() ? Shortened(keys, tile_end) : keys;
}

KeyBlock FusedRun::Shortened(KeyBlock keys, int64_t end) {
  if (end - keys.k0 < keys.n) {
    keys.n =
        std::min(keys.n, CeilDiv(end - keys.k0, kKeyGranule) * kKeyGranule);
    keys.width = KeyWidthIndex(keys.n);
  }
  return keys;
}

KeyBlock FusedRun::Trimmed(KeyBlock keys, int64_t first) {
  const int64_t skip = (first - keys.k0) / kKeyGranule * kKeyGranule;
  // The widths a call plans are multiples of the granule and its ragged last
  // block (KeyWidthIndex), which keeps its keys.
  if (skip <= 0 || keys.n % kKeyGranule != 0) return keys;
  keys.k0 += skip;
  keys.n -= skip;
  keys.width = KeyWidthIndex(keys.n);
  keys.keys += skip * keys.key_stride * keys.element;
  keys.values += skip * keys.value_stride * keys.element;
  return keys;
}

dnnl_status_t FusedRun::RunBlock(const Tile& tile, RowRange rows,
                                 const KeyBlock& keys,
                                 const TileBuffers& buffers,
                                 ThreadContext& context) const {
  // Small tiles run our own vector code, no tile plan.
  TileBinding* binding = nullptr;
  dnnl_status_t status = dnnl_success;
  if (!g_.small) status = BindingFor(rows, keys, buffers, context, &binding);
  if (status != dnnl_success) return status;
  status = ScoreBlock(rows, keys, buffers, binding, context);
  if (status != dnnl_success) return status;
  FoldBlock(tile, rows, keys, buffers);
  return AccumulateBlock(rows, keys, buffers, binding, context);
}

dnnl_status_t FusedRun::RunBlockByBands(const Tile& tile, const KeyBlock& keys,
                                        const TileBuffers& buffers,
                                        ThreadContext& context) const {
  for (int64_t q = 0; q < tile.qn; q += g_.band) {
    const int64_t q_end = std::min(tile.qn, q + g_.band);
    int64_t band_end = 0;
    int64_t band_start = s_.key_len;
    int64_t band_sink_end = 0;
    for (int64_t i = q; i < q_end; ++i) {
      const RowKeys& row = buffers.keys[i];
      band_end = std::max(band_end, row.end);
      band_start = std::min(band_start, row.start);
      band_sink_end = std::max(band_sink_end, row.sink_end);
    }
    // The first key of the block the band may see: its sinks', else its
    // windows'.
    const int64_t first =
        band_sink_end > keys.k0 ? keys.k0 : std::max(keys.k0, band_start);
    // The band sees none of it.
    if (band_end <= keys.k0 || first >= keys.k0 + keys.n) continue;
    const dnnl_status_t status =
        RunBlock(tile, {q * tile.group, q_end * tile.group},
                 Trimmed(Shortened(keys, band_end), first), buffers, context);
    if (status != dnnl_success) return status;
  }
  return dnnl_success;
}

int FusedRun::PlanIndex(int64_t m) const {
  int index = 0;
  while (index + 1 < kTilePlans && plan_rows_[index] != m) ++index;
  return index;
}

dnnl_status_t FusedRun::BindingFor(RowRange rows, const KeyBlock& keys,
                                   const TileBuffers& buffers,
                                   ThreadContext& context,
                                   TileBinding** binding) const {
  const int plan = PlanIndex(rows.size());
  *binding = &context.bindings[plan][keys.width];
  if ((*binding)->plan != nullptr) return dnnl_success;
  return (*binding)->Bind(*plans_[plan][keys.width], engine_,
                          buffers.scratchpad);
}

dnnl_status_t FusedRun::ScoreBlock(RowRange rows, const KeyBlock& keys,
                                   const TileBuffers& buffers,
                                   TileBinding* binding,
                                   ThreadContext& context) const {
  // The query buffer holds bf16 rows for native bf16 tiles, else f32 ones.
  char* const query =
      buffers.query + rows.first * s_.key_dim * (g_.NativeBf16Tiles() ? 2 : 4);
  if (g_.small) {
    const float* query_f32 = reinterpret_cast<const float*>(query);
    const float* key_block = reinterpret_cast<const float*>(keys.keys);
    if (g_.Bf16()) {
      kernels_.small_scores_bf16(query_f32, rows.size(), s_.key_dim, key_block,
                                 keys.n, buffers.scores, keys.n);
    } else {
      kernels_.small_scores_f32(query_f32, rows.size(), s_.key_dim, key_block,
                                keys.n, buffers.scores, keys.n);
    }
    return dnnl_success;
  }
  dnnl_memory_set_data_handle(binding->query.get(), query);
  dnnl_memory_set_data_handle(binding->key_t.get(),
                              const_cast<char*>(keys.keys));
  dnnl_memory_set_data_handle(binding->scores.get(), buffers.scores);
  return Execute(binding->plan->scores, context.stream, binding->query.get(),
                 binding->key_t.get(), binding->scores.get(),
                 binding->scores_scratchpad.get());
}

void FusedRun::FoldBlock(const Tile& tile, RowRange rows, const KeyBlock& keys,
                         const TileBuffers& buffers) const {
  const int64_t n = keys.n;
  const int64_t length = KeyLength(s_, *p_.options, tile.b);
  for (int64_t r = rows.first; r < rows.last; ++r) {
    const RowKeys& row_keys = buffers.keys[tile.LocalQuery(r)];
    const RowMask row_mask =
        RowMaskAt(tile.b, tile.Head(r), tile.Query(r), keys.k0);
    // The block's scores and probabilities start at the buffers' first row.
    float* row_scores = buffers.scores + (r - rows.first) * n;
    uint16_t* row_probabilities =
        g_.NativeBf16Tiles() ? buffers.probabilities + (r - rows.first) * n
                             : nullptr;
    float alpha;
    if (mods_) {
      // The modified scores are final: the kernel scales them by 1.
      const int64_t position =
          QueryPosition(rules_, length, s_.query_len, tile.Query(r));
      ModifyScores(row_scores, n, keys.k0, p_.scale, row_keys,
                   ModsOf(*p_.options, tile.Head(r), position), row_mask);
      alpha = kernels_.softmax_block(row_scores, n, n, 1.0f, RowMask(),
                                     &buffers.states[r], row_probabilities);
    } else {
      const int64_t visible = std::clamp<int64_t>(row_keys.end - keys.k0, 0, n);
      alpha = kernels_.softmax_block(row_scores, n, visible, p_.scale, row_mask,
                                     &buffers.states[r], row_probabilities);
    }
    if (g_.Bf16Tiles() && !g_.NativeBf16Tiles()) {
      RoundToBf16Values(row_scores, n, row_scores);
    }
    if (alpha != 1.0f) {
      float* out = buffers.output + r * s_.value_dim;
      for (int64_t c = 0; c < s_.value_dim; ++c) out[c] *= alpha;
    }
  }
}

RowMask FusedRun::RowMaskAt(int64_t b, int64_t h, int64_t i, int64_t k0) const {
  RowMask row_mask;
  if (mask_ == nullptr) return row_mask;
  const int64_t offset = b * mask_strides_.batch + h * mask_strides_.head +
                         i * mask_strides_.query + k0 * mask_strides_.key;
  if (mask_->bias != nullptr) {
    row_mask.bias = mask_->bias + offset;
    row_mask.bias_stride = mask_strides_.key;
  } else {
    row_mask.allowed = mask_->allowed + offset;
    row_mask.allowed_stride = mask_strides_.key;
  }
  return row_mask;
}

dnnl_status_t FusedRun::AccumulateBlock(RowRange rows, const KeyBlock& keys,
                                        const TileBuffers& buffers,
                                        TileBinding* binding,
                                        ThreadContext& context) const {
  float* const output = buffers.output + rows.first * s_.value_dim;
  if (g_.small) {
    const float* value_block = reinterpret_cast<const float*>(keys.values);
    if (g_.Bf16()) {
      kernels_.small_accumulate_bf16(buffers.scores, keys.n, rows.size(),
                                     keys.n, value_block, s_.value_dim, output);
    } else {
      kernels_.small_accumulate_f32(buffers.scores, keys.n, rows.size(), keys.n,
                                    value_block, s_.value_dim, output);
    }
    return dnnl_success;
  }
  if (ValuesNotFinite(keys)) return AccumulateSeenValues(rows, keys, buffers);
  dnnl_memory_set_data_handle(binding->probabilities.get(),
                              g_.NativeBf16Tiles()
                                  ? static_cast<void*>(buffers.probabilities)
                                  : buffers.scores);
  dnnl_memory_set_data_handle(binding->value.get(),
                              const_cast<char*>(keys.values));
  dnnl_memory_set_data_handle(binding->output.get(), output);
  return Execute(binding->plan->context, context.stream,
                 binding->probabilities.get(), binding->value.get(),
                 binding->output.get(), binding->context_scratchpad.get());
}

bool FusedRun::ValuesNotFinite(const KeyBlock& keys) const {
  // The tiles' values are bf16 when two bytes wide (half inputs read in place
  // or packed for bf16 tiles), else f32 (f16 ones widened by WidenBlock).
  if (keys.element == 2) {
    return kernels_.any_non_finite_bf16(
        reinterpret_cast<const uint16_t*>(keys.values), keys.n, s_.value_dim,
        keys.value_stride);
  }
  return kernels_.any_non_finite_f32(
      reinterpret_cast<const float*>(keys.values), keys.n, s_.value_dim,
      keys.value_stride);
}

dnnl_status_t FusedRun::AccumulateSeenValues(RowRange rows,
                                             const KeyBlock& keys,
                                             const TileBuffers& buffers) const {
  const int64_t n = keys.n;
  const int64_t dv = s_.value_dim;
  for (int64_t r = 0; r < rows.size(); ++r) {
    float* out = buffers.output + (rows.first + r) * dv;
    for (int64_t j = 0; j < n; ++j) {
      const float weight =
          g_.NativeBf16Tiles()
              ? BFloat16ToFloat32(buffers.probabilities[r * n + j])
              : buffers.scores[r * n + j];
      if (weight == 0.0f) continue;  // A key the row does not see.
      const int64_t first = j * keys.value_stride;
      if (keys.element == 2) {
        const uint16_t* value =
            reinterpret_cast<const uint16_t*>(keys.values) + first;
        for (int64_t c = 0; c < dv; ++c) {
          out[c] += weight * BFloat16ToFloat32(value[c]);
        }
      } else {
        const float* value =
            reinterpret_cast<const float*>(keys.values) + first;
        for (int64_t c = 0; c < dv; ++c) out[c] += weight * value[c];
      }
    }
  }
  return dnnl_success;
}

void FusedRun::KeepPartial(const Tile& tile, int64_t split,
                           const TileBuffers& buffers) const {
  const int64_t slot = (tile.index * g_.splits + split) * g_.rows;
  float* partial_output =
      reinterpret_cast<float*>(partials_) + slot * s_.value_dim;
  RowState* partial_states =
      reinterpret_cast<RowState*>(partials_ + PartialStatesOffset(s_, g_)) +
      slot;
  std::memcpy(partial_output, buffers.output,
              static_cast<size_t>(tile.rows * s_.value_dim) * 4);
  std::copy(buffers.states, buffers.states + tile.rows, partial_states);
}

void FusedRun::WriteRows(const Tile& tile, const TileBuffers& buffers) const {
  for (int64_t r = 0; r < tile.rows; ++r) {
    WriteRow(tile.b, tile.Head(r), tile.Query(r),
             buffers.output + r * s_.value_dim, buffers.states[r]);
  }
}

}  // namespace attnserve::internal::fused
