// A strict reader for NumPy .npy files of the few dtypes attnserve uses.
//
// Accepts format versions 1.0, 2.0 and 3.0, little-endian data in C order,
// and nothing else: any file it cannot read exactly is refused with a message
// that says what was expected and what was found.
//
//   absl::StatusOr<NpyArray> array = ReadNpyFile("q.npy", 1 << 30);
//   if (array.ok() && array->dtype == NpyDType::kFloat32) { ... }
//
// The functions here are thread-safe.
#ifndef ATTNSERVE_COMMON_NPY_H_
#define ATTNSERVE_COMMON_NPY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnserve {

// Element types attnserve reads and writes in .npy files, with the descr each
// has in a file: '<f4', '<f2', '<f8', '|b1', '<i8' and '<u2' (bfloat16 bit
// patterns travel as uint16). A bool's byte-order mark may be any of '|', '=',
// '<', '>' when read, since one byte has no byte order.
enum class NpyDType { kFloat32, kFloat16, kFloat64, kBool, kInt64, kUInt16 };

// An array read from a .npy file.
struct NpyArray {
  NpyDType dtype;
  // Dimensions in C (row-major) order; a 0-d array has an empty shape.
  std::vector<int64_t> shape;
  // Raw little-endian element bytes, exactly product(shape) *
  // NpyElementBytes(dtype) of them. A bool element is 0 or 1 as numpy wrote it.
  std::string data;
};

// Parses the bytes of a whole .npy file. Returns INVALID_ARGUMENT, with a
// message that says what was expected and what was found, for: bad magic, an
// unsupported version, a truncated header, a header that is not a Python dict
// literal with exactly the keys 'descr', 'fortran_order' and 'shape', an
// unsupported or big-endian descr, fortran_order True, a negative shape
// dimension or a shape whose byte size overflows int64_t, and a data size that
// does not match the shape.
absl::StatusOr<NpyArray> ParseNpy(absl::string_view bytes);

// Reads and parses the .npy file at `path`. Returns NOT_FOUND if it does not
// exist, RESOURCE_EXHAUSTED if it is larger than `max_file_bytes` (checked
// before anything is read), INVALID_ARGUMENT prefixed with the path if it is
// not a regular file or does not parse, and the errno's status for any other
// failure to open or read it.
absl::StatusOr<NpyArray> ReadNpyFile(const std::string& path,
                                     int64_t max_file_bytes);

// Element size in bytes of `dtype`: 4, 2, 8, 1, 8, 2.
int64_t NpyElementBytes(NpyDType dtype);

// The bytes of a version 1.0 .npy file holding `array` (whose data must match
// its shape), as numpy.save writes them: header padded to a multiple of 64.
std::string SerializeNpy(const NpyArray& array);

// Writes SerializeNpy(array) to `path`, replacing it whole or not at all
// (WriteOutputFile: a FIFO is refused, not waited on). The errno's status if
// the file cannot be written.
absl::Status WriteNpyFile(const std::string& path, const NpyArray& array);

}  // namespace attnserve

#endif  // ATTNSERVE_COMMON_NPY_H_
