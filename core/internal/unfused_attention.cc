#include "internal/unfused_attention.h"

#include <algorithm>

#include "internal/dnnl_status.h"

namespace attnserve::internal {
namespace {

using dnnl::memory;
using Dims = memory::dims;

// The three primitives for a slab of `groups` kv-head groups. The tensors are
// viewed as 3-D batches over the flattened (batch, kv head) index: query
// [groups, rows, Dk] where rows = (H / Hkv) · Lq (the query heads of a group
// are contiguous), key [groups, Lk, Dk] read as Kᵀ through strides, value
// [groups, Lk, Dv], output [groups, rows, Dv].
struct SlabPlan {
  memory::desc query_md, key_t_md, value_md, scores_md, output_md;
  dnnl::matmul scores;
  dnnl::softmax_forward softmax;
  dnnl::matmul context;
};

SlabPlan MakeSlabPlan(const dnnl::engine& engine, int64_t groups, int64_t rows,
                      int64_t key_len, int64_t key_dim, int64_t value_dim,
                      float scale) {
  SlabPlan plan;
  const auto f32 = memory::data_type::f32;
  const auto abc = memory::format_tag::abc;
  plan.query_md = memory::desc({groups, rows, key_dim}, f32, abc);
  plan.key_t_md = memory::desc({groups, key_dim, key_len}, f32,
                               Dims{key_len * key_dim, 1, key_dim});
  plan.value_md = memory::desc({groups, key_len, value_dim}, f32, abc);
  plan.scores_md = memory::desc({groups, rows, key_len}, f32, abc);
  plan.output_md = memory::desc({groups, rows, value_dim}, f32, abc);

  dnnl::primitive_attr scale_attr;
  scale_attr.set_output_scales(0, {scale});
  plan.scores = dnnl::matmul(dnnl::matmul::primitive_desc(
      dnnl::matmul::desc(plan.query_md, plan.key_t_md, plan.scores_md),
      scale_attr, engine));
  plan.softmax = dnnl::softmax_forward(dnnl::softmax_forward::primitive_desc(
      dnnl::softmax_forward::desc(dnnl::prop_kind::forward_inference,
                                  plan.scores_md, 2),
      engine));
  plan.context = dnnl::matmul(dnnl::matmul::primitive_desc(
      dnnl::matmul::desc(plan.scores_md, plan.value_md, plan.output_md),
      engine));
  return plan;
}

// oneDNN never writes through a source argument; its memory API just takes
// void*.
void* Mutable(const float* data) { return const_cast<float*>(data); }

}  // namespace

int64_t GroupScoreElements(const AttentionShape& shape) {
  return (shape.heads / shape.kv_heads) * shape.query_len * shape.key_len;
}

absl::Status RunUnfusedAttention(const dnnl::engine& engine,
                                 dnnl::stream& stream,
                                 const AttentionShape& shape, float scale,
                                 const float* query, const float* key,
                                 const float* value, float* output,
                                 int64_t slab_workspace_bytes) {
  const int64_t total_groups = shape.batch * shape.kv_heads;
  const int64_t rows = (shape.heads / shape.kv_heads) * shape.query_len;
  const int64_t group_score_bytes =
      GroupScoreElements(shape) * int64_t{sizeof(float)};
  const int64_t slab_groups = std::clamp<int64_t>(
      slab_workspace_bytes / group_score_bytes, 1, total_groups);

  return CallDnnl("unfused attention", [&] {
    SlabPlan full = MakeSlabPlan(engine, slab_groups, rows, shape.key_len,
                                 shape.key_dim, shape.value_dim, scale);
    memory scores(full.scores_md, engine);
    for (int64_t first = 0; first < total_groups; first += slab_groups) {
      const int64_t groups = std::min(slab_groups, total_groups - first);
      SlabPlan remainder;
      if (groups != slab_groups) {
        remainder = MakeSlabPlan(engine, groups, rows, shape.key_len,
                                 shape.key_dim, shape.value_dim, scale);
      }
      const SlabPlan& plan = groups == slab_groups ? full : remainder;
      memory query_mem(plan.query_md, engine,
                       Mutable(query + first * rows * shape.key_dim));
      memory key_mem(plan.key_t_md, engine,
                     Mutable(key + first * shape.key_len * shape.key_dim));
      memory value_mem(
          plan.value_md, engine,
          Mutable(value + first * shape.key_len * shape.value_dim));
      memory scores_mem(plan.scores_md, engine, scores.get_data_handle());
      memory output_mem(plan.output_md, engine,
                        output + first * rows * shape.value_dim);

      plan.scores.execute(stream, {{DNNL_ARG_SRC, query_mem},
                                   {DNNL_ARG_WEIGHTS, key_mem},
                                   {DNNL_ARG_DST, scores_mem}});
      plan.softmax.execute(
          stream, {{DNNL_ARG_SRC, scores_mem}, {DNNL_ARG_DST, scores_mem}});
      plan.context.execute(stream, {{DNNL_ARG_SRC, scores_mem},
                                    {DNNL_ARG_WEIGHTS, value_mem},
                                    {DNNL_ARG_DST, output_mem}});
    }
    stream.wait();
  });
}

}  // namespace attnserve::internal
