// Packed bf16 copies of f32 tensors, the operands of bf16-precision matmuls.
#ifndef ATTNSERVE_CORE_INTERNAL_BF16_BUFFER_H_
#define ATTNSERVE_CORE_INTERNAL_BF16_BUFFER_H_

#include <array>
#include <cstdint>
#include <vector>

namespace attnserve::internal {

class Bf16Buffer {
 public:
  Bf16Buffer() = default;

  // Packs the f32 tensor [d0, d1, d2, d3] at `source` with element `strides`
  // into row-major bf16 (round to nearest even), on the calling thread's OpenMP
  // team.
  static Bf16Buffer Pack(const float* source, int64_t d0, int64_t d1,
                         int64_t d2, int64_t d3,
                         const std::array<int64_t, 4>& strides);

  // Packs the row-major matrix [rows, columns] whose rows are `row_stride`
  // elements apart.
  static Bf16Buffer PackMatrix(const float* source, int64_t rows,
                               int64_t columns, int64_t row_stride) {
    return Pack(source, 1, 1, rows, columns, {0, 0, row_stride, 1});
  }

  const uint16_t* data() const { return values_.data(); }

 private:
  std::vector<uint16_t> values_;
};

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_BF16_BUFFER_H_
