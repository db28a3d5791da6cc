// The one place where protobuf tensors and core's f32 views of them meet.
#ifndef ATTNSERVE_SERVER_TENSORS_TENSOR_CODEC_H_
#define ATTNSERVE_SERVER_TENSORS_TENSOR_CODEC_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/types/span.h"
#include "attnserve/common/dtype.h"
#include "attnserve/core/attention_engine.h"
#include "attnserve/server/attention/request_validator.h"
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

// Returns the options of `plan` with the mask and key lengths pointed at the
// request's `proto` (a BOOL mask and the key lengths without a copy; a float
// mask through `mask_storage`).
AttentionOptions BindOptions(const OptionsPlan& plan,
                             const v1::AttentionOptions& proto,
                             std::vector<float>* mask_storage);

// The response tensors of an attention call: output, and weights and lse as
// `plan` asks.
class AttentionResponseTensors {
 public:
  // `heads` is the SDPA shape (for the weights and lse), `output_shape` the
  // output's. The tensors must outlive this object; `weights` and `lse` may be
  // null when not asked for.
  AttentionResponseTensors(const OptionsPlan& plan, const AttentionShape& heads,
                           absl::Span<const int64_t> output_shape,
                           v1::Tensor* output, v1::Tensor* weights,
                           v1::Tensor* lse);

  AttentionOutputs outputs();
  void Finish();

 private:
  OutputTensor output_;
  std::optional<OutputTensor> weights_;
  std::optional<OutputTensor> lse_;
};

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
