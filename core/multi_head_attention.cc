// Multi-head attention: the Q, K and V projections (one GEMM for
// self-attention with stacked weights), SDPA per head over strided views of
// them, and the output projection.
#include <algorithm>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/common/checked_math.h"
#include "attnserve/common/flops.h"
#include "attnserve/common/status_macros.h"
#include "internal/attention_engine_impl.h"
#include "internal/linear.h"
#include "internal/sdpa_problem.h"
#include "internal/validation.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::internal {
namespace {

// The most scratch any one of the call's projections needs (they run one at a
// time).
int64_t LargestProjectionWorkspace(const MultiHeadShape& s, bool fused,
                                   Precision precision) {
  const int64_t q_rows = s.batch * s.query_len, kv_rows = s.batch * s.key_len;
  const int64_t q_out = s.heads * s.key_dim, k_out = s.kv_heads * s.key_dim,
                v_out = s.kv_heads * s.value_dim,
                context_out = s.heads * s.value_dim;
  const LinearProblem fused_qkv[] = {
      {q_rows, s.embed_dim, q_out + k_out + v_out}};
  const LinearProblem separate[] = {{q_rows, s.embed_dim, q_out},
                                    {kv_rows, s.kv_embed_dim, k_out},
                                    {kv_rows, s.kv_embed_dim, v_out}};
  int64_t largest =
      LinearWorkspaceBytes({q_rows, context_out, s.embed_dim}, precision);
  for (const LinearProblem& p :
       fused ? absl::MakeConstSpan(fused_qkv) : absl::MakeConstSpan(separate)) {
    largest = std::max(largest, LinearWorkspaceBytes(p, precision));
  }
  return largest;
}

const float* OrNull(absl::Span<const float> span) {
  return span.empty() ? nullptr : span.data();
}

// Q at `q` with `q_width` columns per row, K then V at `kv` with `kv_width`
// per row.
void SetProjectedViews(const MultiHeadShape& shape, const float* q,
                       int64_t q_width, const float* kv, int64_t kv_width,
                       SdpaProblem* problem) {
  problem->query = q;
  problem->query_strides = {shape.query_len * q_width, shape.key_dim, q_width,
                            1};
  problem->key = kv;
  problem->key_strides = {shape.key_len * kv_width, shape.key_dim, kv_width, 1};
  problem->value = kv + shape.kv_heads * shape.key_dim;
  problem->value_strides = {shape.key_len * kv_width, shape.value_dim, kv_width,
                            1};
}

// The stop check's verdict between the projections and the attention (each
// a oneDNN matmul that runs to its end once started).
absl::Status StopIfAsked(const AttentionOptions& options) {
  return options.stop ? options.stop() : absl::OkStatus();
}

// RoPE's configuration and positions.
absl::Status ValidateRope(const MultiHeadShape& shape,
                          const ProjectionWeights& weights,
                          const AttentionOptions& options) {
  const bool positions =
      !options.query_positions.empty() || !options.key_positions.empty();
  if (!weights.rope) {
    if (!positions) return absl::OkStatus();
    return absl::InvalidArgumentError(
        "options.query_positions and key_positions are given without RoPE "
        "(weights.rope), expected none");
  }
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateRotary(*weights.rope, shape.key_dim, "weights.rope"));
  for (const auto& [name, span, length] :
       {std::tuple{"options.query_positions", options.query_positions,
                   shape.query_len},
        std::tuple{"options.key_positions", options.key_positions,
                   shape.key_len}}) {
    if (span.empty()) continue;
    ATTNSERVE_RETURN_IF_ERROR(
        ValidateSpanSize(name, span.size(), shape.batch * length));
    for (size_t i = 0; i < span.size(); ++i) {
      if (span[i] < 0 || span[i] > kMaxRotaryPosition) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, "[", i, "] is ", span[i], ", expected 0 to ",
                         kMaxRotaryPosition));
      }
    }
  }
  return absl::OkStatus();
}

// Rotates the projected queries (rows of `q_stride` floats from `q`) and keys
// (from `k`) in place, if the weights carry RoPE.
void Rotate(const MultiHeadShape& shape, const ProjectionWeights& weights,
            const AttentionOptions& options, float* q, int64_t q_stride,
            float* k, int64_t k_stride) {
  if (!weights.rope) return;
  for (int64_t b = 0; b < shape.batch; ++b) {
    const auto positions = [b](absl::Span<const int64_t> all, int64_t length) {
      return all.empty() ? all : all.subspan(b * length, length);
    };
    ApplyRotary(*weights.rope, shape.key_dim, shape.heads,
                q + b * shape.query_len * q_stride, shape.query_len, q_stride,
                0, positions(options.query_positions, shape.query_len));
    ApplyRotary(*weights.rope, shape.key_dim, shape.kv_heads,
                k + b * shape.key_len * k_stride, shape.key_len, k_stride, 0,
                positions(options.key_positions, shape.key_len));
  }
}

}  // namespace

absl::Status AttentionEngineImpl::MultiHeadAttention(
    const MultiHeadShape& shape, const ProjectionWeights& weights,
    const AttentionOptions& options, absl::Span<const float> query_input,
    absl::Span<const float> kv_input, AttentionOutputs outputs) {
  const bool self_attention = kv_input.empty();
  ATTNSERVE_RETURN_IF_ERROR(ValidateMultiHead(shape, weights, self_attention));
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateSpanSize("query_input", query_input.size(),
                       shape.batch * shape.query_len * shape.embed_dim));
  if (!self_attention) {
    ATTNSERVE_RETURN_IF_ERROR(
        ValidateSpanSize("kv_input", kv_input.size(),
                         shape.batch * shape.key_len * shape.kv_embed_dim));
  }
  const AttentionShape heads = shape.Heads();
  ATTNSERVE_RETURN_IF_ERROR(ValidateRope(shape, weights, options));
  // The positions are RoPE's; the attention itself takes the rest.
  AttentionOptions attention_options = options;
  attention_options.query_positions = {};
  attention_options.key_positions = {};
  ATTNSERVE_RETURN_IF_ERROR(ValidateOptionsAndOutputs(
      heads, attention_options, outputs,
      shape.batch * shape.query_len * shape.embed_dim));

  const int64_t q_out = shape.heads * shape.key_dim;
  const int64_t kv_out = shape.kv_heads * (shape.key_dim + shape.value_dim);
  const int64_t context_out = shape.heads * shape.value_dim;
  const bool fused = self_attention && !weights.w_qkv.empty();
  ATTNSERVE_RETURN_IF_ERROR(CheckWorkspace(
      absl::StrCat("multi-head attention for heads ", heads.DebugString()),
      CheckedSum({CheckedProduct(
                      {shape.batch, shape.query_len, q_out + context_out, 4}),
                  CheckedProduct({shape.batch, shape.key_len, kv_out, 4}),
                  LargestProjectionWorkspace(shape, fused, options.precision),
                  SdpaWorkspaceBytes(heads, options,
                                     /*key_value_packed=*/false)})));

  const double flops = MultiHeadFlops(heads.Dims(), shape.Projections(),
                                      /*causal=*/false);
  ATTNSERVE_ASSIGN_OR_RETURN(dnnl::stream stream, NewStream(flops));
  // Projections, laid out [B, L, heads·D] and read as [B, heads, L, D]
  // through strides.
  const int64_t q_rows = shape.batch * shape.query_len;
  const int64_t kv_rows = shape.batch * shape.key_len;
  std::vector<float> projected;
  SdpaProblem problem = MakeSdpaProblem(heads, attention_options, outputs);
  if (fused) {
    const int64_t width = q_out + kv_out;
    projected.resize(static_cast<size_t>(q_rows * width));
    ATTNSERVE_RETURN_IF_ERROR(RunLinear(
        stream,
        {q_rows, shape.embed_dim, width, query_input.data(), shape.embed_dim,
         weights.w_qkv.data(), OrNull(weights.b_qkv), projected.data(), width},
        options.precision, options.stop));
    SetProjectedViews(shape, projected.data(), width, projected.data() + q_out,
                      width, &problem);
    Rotate(shape, weights, options, projected.data(), width,
           projected.data() + q_out, width);
  } else {
    projected.resize(static_cast<size_t>(q_rows * q_out + kv_rows * kv_out));
    float* q = projected.data();
    float* kv = q + q_rows * q_out;
    const float* kv_source =
        self_attention ? query_input.data() : kv_input.data();
    const int64_t k_out = shape.kv_heads * shape.key_dim;
    const LinearProblem projections[] = {
        {q_rows, shape.embed_dim, q_out, query_input.data(), shape.embed_dim,
         weights.w_q.data(), OrNull(weights.b_q), q, q_out},
        {kv_rows, shape.kv_embed_dim, k_out, kv_source, shape.kv_embed_dim,
         weights.w_k.data(), OrNull(weights.b_k), kv, kv_out},
        {kv_rows, shape.kv_embed_dim, kv_out - k_out, kv_source,
         shape.kv_embed_dim, weights.w_v.data(), OrNull(weights.b_v),
         kv + k_out, kv_out}};
    for (const LinearProblem& projection : projections) {
      ATTNSERVE_RETURN_IF_ERROR(StopIfAsked(options));
      ATTNSERVE_RETURN_IF_ERROR(
          RunLinear(stream, projection, options.precision, options.stop));
    }
    SetProjectedViews(shape, q, q_out, kv, kv_out, &problem);
    Rotate(shape, weights, options, q, q_out, kv, kv_out);
  }

  ATTNSERVE_RETURN_IF_ERROR(StopIfAsked(options));
  std::vector<float> context(static_cast<size_t>(q_rows * context_out));
  problem.output = context.data();
  problem.output_strides = {shape.query_len * context_out, shape.value_dim,
                            context_out, 1};
  ATTNSERVE_RETURN_IF_ERROR(RunSdpa(stream, problem, flops));
  ATTNSERVE_RETURN_IF_ERROR(StopIfAsked(options));
  return RunLinear(stream,
                   {q_rows, context_out, shape.embed_dim, context.data(),
                    context_out, weights.w_o.data(), OrNull(weights.b_o),
                    outputs.output.data(), shape.embed_dim},
                   options.precision, options.stop);
}

}  // namespace attnserve::internal
