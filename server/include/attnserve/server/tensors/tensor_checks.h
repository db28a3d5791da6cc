// Field-level checks of one proto Tensor, shared by every request validator.
// Each error names the field, says what was expected and what arrived.
#ifndef ATTNSERVE_SERVER_TENSORS_TENSOR_CHECKS_H_
#define ATTNSERVE_SERVER_TENSORS_TENSOR_CHECKS_H_

#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// The float dtypes a tensor of values may have.
inline constexpr v1::DType kFloatDTypes[] = {v1::FLOAT32, v1::BFLOAT16,
                                             v1::FLOAT16};

// "FLOAT32", or "42 (not a DType)".
std::string DTypeName(int dtype);

// "[2, 4, 5]".
std::string ShapeString(const v1::Tensor& tensor);

// `field`.shape[`dim`] followed by the dimension's name, e.g. "key.shape[3]
// (Dk)".
std::string DimField(absl::string_view field, int dim,
                     absl::string_view dim_name);

// Checks that `tensor` (the field `field`, said to be missing when !present)
// has one of `dtypes`, `dim_names.size()` dimensions, each positive, a product
// within int64, and exactly the bytes its shape and dtype need. `dim_names`
// also name the layout in messages.
absl::Status CheckTensor(absl::string_view field, bool present,
                         const v1::Tensor& tensor,
                         absl::Span<const v1::DType> dtypes,
                         std::initializer_list<const char*> dim_names);

// As CheckTensor, for a tensor whose rank is any of [min_rank, max_rank].
absl::Status CheckTensorOfRank(absl::string_view field,
                               const v1::Tensor& tensor,
                               absl::Span<const v1::DType> dtypes, int min_rank,
                               int max_rank);

// RESOURCE_EXHAUSTED if `tensor` (the field `field`) has more elements than
// `max_elements` (the server's --max_elements); a shape whose product
// overflows counts as over it.
absl::Status CheckElementLimit(absl::string_view field,
                               const v1::Tensor& tensor, int64_t max_elements);

// INVALID_ARGUMENT "`field` is `actual`, expected `expected` (`why`)" when they
// differ.
absl::Status CheckDimEquals(absl::string_view field, int64_t actual,
                            int64_t expected, absl::string_view why);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TENSORS_TENSOR_CHECKS_H_
