// Overflow-checked integer arithmetic for sizes computed from caller-supplied
// dimensions.
#ifndef ATTNSERVE_COMMON_CHECKED_MATH_H_
#define ATTNSERVE_COMMON_CHECKED_MATH_H_

#include <cstdint>
#include <initializer_list>
#include <optional>

#include "absl/types/span.h"

namespace attnserve {

// Returns a * b, or nullopt if the product overflows int64_t.
inline std::optional<int64_t> CheckedMultiply(int64_t a, int64_t b) {
  int64_t product;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

// Returns the product of `factors` (1 for none), or nullopt if any partial
// product overflows int64_t.
inline std::optional<int64_t> CheckedProduct(
    absl::Span<const int64_t> factors) {
  int64_t product = 1;
  for (int64_t factor : factors) {
    std::optional<int64_t> next = CheckedMultiply(product, factor);
    if (!next) return std::nullopt;
    product = *next;
  }
  return product;
}

inline std::optional<int64_t> CheckedProduct(
    std::initializer_list<int64_t> factors) {
  return CheckedProduct(absl::MakeConstSpan(factors.begin(), factors.size()));
}

// Sums byte counts: nullopt if any term is nullopt or the sum overflows.
inline std::optional<int64_t> CheckedSum(
    std::initializer_list<std::optional<int64_t>> terms) {
  int64_t sum = 0;
  for (const std::optional<int64_t>& term : terms) {
    if (!term || __builtin_add_overflow(sum, *term, &sum)) return std::nullopt;
  }
  return sum;
}

}  // namespace attnserve

#endif  // ATTNSERVE_COMMON_CHECKED_MATH_H_
