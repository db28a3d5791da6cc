#include "attnserve/common/flops.h"

#include <algorithm>

namespace attnserve {

namespace {

// The score pairs of an Lq × Lk matrix the causal mask leaves, where query
// row i sees keys 0 to i + `offset` (0: top left; Lk − Lq: bottom right).
double CausalPairs(double query_len, double key_len, double offset) {
  // Row i sees clamp(i + offset + 1, 0, Lk) keys: none for the rows before
  // `first`, all of them from `last` on, a growing count between.
  const double seen_by_row_0 = offset + 1;
  const double first = std::clamp(1 - seen_by_row_0, 0.0, query_len);
  const double last = std::clamp(key_len - seen_by_row_0, 0.0, query_len);
  const double between = last - first;
  return between * seen_by_row_0 + between * (first + last - 1) / 2 +
         (query_len - last) * key_len;
}

}  // namespace

double AttentionFlops(const AttentionDims& d, bool causal, bool bottom_right) {
  const double flops = 2.0 * d.batch * d.heads * d.query_len * d.key_len *
                       (d.key_dim + d.value_dim);
  if (!causal || d.query_len <= 0 || d.key_len <= 0) return flops;
  const double pairs = CausalPairs(
      d.query_len, d.key_len, bottom_right ? d.key_len - d.query_len : 0.0);
  return flops * pairs / (d.query_len * d.key_len);
}

double MultiHeadFlops(const AttentionDims& d, const ProjectionDims& p,
                      bool causal, bool bottom_right) {
  const double query_rows = d.batch * d.query_len;
  const double kv_rows = d.batch * d.key_len;
  const double projections =
      2.0 * (query_rows * p.embed_dim * d.heads * d.key_dim +
             kv_rows * p.kv_embed_dim * p.kv_heads * (d.key_dim + d.value_dim) +
             query_rows * d.heads * d.value_dim * p.embed_dim);
  return projections + AttentionFlops(d, causal, bottom_right);
}

}  // namespace attnserve
