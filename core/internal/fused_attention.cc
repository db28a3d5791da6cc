#include "internal/fused_attention.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/common/status_macros.h"
#include "internal/dnnl_status.h"
#include "internal/fused_plan.h"
#include "internal/fused_run.h"
#include "internal/matmul.h"
#include "internal/score_mods.h"
#include "internal/tile_matmuls.h"

namespace attnserve::internal {
namespace fused {

FusedRun::FusedRun(const SdpaProblem& p, const Geometry& g,
                   const TileKernels& kernels)
    : p_(p),
      s_(p.shape),
      g_(g),
      kernels_(kernels),
      mask_(p.options->mask ? &*p.options->mask : nullptr),
      mask_strides_(mask_ != nullptr ? StridesOf(*mask_)
                                     : MaskStrides{0, 0, 0, 0}),
      mods_(HasScoreMods(*p.options)),
      rules_(RulesOf(*p.options)),
      stopper_(p.options->stop) {}

absl::Status FusedRun::Run(const dnnl::engine& engine, int threads,
                           TilePlanCache& cache, ScratchPool& pool) {
  ATTNSERVE_RETURN_IF_ERROR(PackKeysAndValues(pool));
  int64_t scratchpad_bytes = 0;
  ATTNSERVE_RETURN_IF_ERROR(
      GetTilePlans(engine, threads, cache, &scratchpad_bytes));
  ATTNSERVE_RETURN_IF_ERROR(AllocateWorkspace(threads, scratchpad_bytes, pool));
  std::vector<ThreadContext> contexts(static_cast<size_t>(threads));
  ATTNSERVE_RETURN_IF_ERROR(MakeThreadContexts(engine, threads, &contexts));
  ATTNSERVE_RETURN_IF_ERROR(RunTiles(threads, contexts));
  // Stopped: the tiles left are skipped, the outputs undefined.
  if (stopper_.stopped()) return stopper_.status();
  return absl::OkStatus();
}

absl::Status FusedRun::PackKeysAndValues(ScratchPool& pool) {
  // Half inputs are read in place (Rows), widened a block at a time where the
  // tiles read f32 (WidenBlock); native bf16 tiles read dense bf16 inputs in
  // place, and a bf16 copy of f16 or strided ones.
  if (g_.WidensBlocks() ||
      (g_.HalfSource() && g_.source == DataType::kBFloat16 &&
       KeyValuePacked(p_))) {
    return absl::OkStatus();
  }
  // Keys and values with dense rows, in the matmuls' type (decode tiles
  // round f32 to bf16 as they read, so they only need dense rows).
  if (!g_.HalfSource() && !g_.Bf16Tiles() && KeyValuePacked(p_)) {
    return absl::OkStatus();  // The tiles read them in place (Rows).
  }
  const int64_t element = PackedElementBytes();
  const int64_t key_bytes = AlignUp(s_.KeyElements() * element);
  packed_ = pool.Acquire(key_bytes + s_.ValueElements() * element);
  if (packed_.get() == nullptr) {
    return absl::ResourceExhaustedError(
        "fused attention: cannot allocate packed keys and values");
  }
  key_ = packed_.get();
  value_ = packed_.get() + key_bytes;
  // Where one tile alone reads each (batch entry, kv head), that tile packs
  // them (RunTile): the threads then meet once a call, not twice, and with
  // OMP_WAIT_POLICY=PASSIVE (the server's) every meeting wakes a sleeping
  // thread, some 20 us on a 2-vCPU VM.
  pack_in_tiles_ = g_.q_blocks == 1 && g_.splits == 1;
  if (pack_in_tiles_) return absl::OkStatus();
  // f16 rows are widened on each thread's own part of one buffer, then
  // narrowed. Allocated before the parallel region: a std::bad_alloc thrown
  // inside one ends the process, outside it the call.
  const size_t row =
      g_.source == DataType::kFloat16
          ? static_cast<size_t>(std::max(s_.key_dim, s_.value_dim))
          : 0;
  std::vector<float> widened(row * static_cast<size_t>(omp_get_max_threads()));
#pragma omp parallel
  {
    float* const own =
        widened.data() + row * static_cast<size_t>(omp_get_thread_num());
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < s_.batch; ++b) {
      for (int64_t h = 0; h < s_.kv_heads; ++h) PackHead(b, h, own);
    }
  }
  return absl::OkStatus();
}

void FusedRun::PackHead(int64_t b, int64_t h, float* widened) const {
  PackRows(&KeyOf, p_.half_key, p_.key_strides, s_.key_dim, b, h, widened,
           key_);
  PackRows(&ValueOf, p_.half_value, p_.value_strides, s_.value_dim, b, h,
           widened, value_);
}

void FusedRun::PackRows(const float* (*of)(const SdpaProblem&, int64_t),
                        const uint16_t* half, const Strides4& strides,
                        int64_t dim, int64_t b, int64_t h, float* widened,
                        void* out) const {
  const int64_t first = (b * s_.kv_heads + h) * s_.key_len * dim;
  for (int64_t j = 0; j < s_.key_len; ++j) {
    const int64_t at = first + j * dim;
    if (g_.HalfSource()) {  // Into bf16 rows (native bf16 tiles).
      const uint16_t* row =
          half + b * strides[0] + h * strides[1] + j * strides[2];
      uint16_t* to = static_cast<uint16_t*>(out) + at;
      if (g_.source == DataType::kBFloat16) {
        std::memcpy(to, row, static_cast<size_t>(dim) * 2);
      } else {
        kernels_.f16_to_f32(row, dim, widened);
        kernels_.to_bf16(widened, dim, to);
      }
      continue;
    }
    const float* row = of(p_, b) + h * strides[1] + j * strides[2];
    if (!g_.Bf16Tiles()) {
      std::memcpy(static_cast<float*>(out) + at, row,
                  static_cast<size_t>(dim) * sizeof(float));
    } else if (g_.NativeBf16Tiles()) {
      kernels_.to_bf16(row, dim, static_cast<uint16_t*>(out) + at);
    } else {
      RoundToBf16Values(row, dim, static_cast<float*>(out) + at);
    }
  }
}

const char* FusedRun::Rows(const void* packed, const uint16_t* half,
                           const float* (*of)(const SdpaProblem&, int64_t),
                           const Strides4& strides, int64_t dim, int64_t b,
                           int64_t h) const {
  const int64_t first_row = (b * s_.kv_heads + h) * s_.key_len;
  if (packed != nullptr) {
    return static_cast<const char*>(packed) +
           first_row * dim * PackedElementBytes();
  }
  if (g_.HalfSource()) {  // Read in place, rows RowStride apart.
    return reinterpret_cast<const char*>(half + b * strides[0] +
                                         h * strides[1]);
  }
  return reinterpret_cast<const char*>(of(p_, b) + h * strides[1]);
}

absl::Status FusedRun::GetTilePlans(const dnnl::engine& engine, int threads,
                                    TilePlanCache& cache,
                                    int64_t* scratchpad_bytes) {
  *scratchpad_bytes = 0;
  if (g_.small) return absl::OkStatus();  // Decode tiles run no matmul.
  // The row counts of a full tile, the last tile and, under bands, a band
  // and the last band of each of the two (at most kTilePlans).
  const int64_t last_queries = s_.query_len - (g_.q_blocks - 1) * g_.q_block;
  std::vector<int64_t> queries = {g_.q_block, last_queries};
  if (g_.Banded()) {
    queries.insert(queries.end(), {g_.band, g_.LastBand(g_.q_block),
                                   g_.LastBand(last_queries)});
  }
  int planned = 0;
  for (const int64_t q : queries) {
    const int64_t m = g_.group * q;
    if (std::find(plan_rows_, plan_rows_ + planned, m) ==
        plan_rows_ + planned) {
      plan_rows_[planned++] = m;
    }
  }
  // The key-block widths this call can use.
  std::vector<int64_t> ns = {g_.k_block, LastKeys()};
  if (ShortensBlocks()) {
    for (int64_t n = kKeyGranule; n < g_.k_block; n += kKeyGranule) {
      ns.push_back(n);
    }
  }
  // Built single-threaded, shared through the cache.
  omp_set_num_threads(1);
  const absl::Status built = CallDnnl("building tile matmuls", [&] {
    for (int a = 0; a < planned; ++a) {
      for (const int64_t n : ns) {
        std::shared_ptr<const TilePlan>& plan = plans_[a][KeyWidthIndex(n)];
        if (plan != nullptr) continue;
        plan = cache.GetOrCreate(TileKey(plan_rows_[a], n, s_, g_.input), [&] {
          return MakeTilePlan(engine, plan_rows_[a], n, s_, g_.input);
        });
        *scratchpad_bytes = std::max<int64_t>(
            {*scratchpad_bytes,
             static_cast<int64_t>(plan->scores_scratchpad_md.get_size()),
             static_cast<int64_t>(plan->context_scratchpad_md.get_size())});
      }
    }
  });
  omp_set_num_threads(threads);
  return built;
}

absl::Status FusedRun::AllocateWorkspace(int threads, int64_t scratchpad_bytes,
                                         ScratchPool& pool) {
  layout_ = MakeThreadLayout(s_, g_, scratchpad_bytes);
  const int64_t partial_bytes = PartialBytes(s_, g_);
  const int64_t total = layout_.total * threads + AlignUp(partial_bytes);
  workspace_ = pool.Acquire(total);
  if (workspace_.get() == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "fused attention: cannot allocate ", total, " bytes of workspace"));
  }
  partials_ = workspace_.get() + layout_.total * threads;
  return absl::OkStatus();
}

absl::Status FusedRun::MakeThreadContexts(
    const dnnl::engine& engine, int threads,
    std::vector<ThreadContext>* contexts) {
  ATTNSERVE_RETURN_IF_ERROR(CallDnnl("creating streams", [&] {
    for (int t = 0; t < threads; ++t) {
      ThreadContext& context = (*contexts)[static_cast<size_t>(t)];
      context.buffer = workspace_.get() + layout_.total * t;
      context.stream = dnnl::stream(engine);
    }
  }));
  engine_ = engine.get();
  return absl::OkStatus();
}

absl::Status FusedRun::RunTiles(int threads,
                                std::vector<ThreadContext>& contexts) {
  // Tiles handed out one at a time, a head's in a row so that its keys and
  // values stay in cache from one tile to the next, and within a head the
  // heaviest first (under causality the last query blocks see the most keys).
  // The thread that ends a tile's last split merges the tile (no second
  // meeting of the threads: see PackKeysAndValues).
  const int64_t items = g_.tiles * g_.splits;
  std::atomic<int> failure{dnnl_success};
  // Splits ended, by tile (value-initialized: zeros).
  std::vector<std::atomic<int64_t>> splits_done(
      g_.splits > 1 ? static_cast<size_t>(g_.tiles) : 0);
#pragma omp parallel for num_threads(threads) \
    schedule(dynamic, 1) if (threads > 1 && items > 1)
  for (int64_t item = 0; item < items; ++item) {
    if (failure.load(std::memory_order_relaxed) != dnnl_success ||
        stopper_.ShouldStop()) {
      continue;
    }
    const int64_t split = item % g_.splits;
    const int64_t order = item / g_.splits;
    const int64_t q_block = g_.q_blocks - 1 - order % g_.q_blocks;
    const int64_t tile = (order / g_.q_blocks) * g_.q_blocks + q_block;
    ThreadContext& context =
        contexts[static_cast<size_t>(omp_get_thread_num())];
    const dnnl_status_t status =
        RunTile(tile, g_.splits == 1 ? -1 : split, context);
    if (status != dnnl_success) {
      failure.store(status);
    } else if (g_.splits > 1 &&
               splits_done[static_cast<size_t>(tile)].fetch_add(
                   1, std::memory_order_acq_rel) +
                       1 ==
                   g_.splits) {
      // The thread's output rows are free once its split is kept.
      MergeTile(tile,
                reinterpret_cast<float*>(context.buffer + layout_.output));
    }
  }
  if (failure.load() != dnnl_success) {
    return absl::InternalError(absl::StrCat(
        "fused attention: a tile matmul failed with oneDNN status ",
        failure.load()));
  }
  return absl::OkStatus();
}

void FusedRun::MergeTile(int64_t tile, float* merged) const {
  const float* partial_outputs = reinterpret_cast<const float*>(partials_);
  const RowState* partial_states = reinterpret_cast<const RowState*>(
      partials_ + PartialStatesOffset(s_, g_));
  const Tile t = TileAt(tile);
  for (int64_t r = 0; r < t.rows; ++r) {
    RowState state{kNegativeInfinity, 0.0f, false};
    for (int64_t split = 0; split < g_.splits; ++split) {
      const RowState& part =
          partial_states[(tile * g_.splits + split) * g_.rows + r];
      state.max = std::max(state.max, part.max);
      state.nan = state.nan || part.nan;
    }
    std::fill(merged, merged + s_.value_dim, 0.0f);
    if (state.max != kNegativeInfinity && !state.nan) {
      for (int64_t split = 0; split < g_.splits; ++split) {
        const int64_t slot = (tile * g_.splits + split) * g_.rows + r;
        const RowState& part = partial_states[slot];
        if (part.max == kNegativeInfinity) continue;
        const float factor = std::exp(part.max - state.max);
        state.sum += part.sum * factor;
        const float* out = partial_outputs + slot * s_.value_dim;
        for (int64_t c = 0; c < s_.value_dim; ++c) merged[c] += out[c] * factor;
      }
    }
    WriteRow(t.b, t.Head(r), t.Query(r), merged, state);
  }
}

void FusedRun::WriteRow(int64_t b, int64_t h, int64_t i,
                        const float* accumulated, const RowState& state) const {
  const Strides4& os = p_.output_strides;
  float* out = OutputOf(p_, b) + h * os[1] + i * os[2];
  float* const lse = LseOf(p_, b, h, i);  // Null unless asked for.
  if (state.nan) {
    std::fill(out, out + s_.value_dim, kNaN);
    if (lse != nullptr) *lse = kNaN;
  } else if (state.max == kNegativeInfinity) {
    // The row may see no key.
    std::fill(out, out + s_.value_dim, 0.0f);
    if (lse != nullptr) *lse = kNegativeInfinity;
  } else {
    const float inverse = 1.0f / state.sum;
    for (int64_t c = 0; c < s_.value_dim; ++c)
      out[c] = accumulated[c] * inverse;
    if (lse != nullptr) *lse = state.max + std::log(state.sum);
  }
}

}  // namespace fused

bool KeyValuePacked(const SdpaProblem& p) {
  return p.key_strides[2] == p.shape.key_dim && p.key_strides[3] == 1 &&
         p.value_strides[2] == p.shape.value_dim && p.value_strides[3] == 1;
}

absl::Status RunFusedAttention(const dnnl::engine& engine,
                               const SdpaProblem& problem, int threads,
                               const TileKernels& kernels, TilePlanCache& cache,
                               ScratchPool& pool) {
  const fused::Geometry geometry = fused::MakeGeometry(
      problem.shape, *problem.options,
      problem.tiling.threads > 0 ? problem.tiling.threads : threads,
      problem.input_dtype, problem.tiling.batch);
  fused::FusedRun run(problem, geometry, kernels);
  return run.Run(engine, threads, cache, pool);
}

}  // namespace attnserve::internal
