#include "internal/score_pass.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "attnserve/common/dtype.h"
#include "internal/fast_exp.h"
#include "internal/score_mods.h"
#include "internal/visibility.h"

namespace attnserve::internal {
namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// Softmax of one row in place over keys [0, end), zero past it; returns the
// log-sum-exp. Compiled for AVX-512, AVX2 and baseline x86-64, picked at load
// time by the CPU (GCC function multi-versioning), so the loops vectorise at
// the widest width the machine has.
__attribute__((target_clones("avx512f", "avx2", "default"))) float SoftmaxRow(
    float* row, int64_t end, int64_t key_len, const AttentionMask* mask,
    const uint8_t* allowed_row, const float* bias_row,
    int64_t mask_key_stride) {
  if (mask != nullptr) {
    for (int64_t j = 0; j < end; ++j) {
      if (bias_row != nullptr) {
        row[j] += bias_row[j * mask_key_stride];
      } else if (allowed_row[j * mask_key_stride] == 0) {
        row[j] = kNegativeInfinity;
      }
    }
  }
  float max_score = kNegativeInfinity;
  int nan_count = 0;
  int visible_count = 0;
#pragma omp simd reduction(max : max_score) reduction(+ : nan_count, visible_count)
  for (int64_t j = 0; j < end; ++j) {
    max_score = std::max(max_score, row[j]);
    nan_count += row[j] != row[j] ? 1 : 0;
    visible_count += row[j] != kNegativeInfinity ? 1 : 0;
  }
  if (nan_count > 0) {
    // A NaN score makes the row NaN, as IEEE arithmetic would.
    std::fill(row, row + key_len, std::numeric_limits<float>::quiet_NaN());
    return std::numeric_limits<float>::quiet_NaN();
  }
  // A row that sees no key is told by its count, not by max_score: OpenMP
  // starts each lane of a max reduction at the type's least value, which clang
  // takes as −FLT_MAX (GCC as −inf), so max_score may not be −inf here.
  if (visible_count == 0) {
    std::fill(row, row + key_len, 0.0f);
    return kNegativeInfinity;
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < end; ++j) {
    row[j] = ExpNonPositive(row[j] - max_score);
    sum += row[j];
  }
  const float inverse = 1.0f / sum;
#pragma omp simd
  for (int64_t j = 0; j < end; ++j) row[j] *= inverse;
  std::fill(row + end, row + key_len, 0.0f);
  return max_score + std::log(sum);
}

}  // namespace

void SoftmaxScoreSlab(const AttentionShape& shape,
                      const AttentionOptions& options, const ScoreSlab& slab,
                      float* scores, MatmulInput input,
                      uint16_t* probabilities_bf16, absl::Span<float> weights,
                      absl::Span<float> lse) {
  const int64_t group = shape.heads / shape.kv_heads;
  const int64_t lq = shape.query_len;
  const int64_t lk = shape.key_len;
  const int64_t rows = slab.query_count;
  const AttentionMask* mask = options.mask ? &*options.mask : nullptr;
  const MaskStrides mask_strides =
      mask ? StridesOf(*mask) : MaskStrides{0, 0, 0, 0};
  const float head_mean_factor = 1.0f / static_cast<float>(shape.heads);
  const bool mods = HasScoreMods(options);

  // One (batch item, query) per iteration, all heads of the slab inside it, so
  // that head-mean weights accumulate without races.
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < slab.batch_count * rows; ++item) {
    const int64_t local_batch = item / rows;
    const int64_t i = slab.first_query + item % rows;
    const int64_t b = slab.first_batch + local_batch;
    const RowKeys keys = VisibleKeys(shape, options, b, i);
    const int64_t position =
        QueryPosition(RulesOf(options), KeyLength(shape, options, b), lq, i);
    for (int64_t local_kv = 0; local_kv < slab.kv_head_count; ++local_kv) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = (slab.first_kv_head + local_kv) * group + g;
        const int64_t slab_row =
            ((local_batch * slab.kv_head_count + local_kv) * group + g) * rows +
            i - slab.first_query;
        float* row = scores + slab_row * lk;
        const int64_t mask_offset = mask ? b * mask_strides.batch +
                                               h * mask_strides.head +
                                               i * mask_strides.query
                                         : 0;
        const uint8_t* allowed_row =
            mask && mask->allowed ? mask->allowed + mask_offset : nullptr;
        const float* bias_row =
            mask && mask->bias ? mask->bias + mask_offset : nullptr;
        float row_lse;
        if (mods) {
          // The scores are scaled already: ModifyScores scales by 1.
          ModifyScores(
              row, lk, 0, 1.0f, keys, ModsOf(options, h, position),
              {bias_row, mask_strides.key, allowed_row, mask_strides.key});
          row_lse = SoftmaxRow(row, keys.end, lk, nullptr, nullptr, nullptr, 0);
        } else {
          row_lse = SoftmaxRow(row, keys.end, lk, mask, allowed_row, bias_row,
                               mask_strides.key);
        }
        if (!lse.empty()) lse[(b * shape.heads + h) * lq + i] = row_lse;
        if (options.weights == AttentionWeightsMode::kPerHead) {
          std::copy(row, row + lk,
                    weights.begin() + ((b * shape.heads + h) * lq + i) * lk);
        } else if (options.weights == AttentionWeightsMode::kHeadMean) {
          float* mean = weights.data() + (b * lq + i) * lk;
          for (int64_t j = 0; j < lk; ++j) mean[j] += row[j] * head_mean_factor;
        }
        if (input == MatmulInput::kBf16) {
          uint16_t* out = probabilities_bf16 + slab_row * lk;
          for (int64_t j = 0; j < lk; ++j) out[j] = Float32ToBFloat16(row[j]);
        } else if (input == MatmulInput::kRoundedF32) {
          RoundToBf16Values(row, lk, row);
        }
      }
    }
  }
}

}  // namespace attnserve::internal
