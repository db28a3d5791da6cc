#include "internal/tile_matmuls.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve::internal::fused {

using dnnl::memory;
using Dims = memory::dims;

std::string TileKey(int64_t m, int64_t n, const AttentionShape& s,
                    MatmulInput input) {
  return absl::StrCat(m, ",", n, ",", s.key_dim, ",", s.value_dim, ",",
                      static_cast<int>(input));
}

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

dnnl_status_t TileBinding::Bind(const TilePlan& tile_plan, dnnl_engine_t engine,
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

}  // namespace attnserve::internal::fused
