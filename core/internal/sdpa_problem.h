// One SDPA call as both of the engine's kernels take it: the fused tiled kernel
// (internal/fused_attention.h), which computes most calls, and the unfused slab
// path (internal/unfused_attention.h), which computes calls that ask for the
// attention weights or an engine made with AttentionKernel::kUnfused. The
// engine validates a call, describes it here once, and hands it to either.
#ifndef ATTNSERVE_CORE_INTERNAL_SDPA_PROBLEM_H_
#define ATTNSERVE_CORE_INTERNAL_SDPA_PROBLEM_H_

#include <array>
#include <cstddef>
#include <cstdint>

#include "absl/types/span.h"
#include "attnserve/common/dtype.h"
#include "attnserve/core/attention_types.h"

namespace attnserve::internal {

// Element strides of a 4-D tensor indexed [batch, head, position, feature].
using Strides4 = std::array<int64_t, 4>;

// Strides of a packed row-major [batch, heads, length, dim] tensor.
Strides4 PackedStrides(int64_t heads, int64_t length, int64_t dim);

// Copies the [d0, d1, d2, d3] tensor at `src` with element strides `from` to
// `dst` with strides `to` (both with unit stride along d3), on the calling
// thread's OpenMP team.
void CopyTensor4(const float* src, const Strides4& from, float* dst,
                 const Strides4& to, const std::array<int64_t, 4>& dims);

// Where one batch entry's tensors start, for a call whose batch entries lie
// apart (a dynamically batched call reads each request in place). `lse` is null
// when lse is not asked for.
struct BatchTensors {
  const float* query = nullptr;
  const float* key = nullptr;
  const float* value = nullptr;
  float* output = nullptr;
  float* lse = nullptr;
};

// One SDPA call, with its tensors anywhere in memory: MHA passes views into its
// projection buffers ([B, L, heads·D] read as [B, heads, L, D]) so that no
// transpose is ever copied.
// What the fused kernel cuts a call's tiles and key splits for (see
// fused::MakeGeometry): by default (threads 0) the call's own batch on the
// threads it runs on. AttendBatch gives the B and threads each of its
// requests would have alone, so that each request's answer has the same bits
// as alone.
struct Tiling {
  int64_t batch = 0;
  int threads = 0;
};

struct SdpaProblem {
  AttentionShape shape;
  const AttentionOptions* options = nullptr;
  float scale = 1.0f;
  const float* query = nullptr;
  Strides4 query_strides{};
  const float* key = nullptr;
  Strides4 key_strides{};
  const float* value = nullptr;
  Strides4 value_strides{};
  float* output = nullptr;
  Strides4 output_strides{};
  absl::Span<float> weights;
  absl::Span<float> lse;
  // If not empty, batch entry b's tensors start at batches[b] (strides[0] and
  // the pointers above unused, lse among them; weights not allowed). The fused
  // kernel only.
  absl::Span<const BatchTensors> batches;
  // BFLOAT16 or FLOAT16: the query, key and value are the 16-bit elements at
  // half_query, half_key and half_value (with the strides above, and the
  // float pointers unused), read where they lie. The fused kernel only,
  // without batches.
  DataType input_dtype = DataType::kFloat32;
  const uint16_t* half_query = nullptr;
  const uint16_t* half_key = nullptr;
  const uint16_t* half_value = nullptr;
  Tiling tiling;
};

// The problem of `shape` and `options` (which must outlive it) writing the
// weights and lse of `outputs`, with the scale the options give (1 / sqrt(Dk)
// if none) and packed [B, heads, L, D] strides for every tensor. The caller
// sets the tensor pointers, and strides of its own for strided views.
SdpaProblem MakeSdpaProblem(const AttentionShape& shape,
                            const AttentionOptions& options,
                            const AttentionOutputs& outputs);

// The first element of batch entry `b` of each tensor of `p`.
inline const float* QueryOf(const SdpaProblem& p, int64_t b) {
  return p.batches.empty() ? p.query + b * p.query_strides[0]
                           : p.batches[static_cast<size_t>(b)].query;
}
inline const float* KeyOf(const SdpaProblem& p, int64_t b) {
  return p.batches.empty() ? p.key + b * p.key_strides[0]
                           : p.batches[static_cast<size_t>(b)].key;
}
inline const float* ValueOf(const SdpaProblem& p, int64_t b) {
  return p.batches.empty() ? p.value + b * p.value_strides[0]
                           : p.batches[static_cast<size_t>(b)].value;
}
inline float* OutputOf(const SdpaProblem& p, int64_t b) {
  return p.batches.empty() ? p.output + b * p.output_strides[0]
                           : p.batches[static_cast<size_t>(b)].output;
}
// Where row (b, h, i)'s lse goes, or null if lse is not asked for.
inline float* LseOf(const SdpaProblem& p, int64_t b, int64_t h, int64_t i) {
  const AttentionShape& s = p.shape;
  if (p.batches.empty()) {
    return p.lse.empty() ? nullptr
                         : p.lse.data() + (b * s.heads + h) * s.query_len + i;
  }
  float* lse = p.batches[static_cast<size_t>(b)].lse;
  return lse == nullptr ? nullptr : lse + h * s.query_len + i;
}

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_SDPA_PROBLEM_H_
