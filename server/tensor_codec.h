// The one place where protobuf tensors and core's views of them meet.
#ifndef ATTNSERVE_SERVER_TENSOR_CODEC_H_
#define ATTNSERVE_SERVER_TENSOR_CODEC_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// Returns the elements of a validated FLOAT32 `tensor`. The span aliases
// tensor.data() (no copy) when its bytes are aligned for float, which
// protobuf's heap strings are; otherwise the values are copied into `*storage`,
// which must outlive the span. The span is valid while `tensor` is unchanged.
absl::Span<const float> Float32Elements(const v1::Tensor& tensor,
                                        std::vector<float>* storage);

// Makes `*tensor` a FLOAT32 tensor of `shape` with uninitialised contents and
// returns a span over its data for the caller to fill. `shape` must have a
// product that fits in memory: the caller checks its size against the server's
// limits first.
absl::Span<float> ResizeFloat32(absl::Span<const int64_t> shape,
                                v1::Tensor* tensor);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TENSOR_CODEC_H_
