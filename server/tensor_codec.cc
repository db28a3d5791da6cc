#include "tensor_codec.h"

#include <cstring>
#include <string>

#include "attnserve/core/checked_math.h"

static_assert(
    __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
    "attnserve's wire format is little-endian; this codec reads it in place");

namespace attnserve {

absl::Span<const float> Float32Elements(const v1::Tensor& tensor,
                                        std::vector<float>* storage) {
  const std::string& bytes = tensor.data();
  const size_t count = bytes.size() / sizeof(float);
  if (reinterpret_cast<uintptr_t>(bytes.data()) % alignof(float) == 0) {
    return absl::MakeConstSpan(reinterpret_cast<const float*>(bytes.data()),
                               count);
  }
  storage->resize(count);
  std::memcpy(storage->data(), bytes.data(), count * sizeof(float));
  return *storage;
}

absl::Span<float> ResizeFloat32(absl::Span<const int64_t> shape,
                                v1::Tensor* tensor) {
  tensor->set_dtype(v1::FLOAT32);
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
  const int64_t count = CheckedProduct(shape).value_or(0);
  std::string* bytes = tensor->mutable_data();
  bytes->resize(static_cast<size_t>(count) * sizeof(float));
  return absl::MakeSpan(reinterpret_cast<float*>(bytes->data()),
                        static_cast<size_t>(count));
}

}  // namespace attnserve
