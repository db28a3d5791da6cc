#include "attnserve/common/dtype.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

float FloatOf(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// The nearest bf16 to `value` by brute force over the two candidates, ties to
// even: an independent statement of what Float32ToBFloat16 must return for
// finite values.
uint16_t NearestBFloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint16_t down = static_cast<uint16_t>(bits >> 16);
  const uint16_t up = static_cast<uint16_t>(down + 1);
  const double distance_down =
      std::abs(double{value} - double{BFloat16ToFloat32(down)});
  const double distance_up =
      std::abs(double{value} - double{BFloat16ToFloat32(up)});
  if (distance_down < distance_up) return down;
  if (distance_up < distance_down) return up;
  return (down & 1) == 0 ? down : up;
}

TEST(DTypeTest, Float16RoundTripsEveryNonNanValue) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float value = Float16ToFloat32(static_cast<uint16_t>(bits));
    if (std::isnan(value)) continue;
    ASSERT_EQ(Float32ToFloat16(value), bits) << std::hex << bits;
  }
}

TEST(DTypeTest, Float16WideningMatchesTheIeeeDefinition) {
  EXPECT_EQ(Float16ToFloat32(0x3c00), 1.0f);
  EXPECT_EQ(Float16ToFloat32(0xc000), -2.0f);
  EXPECT_EQ(Float16ToFloat32(0x7bff), 65504.0f);
  EXPECT_EQ(Float16ToFloat32(0x0001),
            std::ldexp(1.0f, -24));  // Smallest subnormal.
  EXPECT_EQ(Float16ToFloat32(0x0400),
            std::ldexp(1.0f, -14));  // Smallest normal.
  EXPECT_EQ(Float16ToFloat32(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(Float16ToFloat32(0x7e00)));
}

TEST(DTypeTest, Float16NarrowingRoundsToNearestEven) {
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties go to the even mantissa
  // (1).
  EXPECT_EQ(Float32ToFloat16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // 1 + 3·2^-11 is halfway between 1 + 2^-10 (odd) and 1 + 2^-9: rounds up to
  // even.
  EXPECT_EQ(Float32ToFloat16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(Float32ToFloat16(65519.0f),
            0x7bff);  // Below the halfway point to 65536.
  EXPECT_EQ(Float32ToFloat16(65520.0f), 0x7c00);  // Rounds to infinity.
  EXPECT_EQ(Float32ToFloat16(std::ldexp(1.0f, -25)),
            0x0000);  // Tie to even zero.
  EXPECT_EQ(Float32ToFloat16(std::ldexp(3.0f, -26)), 0x0001);  // Above the tie.
  EXPECT_EQ(Float32ToFloat16(-0.0f), 0x8000);
  EXPECT_EQ(Float32ToFloat16(std::numeric_limits<float>::quiet_NaN()) & 0x7c00,
            0x7c00);
}

TEST(DTypeTest, BFloat16NarrowingIsNearestEvenOnRandomValues) {
  std::mt19937 generator(7);
  for (int i = 0; i < 200000; ++i) {
    const float value =
        FloatOf(generator() & 0x7effffffu);  // Finite, far from overflow.
    ASSERT_EQ(Float32ToBFloat16(value), NearestBFloat16(value)) << value;
    ASSERT_EQ(Float32ToBFloat16(-value), NearestBFloat16(-value)) << -value;
  }
  EXPECT_TRUE(std::isnan(BFloat16ToFloat32(
      Float32ToBFloat16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(BFloat16ToFloat32(
                Float32ToBFloat16(std::numeric_limits<float>::infinity())),
            std::numeric_limits<float>::infinity());
}

TEST(DTypeTest, BulkConversionsMatchTheScalarOnes) {
  const float values[] = {0.1f, -2.5f, 1e-6f, 3e5f, -0.0f};
  for (DataType type :
       {DataType::kBFloat16, DataType::kFloat16, DataType::kFloat32}) {
    unsigned char packed[sizeof(values)];
    ConvertFromFloat32(values, 5, type, packed);
    float widened[5];
    ConvertToFloat32(type, packed, 5, widened);
    for (int i = 0; i < 5; ++i) {
      const float expected =
          type == DataType::kBFloat16
              ? BFloat16ToFloat32(Float32ToBFloat16(values[i]))
          : type == DataType::kFloat16
              ? Float16ToFloat32(Float32ToFloat16(values[i]))
              : values[i];
      EXPECT_EQ(widened[i], expected) << i;
    }
  }
}

}  // namespace
}  // namespace attnserve
