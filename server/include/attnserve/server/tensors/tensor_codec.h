// Where protobuf tensors and core's f32 views of them meet: conversions
// between the wire's dtypes and f32, output tensors, weight views.
#ifndef ATTNSERVE_SERVER_TENSORS_TENSOR_CODEC_H_
#define ATTNSERVE_SERVER_TENSORS_TENSOR_CODEC_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/types/span.h"
#include "attnserve/common/dtype.h"
#include "attnserve/core/attention_types.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// The DataType of a float proto dtype; the caller has checked it is FLOAT32,
// BFLOAT16 or FLOAT16.
DataType ToDataType(v1::DType dtype);

// Returns the elements of a validated float tensor as f32. For FLOAT32 whose
// bytes are aligned for float (protobuf's heap strings are) the span aliases
// tensor.data(): no copy, valid while the tensor is unchanged. Otherwise the
// values are converted into `*storage`, which must outlive the span.
absl::Span<const float> FloatElements(const v1::Tensor& tensor,
                                      std::vector<float>* storage);

// An f32 result headed for a response tensor of `dtype`: for FLOAT32 the engine
// writes straight into the tensor's bytes; otherwise into a scratch vector that
// Finish() converts.
class OutputTensor {
 public:
  // Sets `*tensor` to `dtype` and `shape`, sized; the caller has checked the
  // size against the server's limits. `tensor` must outlive this object.
  OutputTensor(v1::DType dtype, absl::Span<const int64_t> shape,
               v1::Tensor* tensor);

  absl::Span<float> values() { return values_; }

  // Writes the values into the tensor in its dtype (nothing to do for FLOAT32).
  void Finish();

 private:
  v1::Tensor* tensor_;
  std::vector<float> scratch_;
  absl::Span<float> values_;
};

// The core's RoPE of `rope` (theta 0 meaning 10000).
RotaryEmbedding RotaryOf(const v1::RotaryEmbedding& rope);

// Projection weights as engine views: FLOAT32 tensors aliased, others converted
// into storage.
class WeightViews {
 public:
  explicit WeightViews(const v1::ProjectionWeights& weights);
  const ProjectionWeights& views() const { return views_; }

 private:
  std::vector<float> storage_[8];
  ProjectionWeights views_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TENSORS_TENSOR_CODEC_H_
