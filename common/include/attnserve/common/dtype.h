// Element types of tensors on the wire, and their conversion to and from f32,
// the type the engine computes in.
//
// Conversions round to nearest, ties to even; NaN stays NaN and infinities stay
// infinite. f32 values beyond a type's range become infinities (float16 above
// 65504, as IEEE rounding says).
#ifndef ATTNSERVE_COMMON_DTYPE_H_
#define ATTNSERVE_COMMON_DTYPE_H_

#include <cstdint>

namespace attnserve {

enum class DataType { kFloat32, kBFloat16, kFloat16 };

// Bytes of one element.
int64_t DataTypeBytes(DataType type);

// Converts `count` elements of `type` at `source` (which needs no alignment) to
// f32.
void ConvertToFloat32(DataType type, const void* source, int64_t count,
                      float* destination);

// Converts `count` f32 values to `type` at `destination` (which needs no
// alignment).
void ConvertFromFloat32(const float* source, int64_t count, DataType type,
                        void* destination);

// One-value conversions, the building blocks of the above.
uint16_t Float32ToBFloat16(float value);
float BFloat16ToFloat32(uint16_t bits);
uint16_t Float32ToFloat16(float value);
float Float16ToFloat32(uint16_t bits);

}  // namespace attnserve

#endif  // ATTNSERVE_COMMON_DTYPE_H_
