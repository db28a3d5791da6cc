#include "internal/score_mods.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace attnserve::internal {

__attribute__((target_clones("avx512f", "avx2", "default"))) void ModifyScores(
    float* s, int64_t n, int64_t k0, float scale, const RowKeys& keys,
    const RowScoreMods& mods, const RowMask& mask) {
  constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();
  if (mods.softcap > 0.0f) {
    const float inverse = 1.0f / mods.softcap;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = mods.softcap * std::tanh(s[j] * scale * inverse);
    }
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) s[j] *= scale;
  }
  if (mods.slope != 0.0f) {
    const float position = static_cast<float>(mods.position - k0);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      s[j] -= mods.slope * std::fabs(position - static_cast<float>(j));
    }
  }
  if (mask.bias != nullptr) {
    for (int64_t j = 0; j < n; ++j) s[j] += mask.bias[j * mask.bias_stride];
  } else if (mask.allowed != nullptr) {
    for (int64_t j = 0; j < n; ++j) {
      if (mask.allowed[j * mask.allowed_stride] == 0) s[j] = kNegativeInfinity;
    }
  }
  // Hidden keys last, so that no bias (not even +inf) reaches them.
  const auto hide = [&](int64_t from, int64_t to) {
    from = std::clamp<int64_t>(from - k0, 0, n);
    to = std::clamp<int64_t>(to - k0, 0, n);
    std::fill(s + from, s + std::max(from, to), kNegativeInfinity);
  };
  hide(keys.sink_end, keys.start);
  hide(keys.end, k0 + n);
}

}  // namespace attnserve::internal
