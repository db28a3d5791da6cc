// Small helpers over attnserve.v1.Tensor shared by the client library, the
// server and the tools, so that each dtype's width and the FLOAT32 encoding
// are written once.
#ifndef ATTNSERVE_PROTO_TENSORS_H_
#define ATTNSERVE_PROTO_TENSORS_H_

#include <cstdint>

#include "absl/types/span.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// Bytes per element of `dtype`: 4 for FLOAT32, 2 for BFLOAT16 and FLOAT16, 1
// for BOOL (and for DTYPE_UNSPECIFIED, which validation refuses by name).
int64_t DTypeBytes(v1::DType dtype);

// A FLOAT32 tensor of `shape` holding `values` (row-major), copied once into
// the message. The caller keeps the element count consistent with the shape;
// the server rejects a mismatch by name.
v1::Tensor MakeFloat32Tensor(absl::Span<const int64_t> shape,
                             absl::Span<const float> values);

}  // namespace attnserve

#endif  // ATTNSERVE_PROTO_TENSORS_H_
