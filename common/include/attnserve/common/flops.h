// The floating-point operation counts every rate attnserve reports is measured
// in: the engine's choice of thread team, the server's
// attnserve_floating_point_operations_total, and `attnctl bench`'s GFLOP/s. One
// home, so the three always agree.
#ifndef ATTNSERVE_COMMON_FLOPS_H_
#define ATTNSERVE_COMMON_FLOPS_H_

namespace attnserve {

// The dimensions of one attention problem, as counts. Doubles: the products
// overflow no integer type, and a client that has only proto shapes can fill
// them.
struct AttentionDims {
  double batch = 1;      // B
  double heads = 1;      // H, query heads
  double query_len = 1;  // Lq
  double key_len = 1;    // Lk
  double key_dim = 1;    // Dk
  double value_dim = 1;  // Dv
};

// The projections of one multi-head attention call around its attention.
struct ProjectionDims {
  double embed_dim = 1;     // E, of the query input and the output
  double kv_embed_dim = 1;  // Ekv, of the key/value input
  double kv_heads = 1;      // Hkv
};

// FLOPs of one SDPA call, FlashAttention's convention: 2·B·H·Lq·Lk·(Dk + Dv),
// if causal times the share of the Lq × Lk score pairs the causal mask leaves
// (the masked ones are never computed): L(L + 1)/2 of L² where Lq = Lk (about
// half, FlashAttention's count), and all Lk keys for a decode step's one row
// aligned at the bottom right (`bottom_right`: query i sees keys up to
// i + Lk − Lq; otherwise up to i).
double AttentionFlops(const AttentionDims& dims, bool causal,
                      bool bottom_right = false);

// FLOPs of one MHA call: the attention plus 2·rows·in·out for each of the
// query, key, value and output projections.
double MultiHeadFlops(const AttentionDims& dims,
                      const ProjectionDims& projections, bool causal,
                      bool bottom_right = false);

}  // namespace attnserve

#endif  // ATTNSERVE_COMMON_FLOPS_H_
