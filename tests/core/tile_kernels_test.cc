// The fused kernel's online-softmax step (TileKernels::softmax_block), every
// kernel set this CPU runs, against exp computed in double: f32 probabilities
// to a few f32 ulps, bf16 ones (the bf16 tiles' P, whose exponent is a cheaper
// polynomial) to bf16's rounding, and the running max, sum and rescale factor
// across blocks.
#include "internal/tile_kernels.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnserve/common/dtype.h"
#include "gtest/gtest.h"

namespace attnserve::internal {
namespace {

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

struct KernelSet {
  const char* name;
  const TileKernels* kernels;
};

std::vector<KernelSet> KernelSets() {
  std::vector<KernelSet> sets = {{"portable", &PortableTileKernels()}};
  const TileKernels& selected = SelectTileKernels(/*portable_only=*/false);
  if (std::string(selected.name) != "portable") {
    sets.push_back({selected.name, &selected});
  }
  return sets;
}

class SoftmaxBlockTest : public ::testing::TestWithParam<KernelSet> {};

// Two blocks of one row, each at every width the kernel handles differently
// (whole vectors, a ragged tail, a single key), with positive and negative
// scales, all keys visible or the last few hidden.
TEST_P(SoftmaxBlockTest, MatchesExpInDouble) {
  const TileKernels& kernels = *GetParam().kernels;
  std::mt19937 random(7);
  std::uniform_real_distribution<float> uniform(-8.0f, 8.0f);
  for (const bool bf16 : {false, true}) {
    for (const int64_t n : {256, 200, 16, 1}) {
      for (const float scale : {0.125f, 1.0f, -0.5f}) {
        for (const int64_t hidden : {int64_t{0}, n / 3}) {
          SCOPED_TRACE(::testing::Message()
                       << GetParam().name << (bf16 ? " bf16" : " f32") << " n="
                       << n << " scale=" << scale << " hidden=" << hidden);
          RowState state{kMinusInf, 0.0f, false};
          double expected_max = -INFINITY;
          double expected_sum = 0.0;
          for (int block = 0; block < 2; ++block) {
            std::vector<float> scores(static_cast<size_t>(n));
            for (float& x : scores) x = uniform(random);
            // The second block's scores lie higher, so the max moves.
            if (block == 1) {
              for (float& x : scores) x += scale > 0 ? 4.0f : -4.0f;
            }
            const int64_t visible = n - hidden;
            double block_max = -INFINITY;
            for (int64_t j = 0; j < visible; ++j) {
              block_max = std::max(block_max, double{scale} * scores[j]);
            }
            const double new_max = std::max(expected_max, block_max);
            const double expected_alpha =
                expected_max == -INFINITY ? (new_max == -INFINITY ? 1.0 : 0.0)
                                          : std::exp(expected_max - new_max);
            std::vector<double> exact(static_cast<size_t>(n), 0.0);
            double block_sum = 0.0;
            for (int64_t j = 0; j < visible; ++j) {
              exact[j] = std::exp(double{scale} * scores[j] - new_max);
              block_sum += exact[j];
            }
            expected_sum = expected_sum * expected_alpha + block_sum;
            expected_max = new_max;

            std::vector<uint16_t> p16(bf16 ? static_cast<size_t>(n) : 0);
            const float alpha = kernels.softmax_block(
                scores.data(), n, visible, scale, RowMask(), &state,
                bf16 ? p16.data() : nullptr);
            EXPECT_NEAR(alpha, expected_alpha, 1e-6 * expected_alpha + 1e-30);
            EXPECT_NEAR(state.max, expected_max, 1e-6 * std::abs(expected_max));
            EXPECT_FALSE(state.nan);
            for (int64_t j = 0; j < n; ++j) {
              const double p = bf16 ? BFloat16ToFloat32(p16[j]) : scores[j];
              // bf16: its rounding (half an ulp, at most 2^-8 relative) and
              // the polynomial's 1.1e-4; f32: a few ulps of the exponent's
              // argument.
              const double tolerance =
                  bf16 ? (1.0 / 256 + 2e-4) * exact[j] : 4e-6 * exact[j];
              ASSERT_NEAR(p, exact[j], tolerance + 1e-38) << "key " << j;
            }
          }
          EXPECT_NEAR(state.sum, expected_sum,
                      (bf16 ? 2e-4 : 4e-6) * expected_sum);
        }
      }
    }
  }
}

// A row that has seen nothing writes zeros and keeps its state; a NaN score
// marks the row.
TEST_P(SoftmaxBlockTest, NothingVisibleAndNaN) {
  const TileKernels& kernels = *GetParam().kernels;
  for (const bool bf16 : {false, true}) {
    std::vector<float> scores(40, 1.0f);
    std::vector<uint16_t> p16(40, 0xffff);
    RowState state{kMinusInf, 0.0f, false};
    const float alpha =
        kernels.softmax_block(scores.data(), 40, 0, 1.0f, RowMask(), &state,
                              bf16 ? p16.data() : nullptr);
    EXPECT_EQ(alpha, 1.0f);
    EXPECT_EQ(state.max, kMinusInf);
    EXPECT_EQ(state.sum, 0.0f);
    for (int j = 0; j < 40; ++j) {
      EXPECT_EQ(bf16 ? BFloat16ToFloat32(p16[j]) : scores[j], 0.0f);
    }
    scores.assign(40, 1.0f);
    scores[17] = std::numeric_limits<float>::quiet_NaN();
    kernels.softmax_block(scores.data(), 40, 40, 1.0f, RowMask(), &state,
                          bf16 ? p16.data() : nullptr);
    EXPECT_TRUE(state.nan);
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, SoftmaxBlockTest,
                         ::testing::ValuesIn(KernelSets()),
                         [](const ::testing::TestParamInfo<KernelSet>& param) {
                           return std::string(param.param.name);
                         });

}  // namespace
}  // namespace attnserve::internal
