#include "internal/sdpa_problem.h"

#include <cmath>
#include <cstring>

namespace attnserve::internal {

Strides4 PackedStrides(int64_t heads, int64_t length, int64_t dim) {
  return {heads * length * dim, length * dim, dim, 1};
}

void CopyTensor4(const float* src, const Strides4& from, float* dst,
                 const Strides4& to, const std::array<int64_t, 4>& dims) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t i0 = 0; i0 < dims[0]; ++i0) {
    for (int64_t i1 = 0; i1 < dims[1]; ++i1) {
      for (int64_t i2 = 0; i2 < dims[2]; ++i2) {
        std::memcpy(dst + i0 * to[0] + i1 * to[1] + i2 * to[2],
                    src + i0 * from[0] + i1 * from[1] + i2 * from[2],
                    static_cast<size_t>(dims[3]) * sizeof(float));
      }
    }
  }
}

SdpaProblem MakeSdpaProblem(const AttentionShape& shape,
                            const AttentionOptions& options,
                            const AttentionOutputs& outputs) {
  SdpaProblem problem;
  problem.shape = shape;
  problem.options = &options;
  problem.scale = options.scale.value_or(
      1.0f / std::sqrt(static_cast<float>(shape.key_dim)));
  problem.weights = outputs.weights;
  problem.lse = outputs.lse;
  // Packed [B, heads, L, D] tensors, unless the caller sets its views'.
  problem.query_strides =
      PackedStrides(shape.heads, shape.query_len, shape.key_dim);
  problem.key_strides =
      PackedStrides(shape.kv_heads, shape.key_len, shape.key_dim);
  problem.value_strides =
      PackedStrides(shape.kv_heads, shape.key_len, shape.value_dim);
  problem.output_strides =
      PackedStrides(shape.heads, shape.query_len, shape.value_dim);
  return problem;
}

}  // namespace attnserve::internal
