#include "attnserve/core/rotary.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"

namespace attnserve {

absl::Status ValidateRotary(const RotaryEmbedding& rope, int64_t head_dim,
                            const char* field) {
  if (!std::isfinite(rope.theta) || !(rope.theta > 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".theta is ", rope.theta, ", expected a finite number > 1"));
  }
  if (rope.rotary_dim < 0 || rope.rotary_dim % 2 != 0 ||
      rope.rotary_dim > head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".rotary_dim is ", rope.rotary_dim,
                     ", expected 0 (the whole head) or an even number from 2 "
                     "to the head dim ",
                     head_dim));
  }
  if (rope.rotary_dim == 0 && head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".rotary_dim is 0 (the whole head) and the head dim is ",
        head_dim, ", expected an even head dim or an even rotary_dim"));
  }
  return absl::OkStatus();
}

void ApplyRotary(const RotaryEmbedding& rope, int64_t head_dim, int64_t heads,
                 float* data, int64_t rows, int64_t row_stride,
                 int64_t first_position, absl::Span<const int64_t> positions) {
  const int64_t dim = rope.rotary_dim == 0 ? head_dim : rope.rotary_dim;
  const int64_t pairs = dim / 2;
  std::vector<double> frequencies(static_cast<size_t>(pairs));
  for (int64_t m = 0; m < pairs; ++m) {
    frequencies[static_cast<size_t>(m)] =
        std::pow(static_cast<double>(rope.theta),
                 -2.0 * static_cast<double>(m) / static_cast<double>(dim));
  }
  std::vector<double> cosines(static_cast<size_t>(pairs)),
      sines(static_cast<size_t>(pairs));
  for (int64_t r = 0; r < rows; ++r) {
    const double position = static_cast<double>(
        positions.empty() ? first_position + r
                          : positions[static_cast<size_t>(r)]);
    for (int64_t m = 0; m < pairs; ++m) {
      const double angle = position * frequencies[static_cast<size_t>(m)];
      cosines[static_cast<size_t>(m)] = std::cos(angle);
      sines[static_cast<size_t>(m)] = std::sin(angle);
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* head = data + r * row_stride + h * head_dim;
      for (int64_t m = 0; m < pairs; ++m) {
        float& x = head[rope.interleaved ? 2 * m : m];
        float& y = head[rope.interleaved ? 2 * m + 1 : m + pairs];
        const double c = cosines[static_cast<size_t>(m)];
        const double s = sines[static_cast<size_t>(m)];
        const double x0 = x, y0 = y;
        x = static_cast<float>(x0 * c - y0 * s);
        y = static_cast<float>(x0 * s + y0 * c);
      }
    }
  }
}

}  // namespace attnserve
