// Tensors to and from NumPy .npy files.
//
// Reading keeps a file's element type where the wire has it: '<f4' is
// FLOAT32, '<f2' FLOAT16, '|b1' BOOL (where a mask may be BOOL), '<u2'
// BFLOAT16 bit patterns (only when asked to, since NumPy has no bfloat16),
// and '<f8' is rounded to FLOAT32. Writing uses the tensor's own dtype:
// FLOAT32 '<f4', FLOAT16 '<f2', BFLOAT16 '<u2' bit patterns, BOOL '|b1'.
//
//   TensorReadOptions options{.bf16_as_uint16 = true};
//   absl::StatusOr<v1::Tensor> query = ReadTensorFile("q.npy", options);
//   ...
//   absl::Status written = WriteTensorFile("o.npy", response.output());
//
// The functions here are thread-safe.
#ifndef ATTNSERVE_CLIENT_ATTNCTL_TENSOR_IO_H_
#define ATTNSERVE_CLIENT_ATTNCTL_TENSOR_IO_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/common/npy.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

struct TensorReadOptions {
  // Read '<u2' arrays as BFLOAT16 bit patterns; refused otherwise.
  bool bf16_as_uint16 = false;
  // Accept '|b1' arrays as BOOL tensors (attention masks).
  bool allow_bool = false;
  // Files larger than this are refused before anything is read.
  int64_t max_file_bytes = int64_t{1} << 30;
};

// The tensor held by `array`, read from `path` (named in errors).
// INVALID_ARGUMENT for an element type `options` does not allow ('<i8', '<u2'
// without bf16_as_uint16, '|b1' without allow_bool) and for a 0-d array.
absl::StatusOr<v1::Tensor> NpyToTensor(NpyArray array, const std::string& path,
                                       const TensorReadOptions& options);

// The array holding `tensor` in its own dtype. INVALID_ARGUMENT for an
// unspecified dtype or data that does not match the shape.
absl::StatusOr<NpyArray> TensorToNpy(const v1::Tensor& tensor);

// Reads the .npy file at `path` as a tensor; ReadNpyFile's errors, then
// NpyToTensor's.
absl::StatusOr<v1::Tensor> ReadTensorFile(const std::string& path,
                                          const TensorReadOptions& options);

// Writes `tensor` to `path` as a .npy file, replacing it.
absl::Status WriteTensorFile(const std::string& path, const v1::Tensor& tensor);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTNCTL_TENSOR_IO_H_
