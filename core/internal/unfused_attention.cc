#include "internal/unfused_attention.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attnserve/common/checked_math.h"
#include "attnserve/common/status_macros.h"
#include "internal/bf16_buffer.h"
#include "internal/dnnl_status.h"
#include "internal/matmul.h"
#include "internal/score_pass.h"
#include "internal/stopper.h"

namespace attnserve::internal {
namespace {

using dnnl::memory;
using Dims = memory::dims;

// How many batch items, kv heads and query rows one slab covers: every row
// unless one kv head's group of heads is more than a slab.
struct SlabExtent {
  int64_t batch_count;
  int64_t kv_head_count;
  int64_t query_count;
};

// The most scores a slab holds where one kv head's group allows fewer: the
// call's stop check is polled between slabs, a few milliseconds apart at this
// size (a 4M-score slab is about 1 GFLOP of each matmul at Dk 128).
constexpr int64_t kScoresBetweenPolls = int64_t{1} << 22;

// Slabs are 5-D: [batches, kv heads, H / Hkv, query rows, feature]. The query
// heads that share a kv head sit in the third dimension, and keys and values
// broadcast over it.
Dims QueryDims(const AttentionShape& s, const SlabExtent& e, int64_t feature) {
  return {e.batch_count, e.kv_head_count, s.heads / s.kv_heads, e.query_count,
          feature};
}

Dims GroupedStrides(const Strides4& st, int64_t group) {
  return {st[0], st[1] * group, st[1], st[2], st[3]};
}

// The tensors the matmuls read: f32 views of the caller's memory, or packed
// bf16-precision copies.
struct Operands {
  MatmulInput input;
  const void* query;
  Strides4 query_strides;
  const void* key;
  Strides4 key_strides;
  const void* value;
  Strides4 value_strides;
};

SlabPlan MakeSlabPlan(const dnnl::engine& engine, const SdpaProblem& p,
                      const Operands& in, const SlabExtent& e) {
  const AttentionShape& s = p.shape;
  const int64_t group = s.heads / s.kv_heads;
  const auto f32 = memory::data_type::f32;
  SlabPlan plan;
  const memory::data_type in_type = DataTypeOf(in.input);
  plan.query_md = memory::desc(QueryDims(s, e, s.key_dim), in_type,
                               GroupedStrides(in.query_strides, group));
  const Strides4& ks = in.key_strides;
  plan.key_t_md =
      memory::desc({e.batch_count, e.kv_head_count, 1, s.key_dim, s.key_len},
                   in_type, Dims{ks[0], ks[1], ks[1], ks[3], ks[2]});
  const Strides4& vs = in.value_strides;
  plan.value_md =
      memory::desc({e.batch_count, e.kv_head_count, 1, s.key_len, s.value_dim},
                   in_type, Dims{vs[0], vs[1], vs[1], vs[2], vs[3]});
  plan.scores_md =
      memory::desc(QueryDims(s, e, s.key_len), f32, memory::format_tag::abcde);
  plan.probabilities_md = memory::desc(QueryDims(s, e, s.key_len), in_type,
                                       memory::format_tag::abcde);
  plan.output_md = memory::desc(QueryDims(s, e, s.value_dim), f32,
                                GroupedStrides(p.output_strides, group));

  dnnl::primitive_attr scale_attr;
  scale_attr.set_output_scales(0, {p.scale});
  scale_attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::primitive_attr context_attr;
  context_attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const dnnl::matmul::primitive_desc scores_pd = MakeMatmulPrimitiveDesc(
      dnnl::matmul::desc(plan.query_md, plan.key_t_md, plan.scores_md),
      scale_attr, engine);
  const dnnl::matmul::primitive_desc context_pd = MakeMatmulPrimitiveDesc(
      dnnl::matmul::desc(plan.probabilities_md, plan.value_md, plan.output_md),
      context_attr, engine);
  plan.scores = dnnl::matmul(scores_pd);
  plan.context = dnnl::matmul(context_pd);
  plan.scratchpad_md = scores_pd.scratchpad_desc().get_size() >=
                               context_pd.scratchpad_desc().get_size()
                           ? scores_pd.scratchpad_desc()
                           : context_pd.scratchpad_desc();
  return plan;
}

// Everything MakeSlabPlan's primitives depend on.
std::string PlanKey(const SdpaProblem& p, const Operands& in,
                    const SlabExtent& e) {
  const AttentionShape& s = p.shape;
  uint32_t scale_bits;
  std::memcpy(&scale_bits, &p.scale, sizeof(scale_bits));
  return absl::StrCat(e.batch_count, ",", e.kv_head_count, ",", e.query_count,
                      ":", s.heads, ",", s.kv_heads, ",", s.query_len, ",",
                      s.key_len, ",", s.key_dim, ",", s.value_dim, ":",
                      static_cast<int>(in.input), ":",
                      absl::StrJoin(in.query_strides, ","), ":",
                      absl::StrJoin(in.key_strides, ","), ":",
                      absl::StrJoin(in.value_strides, ","), ":",
                      absl::StrJoin(p.output_strides, ","), ":", scale_bits);
}

// The largest slab within the budget and kScoresBetweenPolls: whole groups
// of kv heads, then of batch items, as many as fit; where one kv head's group
// is more, rows of its queries, at least one.
SlabExtent FullSlabExtent(const AttentionShape& s, int64_t slab_budget_bytes,
                          Precision precision) {
  const int64_t per_score = precision == Precision::kBFloat16 ? 6 : 4;
  const int64_t row_bytes = (s.heads / s.kv_heads) * s.key_len * per_score;
  const int64_t group_bytes = row_bytes * s.query_len;
  const int64_t budget =
      std::min(slab_budget_bytes, kScoresBetweenPolls * per_score);
  if (group_bytes > budget) {
    return {1, 1, std::clamp<int64_t>(budget / row_bytes, 1, s.query_len)};
  }
  const int64_t kv_heads =
      std::clamp<int64_t>(budget / group_bytes, 1, s.kv_heads);
  if (kv_heads < s.kv_heads) return {1, kv_heads, s.query_len};
  const int64_t batches =
      std::clamp<int64_t>(budget / (group_bytes * s.kv_heads), 1, s.batch);
  return {batches, s.kv_heads, s.query_len};
}

const void* Offset(const void* base, MatmulInput input, int64_t elements) {
  return static_cast<const char*>(base) + elements * BytesOf(input);
}

void* Mutable(const void* data) { return const_cast<void*>(data); }

}  // namespace

std::optional<int64_t> UnfusedWorkspaceBytes(const AttentionShape& s,
                                             Precision precision,
                                             int64_t slab_budget_bytes,
                                             bool packed) {
  const int64_t per_score = precision == Precision::kBFloat16 ? 6 : 4;
  const std::optional<int64_t> group_bytes =
      CheckedProduct({s.heads / s.kv_heads, s.query_len, s.key_len, per_score});
  if (!group_bytes) return std::nullopt;
  const SlabExtent full = FullSlabExtent(s, slab_budget_bytes, precision);
  int64_t total = (s.heads / s.kv_heads) * full.query_count * s.key_len *
                  per_score * full.batch_count * full.kv_head_count;
  const MatmulInput input = MatmulInputFor(precision);
  if (input != MatmulInput::kF32) {
    // Packed bf16-precision copies of Q, K and V (products checked by the
    // caller's shape validation).
    total += BytesOf(input) *
             (s.QueryElements() + s.KeyElements() + s.ValueElements());
  }
  if (!packed) {
    total += 4 * (s.QueryElements() + s.KeyElements() + s.ValueElements() +
                  s.OutputElements());
  }
  return total;
}

absl::Status RunUnfusedAttention(const dnnl::engine& engine,
                                 dnnl::stream& stream, const SdpaProblem& p,
                                 int64_t slab_budget_bytes,
                                 SlabPlanCache& cache) {
  if (!p.batches.empty()) {
    return absl::InternalError(
        "the unfused path does not take batch entries apart; the engine "
        "should have sent this call to the fused kernel");
  }
  const AttentionShape& s = p.shape;
  const Strides4 query_packed = PackedStrides(s.heads, s.query_len, s.key_dim);
  const Strides4 key_packed = PackedStrides(s.kv_heads, s.key_len, s.key_dim);
  const Strides4 value_packed =
      PackedStrides(s.kv_heads, s.key_len, s.value_dim);
  const Strides4 output_packed =
      PackedStrides(s.heads, s.query_len, s.value_dim);
  if (p.query_strides != query_packed || p.key_strides != key_packed ||
      p.value_strides != value_packed || p.output_strides != output_packed) {
    std::vector<float> query(static_cast<size_t>(s.QueryElements())),
        key(static_cast<size_t>(s.KeyElements())),
        value(static_cast<size_t>(s.ValueElements())),
        output(p.output != nullptr ? static_cast<size_t>(s.OutputElements())
                                   : 0);
    CopyTensor4(p.query, p.query_strides, query.data(), query_packed,
                {s.batch, s.heads, s.query_len, s.key_dim});
    CopyTensor4(p.key, p.key_strides, key.data(), key_packed,
                {s.batch, s.kv_heads, s.key_len, s.key_dim});
    CopyTensor4(p.value, p.value_strides, value.data(), value_packed,
                {s.batch, s.kv_heads, s.key_len, s.value_dim});
    SdpaProblem packed = p;
    packed.query = query.data();
    packed.query_strides = query_packed;
    packed.key = key.data();
    packed.key_strides = key_packed;
    packed.value = value.data();
    packed.value_strides = value_packed;
    packed.output = p.output != nullptr ? output.data() : nullptr;
    packed.output_strides = output_packed;
    ATTNSERVE_RETURN_IF_ERROR(
        RunUnfusedAttention(engine, stream, packed, slab_budget_bytes, cache));
    if (p.output != nullptr) {
      CopyTensor4(output.data(), output_packed, p.output, p.output_strides,
                  {s.batch, s.heads, s.query_len, s.value_dim});
    }
    return absl::OkStatus();
  }
  const Precision precision = p.options->precision;
  const MatmulInput input = MatmulInputFor(precision);
  const bool bf16 = input == MatmulInput::kBf16;
  // Polled between slabs: a stopped call skips the slabs left.
  Stopper stopper(p.options->stop);
  ATTNSERVE_RETURN_IF_ERROR(CallDnnl("unfused attention", [&] {
    Bf16Buffer query_bf16, key_bf16, value_bf16;
    Operands in{MatmulInput::kF32, p.query, p.query_strides, p.key,
                p.key_strides,     p.value, p.value_strides};
    if (input != MatmulInput::kF32) {
      query_bf16 = Bf16Buffer::Pack(p.query, s.batch, s.heads, s.query_len,
                                    s.key_dim, p.query_strides, input);
      key_bf16 = Bf16Buffer::Pack(p.key, s.batch, s.kv_heads, s.key_len,
                                  s.key_dim, p.key_strides, input);
      value_bf16 = Bf16Buffer::Pack(p.value, s.batch, s.kv_heads, s.key_len,
                                    s.value_dim, p.value_strides, input);
      in = Operands{input,
                    query_bf16.data(),
                    PackedStrides(s.heads, s.query_len, s.key_dim),
                    key_bf16.data(),
                    PackedStrides(s.kv_heads, s.key_len, s.key_dim),
                    value_bf16.data(),
                    PackedStrides(s.kv_heads, s.key_len, s.value_dim)};
    }
    if (p.options->weights == AttentionWeightsMode::kHeadMean) {
      std::fill(p.weights.begin(), p.weights.end(), 0.0f);
    }

    const SlabExtent full = FullSlabExtent(s, slab_budget_bytes, precision);
    const int64_t slab_scores = (s.heads / s.kv_heads) * full.query_count *
                                s.key_len * full.batch_count *
                                full.kv_head_count;
    // Uninitialised: the first matmul writes every score before it is read.
    std::unique_ptr<float[]> scores(
        new float[static_cast<size_t>(slab_scores)]);
    std::vector<uint16_t> probabilities(bf16 ? static_cast<size_t>(slab_scores)
                                             : 0);

    for (int64_t b = 0; b < s.batch && !stopper.stopped();
         b += full.batch_count) {
      for (int64_t kv = 0; kv < s.kv_heads && !stopper.stopped();
           kv += full.kv_head_count) {
        for (int64_t q = 0; q < s.query_len; q += full.query_count) {
          if (stopper.ShouldStop()) break;
          const SlabExtent extent{std::min(full.batch_count, s.batch - b),
                                  std::min(full.kv_head_count, s.kv_heads - kv),
                                  std::min(full.query_count, s.query_len - q)};
          const std::shared_ptr<const SlabPlan> cached = cache.GetOrCreate(
              PlanKey(p, in, extent),
              [&] { return MakeSlabPlan(engine, p, in, extent); });
          const SlabPlan& plan = *cached;
          const int64_t group = s.heads / s.kv_heads;
          const Strides4& qs = in.query_strides;
          const Strides4& ks = in.key_strides;
          const Strides4& vs = in.value_strides;
          memory query_mem(
              plan.query_md, engine,
              Mutable(Offset(in.query, in.input,
                             b * qs[0] + kv * group * qs[1] + q * qs[2])));
          memory key_mem(
              plan.key_t_md, engine,
              Mutable(Offset(in.key, in.input, b * ks[0] + kv * ks[1])));
          memory value_mem(
              plan.value_md, engine,
              Mutable(Offset(in.value, in.input, b * vs[0] + kv * vs[1])));
          memory scores_mem(plan.scores_md, engine, scores.get());
          memory probabilities_mem(
              plan.probabilities_md, engine,
              bf16 ? static_cast<void*>(probabilities.data()) : scores.get());
          const memory scratchpad_mem(plan.scratchpad_md, engine);

          plan.scores.execute(stream, {{DNNL_ARG_SRC, query_mem},
                                       {DNNL_ARG_WEIGHTS, key_mem},
                                       {DNNL_ARG_DST, scores_mem},
                                       {DNNL_ARG_SCRATCHPAD, scratchpad_mem}});
          stream.wait();
          SoftmaxScoreSlab(
              s, *p.options,
              ScoreSlab{b, extent.batch_count, kv, extent.kv_head_count, q,
                        extent.query_count},
              scores.get(), input, bf16 ? probabilities.data() : nullptr,
              p.weights, p.lse);
          if (p.output == nullptr) continue;  // The weights and lse only.
          const Strides4& os = p.output_strides;
          memory output_mem(
              plan.output_md, engine,
              p.output + b * os[0] + kv * group * os[1] + q * os[2]);
          plan.context.execute(stream, {{DNNL_ARG_SRC, probabilities_mem},
                                        {DNNL_ARG_WEIGHTS, value_mem},
                                        {DNNL_ARG_DST, output_mem},
                                        {DNNL_ARG_SCRATCHPAD, scratchpad_mem}});
        }
      }
    }
    stream.wait();
  }));
  return stopper.status();
}

}  // namespace attnserve::internal
