#include "request_validator.h"

#include <array>
#include <cmath>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attnserve/core/checked_math.h"
#include "attnserve/core/status_macros.h"

namespace attnserve {
namespace {

// The dtypes Attend computes in. BFLOAT16 and FLOAT16 are part of the wire
// format already and are refused by name until the engine computes in them.
constexpr v1::DType kComputeDType = v1::FLOAT32;

// How a rank-4 SDPA tensor of an AttendRequest must look, and where it is.
struct TensorSpec {
  const char* field;
  std::array<const char*, 4> dim_names;
  bool (v1::AttendRequest::*has)() const;
  const v1::Tensor& (v1::AttendRequest::*get)() const;
};

constexpr TensorSpec kQuerySpec = {"query",
                                   {"B", "H", "Lq", "Dk"},
                                   &v1::AttendRequest::has_query,
                                   &v1::AttendRequest::query};
constexpr TensorSpec kKeySpec = {"key",
                                 {"B", "Hkv", "Lk", "Dk"},
                                 &v1::AttendRequest::has_key,
                                 &v1::AttendRequest::key};
constexpr TensorSpec kValueSpec = {"value",
                                   {"B", "Hkv", "Lk", "Dv"},
                                   &v1::AttendRequest::has_value,
                                   &v1::AttendRequest::value};

// A dimension that must equal a dimension of an earlier tensor.
struct DimensionMatch {
  const TensorSpec* tensor;
  int dim;
  const TensorSpec* reference;
  int reference_dim;
};

constexpr DimensionMatch kAttendDimensionMatches[] = {
    {&kKeySpec, 0, &kQuerySpec, 0},  // B
    {&kKeySpec, 3, &kQuerySpec, 3},  // Dk
    {&kValueSpec, 0, &kKeySpec, 0},  // B
    {&kValueSpec, 1, &kKeySpec, 1},  // Hkv
    {&kValueSpec, 2, &kKeySpec, 2},  // Lk
};

std::string DTypeName(int dtype) {
  if (v1::DType_IsValid(dtype))
    return v1::DType_Name(static_cast<v1::DType>(dtype));
  return absl::StrCat(dtype, " (not a DType)");
}

std::string ShapeString(const v1::Tensor& tensor) {
  return absl::StrCat("[", absl::StrJoin(tensor.shape(), ", "), "]");
}

std::string DimField(const TensorSpec& spec, int dim) {
  return absl::StrCat(spec.field, ".shape[", dim, "] (", spec.dim_names[dim],
                      ")");
}

absl::Status ValidateTensor(const v1::AttendRequest& request,
                            const TensorSpec& spec) {
  const std::string layout =
      absl::StrCat("[", absl::StrJoin(spec.dim_names, ", "), "]");
  const v1::Tensor& tensor = (request.*spec.get)();
  if (!(request.*spec.has)()) {
    return absl::InvalidArgumentError(absl::StrCat(
        spec.field, " is missing, expected a ", v1::DType_Name(kComputeDType),
        " tensor of shape ", layout));
  }
  if (tensor.dtype() != kComputeDType) {
    return absl::InvalidArgumentError(
        absl::StrCat(spec.field, ".dtype is ", DTypeName(tensor.dtype()),
                     ", expected ", v1::DType_Name(kComputeDType)));
  }
  if (tensor.shape_size() != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat(spec.field, ".shape is ", ShapeString(tensor), " with ",
                     tensor.shape_size(), " dimensions, expected 4: ", layout));
  }
  for (int dim = 0; dim < 4; ++dim) {
    if (tensor.shape(dim) <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          DimField(spec, dim), " is ", tensor.shape(dim), ", expected > 0"));
    }
  }
  const std::optional<int64_t> elements = CheckedProduct(
      absl::MakeConstSpan(tensor.shape().data(), tensor.shape_size()));
  const std::optional<int64_t> bytes =
      elements ? CheckedMultiply(*elements, sizeof(float)) : std::nullopt;
  if (!bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(spec.field, ".shape is ", ShapeString(tensor),
                     ", expected a product below 2^61 elements"));
  }
  if (static_cast<int64_t>(tensor.data().size()) != *bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        spec.field, ".data has ", tensor.data().size(), " bytes, expected ",
        *bytes, " (", *elements, " elements of shape ", ShapeString(tensor),
        " x ", sizeof(float), " bytes)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateDimensionMatches(const v1::AttendRequest& request) {
  for (const DimensionMatch& match : kAttendDimensionMatches) {
    const int64_t actual = (request.*match.tensor->get)().shape(match.dim);
    const int64_t expected =
        (request.*match.reference->get)().shape(match.reference_dim);
    if (actual != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat(DimField(*match.tensor, match.dim), " is ", actual,
                       ", expected ", expected, " (",
                       DimField(*match.reference, match.reference_dim), ")"));
    }
  }
  const int64_t heads = request.query().shape(1);
  const int64_t kv_heads = request.key().shape(1);
  if (heads % kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        DimField(kQuerySpec, 1), " is ", heads, ", expected a multiple of ",
        kv_heads, " (", DimField(kKeySpec, 1),
        "): each kv head serves H / Hkv query heads"));
  }
  return absl::OkStatus();
}

absl::StatusOr<AttentionOptions> ValidateOptions(
    const v1::AttentionOptions& proto) {
  AttentionOptions options;
  if (proto.has_scale()) {
    if (!std::isfinite(proto.scale())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "options.scale is ", proto.scale(), ", expected a finite number"));
    }
    options.scale = proto.scale();
  }
  return options;
}

}  // namespace

absl::StatusOr<AttendWork> ValidateAttendRequest(
    const v1::AttendRequest& request, const RequestLimits& limits) {
  for (const TensorSpec* spec : {&kQuerySpec, &kKeySpec, &kValueSpec}) {
    ATTNSERVE_RETURN_IF_ERROR(ValidateTensor(request, *spec));
  }
  ATTNSERVE_RETURN_IF_ERROR(ValidateDimensionMatches(request));

  AttendWork work;
  ATTNSERVE_ASSIGN_OR_RETURN(work.options, ValidateOptions(request.options()));
  const v1::Tensor& query = request.query();
  const v1::Tensor& value = request.value();
  work.shape.batch = query.shape(0);
  work.shape.heads = query.shape(1);
  work.shape.kv_heads = request.key().shape(1);
  work.shape.query_len = query.shape(2);
  work.shape.key_len = request.key().shape(2);
  work.shape.key_dim = query.shape(3);
  work.shape.value_dim = value.shape(3);

  const std::optional<int64_t> output_bytes =
      CheckedProduct({work.shape.batch, work.shape.heads, work.shape.query_len,
                      work.shape.value_dim, int64_t{sizeof(float)}});
  if (!output_bytes || *output_bytes > limits.max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "output [B, H, Lq, Dv] = [", work.shape.batch, ", ", work.shape.heads,
        ", ", work.shape.query_len, ", ", work.shape.value_dim, "] would need ",
        output_bytes ? absl::StrCat(*output_bytes, " bytes")
                     : std::string("over 2^63 bytes"),
        ", over the server's max_message_bytes limit of ",
        limits.max_message_bytes));
  }
  return work;
}

}  // namespace attnserve
