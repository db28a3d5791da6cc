#include "attnserve/proto/tensors.h"

namespace attnserve {

int64_t DTypeBytes(v1::DType dtype) {
  switch (dtype) {
    case v1::FLOAT32:
      return 4;
    case v1::BFLOAT16:
    case v1::FLOAT16:
      return 2;
    default:
      return 1;
  }
}

v1::Tensor MakeFloat32Tensor(absl::Span<const int64_t> shape,
                             absl::Span<const float> values) {
  v1::Tensor tensor;
  tensor.set_dtype(v1::FLOAT32);
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  tensor.set_data(reinterpret_cast<const char*>(values.data()),
                  values.size() * sizeof(float));
  return tensor;
}

}  // namespace attnserve
