// The fused kernel's online-softmax step (TileKernels::softmax_block), every
// kernel set this CPU runs (and the AVX-512 set of CPUs without AVX512_BF16),
// against exp computed in double: f32 probabilities to a few f32 ulps, bf16
// ones (the bf16 tiles' P, whose exponent is a cheaper polynomial) to bf16's
// rounding, and the running max, sum and rescale factor across blocks.
#include "internal/tile_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
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
  // What a CPU with AVX-512 but without AVX512_BF16 runs, where this one has
  // both.
  if (const TileKernels* without = Avx512TileKernelsWithoutBf16();
      without != nullptr && without->to_bf16 != selected.to_bf16) {
    sets.push_back({without->name, without});
  }
  return sets;
}

class SoftmaxBlockTest : public ::testing::TestWithParam<KernelSet> {};

// Four blocks of one row, each at every width the kernel handles differently
// (whole pairs of vectors, a ragged tail, a single key; at 32 keys the third
// block's raise lies in its one pair's second vector alone, at 120 it starts
// there), with positive and negative scales, all keys visible or the last few
// hidden. The second block lies a little higher (its max moves by less than
// 8·ln 2, which the AVX-512 set may keep its shift through); the second half of
// the third block 20 higher, which raises any shift after probabilities of that
// block are written; the fourth 120 higher, past which the earlier
// probabilities vanish. Each call must keep the contract: the shift at most the
// running max and at most 8·ln 2 below it, alpha = exp(old shift − new shift),
// p_j = exp(x_j − shift), and the sum that of every key seen, against the
// shift.
TEST_P(SoftmaxBlockTest, MatchesExpInDouble) {
  const TileKernels& kernels = *GetParam().kernels;
  std::mt19937 random(7);
  std::uniform_real_distribution<float> uniform(-8.0f, 8.0f);
  for (const bool bf16 : {false, true}) {
    for (const int64_t n : {256, 200, 120, 32, 16, 1}) {
      for (const float scale : {0.125f, 1.0f, -0.5f}) {
        for (const int64_t hidden : {int64_t{0}, n / 3}) {
          SCOPED_TRACE(::testing::Message()
                       << GetParam().name << (bf16 ? " bf16" : " f32") << " n="
                       << n << " scale=" << scale << " hidden=" << hidden);
          RowState state{kMinusInf, 0.0f, false};
          double running_max = -INFINITY;
          std::vector<double> seen;  // every visible x, in double
          for (int block = 0; block < 4; ++block) {
            SCOPED_TRACE(::testing::Message() << "block " << block);
            std::vector<float> scores(static_cast<size_t>(n));
            for (float& x : scores) x = uniform(random);
            const float raise[] = {0.0f, 4.0f, 20.0f, 120.0f};
            for (int64_t j = block == 2 ? n / 2 : 0; j < n; ++j) {
              scores[j] += raise[block] / scale;
            }
            const int64_t visible = n - hidden;
            for (int64_t j = 0; j < visible; ++j) {
              seen.push_back(double{scale} * scores[j]);
              running_max = std::max(running_max, seen.back());
            }
            const float old_shift = state.max;
            std::vector<float> raw = scores;
            std::vector<uint16_t> p16(bf16 ? static_cast<size_t>(n) : 0);
            const float alpha = kernels.softmax_block(
                scores.data(), n, visible, scale, RowMask(), &state,
                bf16 ? p16.data() : nullptr);
            EXPECT_FALSE(state.nan);
            const double shift = state.max;
            const double slack = 1e-6 * std::abs(running_max);
            EXPECT_LE(shift, running_max + slack);
            EXPECT_GE(shift, running_max - 8.0 * std::log(2.0) - slack);
            // A few f32 ulps of the shift, which grow with it.
            const double shift_ulps = 4e-6 + 2e-7 * std::abs(shift);
            const double expected_alpha =
                old_shift == kMinusInf ? 0.0 : std::exp(old_shift - shift);
            EXPECT_NEAR(alpha, expected_alpha,
                        shift_ulps * expected_alpha + 1e-30);
            // f32: a few ulps of the exponent's argument; bf16: its rounding
            // (half an ulp, at most 2^-8 relative) and the polynomial's
            // 1.1e-4.
            const double relative = bf16 ? 1.0 / 256 + 2e-4 : shift_ulps;
            for (int64_t j = 0; j < n; ++j) {
              const double exact =
                  j < visible ? std::exp(double{scale} * raw[j] - shift) : 0.0;
              const double p = bf16 ? BFloat16ToFloat32(p16[j]) : scores[j];
              ASSERT_NEAR(p, exact, relative * exact + 1e-38) << "key " << j;
            }
            double expected_sum = 0.0;
            for (const double x : seen) expected_sum += std::exp(x - shift);
            EXPECT_NEAR(state.sum, expected_sum,
                        (bf16 ? 2e-4 : shift_ulps) * expected_sum);
          }
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

// A NaN in a later block (the row has a shift), in a pair's second vector or
// in the ragged tail, marks the row.
TEST_P(SoftmaxBlockTest, NaNInALaterBlock) {
  const TileKernels& kernels = *GetParam().kernels;
  for (const bool bf16 : {false, true}) {
    for (const int64_t at : {20, 37}) {
      SCOPED_TRACE(::testing::Message()
                   << (bf16 ? "bf16" : "f32") << " at " << at);
      std::vector<float> scores(40, 1.0f);
      std::vector<uint16_t> p16(40);
      RowState state{kMinusInf, 0.0f, false};
      kernels.softmax_block(scores.data(), 40, 40, 1.0f, RowMask(), &state,
                            bf16 ? p16.data() : nullptr);
      ASSERT_FALSE(state.nan);
      scores.assign(40, 1.0f);
      scores[at] = std::numeric_limits<float>::quiet_NaN();
      kernels.softmax_block(scores.data(), 40, 40, 1.0f, RowMask(), &state,
                            bf16 ? p16.data() : nullptr);
      EXPECT_TRUE(state.nan);
    }
  }
}

// The conversions of every set against the scalar ones of common/dtype.h,
// bit for bit, over whole vectors and a ragged tail: to bf16 rounds to nearest
// even (a NaN stays a NaN; a subnormal may be flushed to zero), and bf16 and
// f16 widen exactly.
TEST_P(SoftmaxBlockTest, ConversionsMatchTheScalarOnes) {
  const TileKernels& kernels = *GetParam().kernels;
  std::mt19937 random(11);
  std::uniform_int_distribution<uint32_t> bits;
  constexpr int64_t kCount = 37;
  std::vector<float> values(kCount);
  for (float& value : values) {
    const uint32_t word = bits(random);
    std::memcpy(&value, &word, sizeof(value));
  }
  values[0] = std::numeric_limits<float>::infinity();
  values[1] = -std::numeric_limits<float>::quiet_NaN();
  values[2] = 1.00390625f;  // 1 + 2^-8: a tie, rounded to even (1)
  values[3] = 1.01171875f;  // 1 + 3·2^-8: a tie, rounded to even (1 + 2^-6)
  values[4] = 1e-40f;       // subnormal
  std::vector<uint16_t> narrowed(kCount);
  kernels.to_bf16(values.data(), kCount, narrowed.data());
  std::vector<uint16_t> halves(kCount);
  for (int64_t i = 0; i < kCount; ++i) {
    SCOPED_TRACE(::testing::Message() << "value " << i << " = " << values[i]);
    if (std::isnan(values[i])) {
      EXPECT_TRUE(std::isnan(BFloat16ToFloat32(narrowed[i])));
    } else if (std::fpclassify(values[i]) == FP_SUBNORMAL &&
               BFloat16ToFloat32(narrowed[i]) == 0.0f) {
      // VCVTNEPS2BF16 flushes a subnormal to zero, its sign kept.
      EXPECT_EQ(std::signbit(BFloat16ToFloat32(narrowed[i])),
                std::signbit(values[i]));
    } else {
      EXPECT_EQ(narrowed[i], Float32ToBFloat16(values[i]));
    }
    halves[i] = static_cast<uint16_t>(bits(random));
  }
  // Each half widened by `widen` against `scalar`, a NaN as any NaN.
  const auto expect_widened =
      [&halves](void (*widen)(const uint16_t*, int64_t, float*),
                float (*scalar)(uint16_t)) {
        std::vector<float> widened(kCount);
        widen(halves.data(), kCount, widened.data());
        for (int64_t i = 0; i < kCount; ++i) {
          const float expected = scalar(halves[i]);
          if (std::isnan(expected)) {
            EXPECT_TRUE(std::isnan(widened[i])) << i;
          } else {
            EXPECT_EQ(widened[i], expected) << i;
          }
        }
      };
  expect_widened(kernels.bf16_to_f32, &BFloat16ToFloat32);
  expect_widened(kernels.f16_to_f32, &Float16ToFloat32);
}

INSTANTIATE_TEST_SUITE_P(Kernels, SoftmaxBlockTest,
                         ::testing::ValuesIn(KernelSets()),
                         [](const ::testing::TestParamInfo<KernelSet>& param) {
                           return std::string(param.param.name);
                         });

}  // namespace
}  // namespace attnserve::internal
