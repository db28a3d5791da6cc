// attnserve.v1.Tensor to and from C++ values, for callers of the client
// library: tensors of any float dtype and BOOL masks, and their elements read
// back as float. MakeFloat32Tensor comes from attnserve/proto/tensors.h,
// included here.
//
// clang-format off
//   attnserve::v1::Tensor key = attnserve::MakeTensor(attnserve::v1::BFLOAT16, {1, 8, 128, 64}, values);
//   ATTNSERVE_ASSIGN_OR_RETURN(std::vector<float> widened, attnserve::FloatValues(key));
// clang-format on
#ifndef ATTNSERVE_CLIENT_TENSORS_H_
#define ATTNSERVE_CLIENT_TENSORS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attnserve/proto/tensors.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// A tensor of `dtype` (FLOAT32, BFLOAT16 or FLOAT16) and `shape` holding
// `values` rounded to the dtype (to nearest, ties to even).
v1::Tensor MakeTensor(v1::DType dtype, absl::Span<const int64_t> shape,
                      absl::Span<const float> values);

// A BOOL tensor of `shape` holding `values` (one byte each).
v1::Tensor MakeBoolTensor(absl::Span<const int64_t> shape,
                          const std::vector<bool>& values);

// The elements of a FLOAT32 tensor. INVALID_ARGUMENT if the dtype is not
// FLOAT32 or the byte count does not match the shape.
absl::StatusOr<std::vector<float>> Float32Values(const v1::Tensor& tensor);

// The elements of a FLOAT32, BFLOAT16 or FLOAT16 tensor, widened to float.
// INVALID_ARGUMENT for another dtype or a byte count that does not match the
// shape.
absl::StatusOr<std::vector<float>> FloatValues(const v1::Tensor& tensor);

// Reads a float tensor into `out` (widening BFLOAT16/FLOAT16), checking that
// its shape is `expected_shape` and `out` holds exactly its elements: no
// allocation. INVALID_ARGUMENT naming what differs.
absl::Status ReadFloatsInto(const v1::Tensor& tensor,
                            absl::Span<const int64_t> expected_shape,
                            absl::Span<float> out);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_TENSORS_H_
