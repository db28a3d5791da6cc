#include "tensor_io.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attnserve/common/checked_math.h"
#include "attnserve/common/status_macros.h"

namespace attnserve {
namespace {

// float64 values rounded to float32; INVALID_ARGUMENT for a finite one past
// float32's range, which would become ±inf.
absl::StatusOr<std::string> Float64ToFloat32Bytes(const std::string& data,
                                                  const std::string& path) {
  const size_t count = data.size() / sizeof(double);
  std::string out(count * sizeof(float), '\0');
  for (size_t i = 0; i < count; ++i) {
    double value;
    std::memcpy(&value, data.data() + i * sizeof(double), sizeof(double));
    const float narrowed = static_cast<float>(value);
    if (std::isinf(narrowed) && std::isfinite(value)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, " holds ", value, " at flat index ", i,
          ", past float32's range (", std::numeric_limits<float>::max(),
          "); it would be sent as ", value > 0 ? "inf" : "-inf"));
    }
    std::memcpy(out.data() + i * sizeof(float), &narrowed, sizeof(float));
  }
  return out;
}

}  // namespace

absl::StatusOr<v1::Tensor> NpyToTensor(NpyArray array, const std::string& path,
                                       const TensorReadOptions& options) {
  if (array.shape.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " holds a 0-d array, expected at least one axis"));
  }
  v1::Tensor tensor;
  tensor.mutable_shape()->Assign(array.shape.begin(), array.shape.end());
  switch (array.dtype) {
    case NpyDType::kFloat32:
      tensor.set_dtype(v1::FLOAT32);
      break;
    case NpyDType::kFloat16:
      tensor.set_dtype(v1::FLOAT16);
      break;
    case NpyDType::kFloat64: {
      tensor.set_dtype(v1::FLOAT32);
      ATTNSERVE_ASSIGN_OR_RETURN(array.data,
                                 Float64ToFloat32Bytes(array.data, path));
      break;
    }
    case NpyDType::kUInt16:
      if (!options.bf16_as_uint16) {
        return absl::InvalidArgumentError(absl::StrCat(
            path,
            " holds uint16 ('<u2'); pass --bf16_as_uint16 to read it as "
            "bfloat16 bit patterns"));
      }
      tensor.set_dtype(v1::BFLOAT16);
      break;
    case NpyDType::kBool:
      if (!options.allow_bool) {
        return absl::InvalidArgumentError(absl::StrCat(
            path,
            " holds bool ('|b1'), expected float32, float16, float64 "
            "or bfloat16 as uint16; only a mask may be bool"));
      }
      tensor.set_dtype(v1::BOOL);
      break;
    case NpyDType::kInt64:
      return absl::InvalidArgumentError(absl::StrCat(
          path,
          " holds int64 ('<i8'), expected float32, float16, float64, "
          "bfloat16 as uint16, or bool for a mask"));
  }
  tensor.set_data(std::move(array.data));
  return tensor;
}

absl::StatusOr<NpyArray> TensorToNpy(const v1::Tensor& tensor) {
  NpyArray array;
  switch (tensor.dtype()) {
    case v1::FLOAT32:
      array.dtype = NpyDType::kFloat32;
      break;
    case v1::FLOAT16:
      array.dtype = NpyDType::kFloat16;
      break;
    case v1::BFLOAT16:
      array.dtype = NpyDType::kUInt16;
      break;
    case v1::BOOL:
      array.dtype = NpyDType::kBool;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("tensor dtype is ", v1::DType_Name(tensor.dtype()),
                       ", expected FLOAT32, BFLOAT16, FLOAT16 or BOOL"));
  }
  array.shape.assign(tensor.shape().begin(), tensor.shape().end());
  for (int64_t dim : array.shape) {
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor shape [", absl::StrJoin(array.shape, ", "),
                       "] has a negative dimension"));
    }
  }
  const std::optional<int64_t> count = CheckedProduct(array.shape);
  const std::optional<int64_t> bytes =
      count ? CheckedMultiply(*count, NpyElementBytes(array.dtype))
            : std::nullopt;
  if (!bytes || static_cast<uint64_t>(*bytes) != tensor.data().size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor data has ", tensor.data().size(), " bytes, expected shape [",
        absl::StrJoin(array.shape, ", "), "] x ", NpyElementBytes(array.dtype),
        " bytes of ", v1::DType_Name(tensor.dtype())));
  }
  array.data = tensor.data();
  return array;
}

absl::StatusOr<v1::Tensor> ReadTensorFile(const std::string& path,
                                          const TensorReadOptions& options) {
  ATTNSERVE_ASSIGN_OR_RETURN(NpyArray array,
                             ReadNpyFile(path, options.max_file_bytes));
  return NpyToTensor(std::move(array), path, options);
}

absl::Status WriteTensorFile(const std::string& path,
                             const v1::Tensor& tensor) {
  ATTNSERVE_ASSIGN_OR_RETURN(NpyArray array, TensorToNpy(tensor));
  return WriteNpyFile(path, array);
}

}  // namespace attnserve
