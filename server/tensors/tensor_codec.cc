#include "attnserve/server/tensors/tensor_codec.h"

#include <cstring>
#include <string>

#include "attnserve/common/checked_math.h"

static_assert(
    __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
    "attnserve's wire format is little-endian; this codec reads it in place");

namespace attnserve {

DataType ToDataType(v1::DType dtype) {
  switch (dtype) {
    case v1::BFLOAT16:
      return DataType::kBFloat16;
    case v1::FLOAT16:
      return DataType::kFloat16;
    default:
      return DataType::kFloat32;
  }
}

absl::Span<const float> FloatElements(const v1::Tensor& tensor,
                                      std::vector<float>* storage) {
  const std::string& bytes = tensor.data();
  const DataType type = ToDataType(tensor.dtype());
  const size_t count = bytes.size() / static_cast<size_t>(DataTypeBytes(type));
  if (type == DataType::kFloat32 &&
      reinterpret_cast<uintptr_t>(bytes.data()) % alignof(float) == 0) {
    return absl::MakeConstSpan(reinterpret_cast<const float*>(bytes.data()),
                               count);
  }
  storage->resize(count);
  ConvertToFloat32(type, bytes.data(), static_cast<int64_t>(count),
                   storage->data());
  return *storage;
}

OutputTensor::OutputTensor(v1::DType dtype, absl::Span<const int64_t> shape,
                           v1::Tensor* tensor)
    : tensor_(tensor) {
  tensor->set_dtype(dtype);
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
  const size_t count = static_cast<size_t>(CheckedProduct(shape).value_or(0));
  std::string* bytes = tensor->mutable_data();
  bytes->resize(count * static_cast<size_t>(DataTypeBytes(ToDataType(dtype))));
  if (dtype == v1::FLOAT32) {
    values_ = absl::MakeSpan(reinterpret_cast<float*>(bytes->data()), count);
  } else {
    scratch_.resize(count);
    values_ = absl::MakeSpan(scratch_);
  }
}

void OutputTensor::Finish() {
  if (tensor_->dtype() == v1::FLOAT32) return;
  ConvertFromFloat32(scratch_.data(), static_cast<int64_t>(scratch_.size()),
                     ToDataType(tensor_->dtype()),
                     tensor_->mutable_data()->data());
}

RotaryEmbedding RotaryOf(const v1::RotaryEmbedding& rope) {
  RotaryEmbedding out;
  if (rope.theta() != 0.0f) out.theta = rope.theta();
  out.rotary_dim = rope.rotary_dim();
  out.interleaved = rope.interleaved();
  return out;
}

WeightViews::WeightViews(const v1::ProjectionWeights& w) {
  const v1::Tensor* tensors[8] = {&w.w_q(), &w.w_k(), &w.w_v(), &w.w_o(),
                                  &w.b_q(), &w.b_k(), &w.b_v(), &w.b_o()};
  const bool present[8] = {true,        true,        true,        true,
                           w.has_b_q(), w.has_b_k(), w.has_b_v(), w.has_b_o()};
  absl::Span<const float>* views[8] = {&views_.w_q, &views_.w_k, &views_.w_v,
                                       &views_.w_o, &views_.b_q, &views_.b_k,
                                       &views_.b_v, &views_.b_o};
  for (int i = 0; i < 8; ++i) {
    if (present[i]) *views[i] = FloatElements(*tensors[i], &storage_[i]);
  }
  if (w.has_rope()) views_.rope = RotaryOf(w.rope());
}

}  // namespace attnserve
