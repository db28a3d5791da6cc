// Packed copies of f32 tensors as the operands of bf16-precision matmuls: bf16
// values stored as bf16 (MatmulInput::kBf16), or as f32 on a CPU whose oneDNN
// has no bf16 matmul (kRoundedF32, internal/matmul.h).
#ifndef ATTNSERVE_CORE_INTERNAL_BF16_BUFFER_H_
#define ATTNSERVE_CORE_INTERNAL_BF16_BUFFER_H_

#include <array>
#include <cstdint>
#include <vector>

#include "internal/matmul.h"

namespace attnserve::internal {

class Bf16Buffer {
 public:
  Bf16Buffer() = default;

  // Packs the f32 tensor [d0, d1, d2, d3] at `source` with element `strides`
  // into row-major values rounded to bf16 (to nearest even), stored as `input`
  // (kBf16 or kRoundedF32), on the calling thread's OpenMP team.
  static Bf16Buffer Pack(const float* source, int64_t d0, int64_t d1,
                         int64_t d2, int64_t d3,
                         const std::array<int64_t, 4>& strides,
                         MatmulInput input);

  // Packs the row-major matrix [rows, columns] whose rows are `row_stride`
  // elements apart.
  static Bf16Buffer PackMatrix(const float* source, int64_t rows,
                               int64_t columns, int64_t row_stride,
                               MatmulInput input) {
    return Pack(source, 1, 1, rows, columns, {0, 0, row_stride, 1}, input);
  }

  // The packed values: uint16_t bf16 bits for kBf16, float for kRoundedF32.
  const void* data() const {
    return bf16_.empty() ? static_cast<const void*>(rounded_.data())
                         : static_cast<const void*>(bf16_.data());
  }

 private:
  std::vector<uint16_t> bf16_;
  std::vector<float> rounded_;
};

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_BF16_BUFFER_H_
