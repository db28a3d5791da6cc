#include "attnserve/server/tensors/tensor_checks.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attnserve/common/checked_math.h"
#include "attnserve/common/dtype.h"
#include "attnserve/common/echo.h"
#include "attnserve/common/refusals.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/proto/tensors.h"

namespace attnserve {
namespace {

absl::Status CheckDType(absl::string_view field, const v1::Tensor& tensor,
                        absl::Span<const v1::DType> dtypes) {
  for (v1::DType dtype : dtypes) {
    if (tensor.dtype() == dtype) return absl::OkStatus();
  }
  std::vector<std::string> names;
  for (v1::DType dtype : dtypes) names.push_back(v1::DType_Name(dtype));
  return absl::InvalidArgumentError(
      absl::StrCat(field, ".dtype is ", DTypeName(tensor.dtype()),
                   ", expected ", absl::StrJoin(names, " or ")));
}

// Dimensions positive, product within int64, byte count exact. Rank already
// checked.
absl::Status CheckDimsAndBytes(absl::string_view field,
                               const v1::Tensor& tensor,
                               absl::Span<const char* const> dim_names) {
  for (int dim = 0; dim < tensor.shape_size(); ++dim) {
    if (tensor.shape(dim) <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          dim_names.empty() ? absl::StrCat(field, ".shape[", dim, "]")
                            : DimField(field, dim, dim_names[dim]),
          " is ", tensor.shape(dim), ", expected > 0"));
    }
  }
  const int64_t element_bytes = DTypeBytes(tensor.dtype());
  const std::optional<int64_t> elements = CheckedProduct(
      absl::MakeConstSpan(tensor.shape().data(), tensor.shape_size()));
  const std::optional<int64_t> bytes =
      elements ? CheckedMultiply(*elements, element_bytes) : std::nullopt;
  if (!bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shape is ", ShapeString(tensor), ": its ",
        v1::DType_Name(tensor.dtype()),
        " data would pass 2^63 bytes; expected far fewer elements"));
  }
  if (static_cast<int64_t>(tensor.data().size()) != *bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".data has ", tensor.data().size(), " bytes, expected ", *bytes,
        " (", *elements, " elements of shape ", ShapeString(tensor), " x ",
        element_bytes, " bytes of ", v1::DType_Name(tensor.dtype()), ")"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string DTypeName(int dtype) {
  if (v1::DType_IsValid(dtype))
    return v1::DType_Name(static_cast<v1::DType>(dtype));
  return absl::StrCat(dtype, " (not a DType)");
}

std::string ShapeString(const v1::Tensor& tensor) {
  return EchoDims(
      absl::MakeConstSpan(tensor.shape().data(), tensor.shape_size()));
}

std::string DimField(absl::string_view field, int dim,
                     absl::string_view dim_name) {
  return absl::StrCat(field, ".shape[", dim, "] (", dim_name, ")");
}

absl::Status CheckTensor(absl::string_view field, bool present,
                         const v1::Tensor& tensor,
                         absl::Span<const v1::DType> dtypes,
                         std::initializer_list<const char*> dim_names) {
  const std::string layout =
      absl::StrCat("[", absl::StrJoin(dim_names, ", "), "]");
  if (!present) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " is missing, expected a tensor of shape ", layout));
  }
  ATTNSERVE_RETURN_IF_ERROR(CheckDType(field, tensor, dtypes));
  if (tensor.shape_size() != static_cast<int>(dim_names.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shape is ", ShapeString(tensor), " with ", tensor.shape_size(),
        " dimensions, expected ", dim_names.size(), ": ", layout));
  }
  return CheckDimsAndBytes(
      field, tensor, absl::MakeConstSpan(dim_names.begin(), dim_names.size()));
}

absl::Status CheckTensorOfRank(absl::string_view field,
                               const v1::Tensor& tensor,
                               absl::Span<const v1::DType> dtypes, int min_rank,
                               int max_rank) {
  ATTNSERVE_RETURN_IF_ERROR(CheckDType(field, tensor, dtypes));
  if (tensor.shape_size() < min_rank || tensor.shape_size() > max_rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shape is ", ShapeString(tensor), " with ", tensor.shape_size(),
        " dimensions, expected ",
        min_rank == max_rank ? absl::StrCat(min_rank)
                             : absl::StrCat(min_rank, " to ", max_rank)));
  }
  return CheckDimsAndBytes(field, tensor, {});
}

absl::Status CheckDimEquals(absl::string_view field, int64_t actual,
                            int64_t expected, absl::string_view why) {
  if (actual == expected) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, " is ", actual, ", expected ", expected, " (", why, ")"));
}

absl::Status CheckElementLimit(absl::string_view field,
                               const v1::Tensor& tensor, int64_t max_elements) {
  const std::optional<int64_t> elements = CheckedProduct(
      absl::MakeConstSpan(tensor.shape().data(), tensor.shape_size()));
  if (elements && *elements <= max_elements) return absl::OkStatus();
  return Permanent(absl::ResourceExhaustedError(absl::StrCat(
      field, " has ",
      elements ? absl::StrCat(*elements) : std::string("over 2^63"),
      " elements, over the max_elements limit of ", max_elements)));
}

}  // namespace attnserve
