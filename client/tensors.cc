#include "attnserve/client/tensors.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attnserve/common/dtype.h"

namespace attnserve {

v1::Tensor MakeTensor(v1::DType dtype, absl::Span<const int64_t> shape,
                      absl::Span<const float> values) {
  if (dtype == v1::FLOAT32) return MakeFloat32Tensor(shape, values);
  v1::Tensor tensor;
  tensor.set_dtype(dtype);
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  std::string* data = tensor.mutable_data();
  data->resize(values.size() * 2);
  ConvertFromFloat32(
      values.data(), static_cast<int64_t>(values.size()),
      dtype == v1::BFLOAT16 ? DataType::kBFloat16 : DataType::kFloat16,
      data->data());
  return tensor;
}

v1::Tensor MakeBoolTensor(absl::Span<const int64_t> shape,
                          const std::vector<bool>& values) {
  v1::Tensor tensor;
  tensor.set_dtype(v1::BOOL);
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  std::string* data = tensor.mutable_data();
  for (bool value : values) data->push_back(value ? 1 : 0);
  return tensor;
}

absl::StatusOr<std::vector<float>> Float32Values(const v1::Tensor& tensor) {
  if (tensor.dtype() != v1::FLOAT32) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor.dtype is ", tensor.dtype(), ", expected FLOAT32"));
  }
  return FloatValues(tensor);
}

absl::StatusOr<std::vector<float>> FloatValues(const v1::Tensor& tensor) {
  if (tensor.dtype() != v1::FLOAT32 && tensor.dtype() != v1::BFLOAT16 &&
      tensor.dtype() != v1::FLOAT16) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor.dtype is ", tensor.dtype(),
                     ", expected FLOAT32, BFLOAT16 or FLOAT16"));
  }
  const uint64_t element_bytes = tensor.dtype() == v1::FLOAT32 ? 4 : 2;
  uint64_t elements = 1;
  // The product of the dimensions other than 0 must fit too, whatever their
  // order: [0, 2^62, 2^62] is no shape a file or an array can hold.
  uint64_t spanned = 1;
  for (int64_t dim : tensor.shape()) {
    const uint64_t size = static_cast<uint64_t>(dim);
    if (dim < 0 || __builtin_mul_overflow(elements, size, &elements) ||
        __builtin_mul_overflow(spanned, std::max<uint64_t>(size, 1),
                               &spanned) ||
        spanned > (uint64_t{1} << 62)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor.shape has dimension ", dim,
                       ", expected a small non-negative size"));
    }
  }
  if (tensor.data().size() / element_bytes != elements ||
      tensor.data().size() % element_bytes != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor.data has ", tensor.data().size(),
                     " bytes, expected ", elements, " x ", element_bytes));
  }
  const DataType type = tensor.dtype() == v1::FLOAT32    ? DataType::kFloat32
                        : tensor.dtype() == v1::BFLOAT16 ? DataType::kBFloat16
                                                         : DataType::kFloat16;
  std::vector<float> values(elements);
  ConvertToFloat32(type, tensor.data().data(), static_cast<int64_t>(elements),
                   values.data());
  return values;
}

absl::Status ReadFloatsInto(const v1::Tensor& tensor,
                            absl::Span<const int64_t> expected_shape,
                            absl::Span<float> out) {
  if (!std::equal(tensor.shape().begin(), tensor.shape().end(),
                  expected_shape.begin(), expected_shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor.shape is [", absl::StrJoin(tensor.shape(), ", "),
        "], expected [", absl::StrJoin(expected_shape, ", "), "]"));
  }
  const int64_t element_bytes = tensor.dtype() == v1::FLOAT32 ? 4 : 2;
  if (tensor.dtype() != v1::FLOAT32 && tensor.dtype() != v1::BFLOAT16 &&
      tensor.dtype() != v1::FLOAT16) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor.dtype is ", tensor.dtype(),
                     ", expected FLOAT32, BFLOAT16 or FLOAT16"));
  }
  if (tensor.data().size() != out.size() * static_cast<size_t>(element_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor.data has ", tensor.data().size(),
                     " bytes, the output span holds ", out.size(),
                     " elements of ", element_bytes, " bytes"));
  }
  ConvertToFloat32(tensor.dtype() == v1::FLOAT32    ? DataType::kFloat32
                   : tensor.dtype() == v1::BFLOAT16 ? DataType::kBFloat16
                                                    : DataType::kFloat16,
                   tensor.data().data(), static_cast<int64_t>(out.size()),
                   out.data());
  return absl::OkStatus();
}

}  // namespace attnserve
