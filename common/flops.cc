#include "attnserve/common/flops.h"

namespace attnserve {

double AttentionFlops(const AttentionDims& d, bool causal) {
  const double flops = 2.0 * d.batch * d.heads * d.query_len * d.key_len *
                       (d.key_dim + d.value_dim);
  return causal ? flops / 2 : flops;
}

double MultiHeadFlops(const AttentionDims& d, const ProjectionDims& p,
                      bool causal) {
  const double query_rows = d.batch * d.query_len;
  const double kv_rows = d.batch * d.key_len;
  const double projections =
      2.0 * (query_rows * p.embed_dim * d.heads * d.key_dim +
             kv_rows * p.kv_embed_dim * p.kv_heads * (d.key_dim + d.value_dim) +
             query_rows * d.heads * d.value_dim * p.embed_dim);
  return projections + AttentionFlops(d, causal);
}

}  // namespace attnserve
