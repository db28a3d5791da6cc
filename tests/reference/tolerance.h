// The tolerances docs/api.md ("Numerics and tolerances") promises, and the
// comparison every numeric test makes against the reference with them.
#ifndef ATTNSERVE_TESTS_REFERENCE_TOLERANCE_H_
#define ATTNSERVE_TESTS_REFERENCE_TOLERANCE_H_

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace attnserve::testing {

// |actual − expected| ≤ abs + rel·|expected|.
struct Tolerance {
  double abs, rel;
};

// By compute precision, for outputs and weights returned as FLOAT32.
inline constexpr Tolerance kOutputF32 = {1e-5, 1e-5};
inline constexpr Tolerance kOutputBf16 = {2e-2, 2e-2};
// For lse.
inline constexpr Tolerance kLseF32 = {1e-4, 1e-5};
inline constexpr Tolerance kLseBf16 = {5e-2, 1e-2};

// Every element of `actual` within `t` of `expected`; an infinite expected
// value must be matched exactly. Stops the test at the first that is not.
inline void ExpectNear(const char* what, const std::vector<float>& actual,
                       const std::vector<double>& expected, Tolerance t) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (std::isinf(expected[i])) {
      ASSERT_EQ(actual[i], expected[i]) << what << " at " << i;
      continue;
    }
    ASSERT_NEAR(actual[i], expected[i], t.abs + t.rel * std::abs(expected[i]))
        << what << " at flat index " << i;
  }
}

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_REFERENCE_TOLERANCE_H_
