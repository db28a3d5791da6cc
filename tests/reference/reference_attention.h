// A deliberately naive scaled dot-product attention, for tests only.
//
// It shares no code with core/: loops straight from the definition, double
// accumulation, an explicit max-subtracted softmax. Slow by design; keep test
// shapes small.
#ifndef ATTNSERVE_TESTS_REFERENCE_REFERENCE_ATTENTION_H_
#define ATTNSERVE_TESTS_REFERENCE_REFERENCE_ATTENTION_H_

#include <cstdint>
#include <optional>
#include <vector>

namespace attnserve::testing {

struct ReferenceShape {
  int64_t batch, heads, kv_heads, query_len, key_len, key_dim, value_dim;
};

// Returns output [B, H, Lq, Dv] for query [B, H, Lq, Dk], key [B, Hkv, Lk, Dk]
// and value [B, Hkv, Lk, Dv], query head h reading kv head h / (H / Hkv).
// `scale` defaults to 1 / sqrt(Dk).
std::vector<double> ReferenceAttention(
    const ReferenceShape& shape, const std::vector<float>& query,
    const std::vector<float>& key, const std::vector<float>& value,
    std::optional<double> scale = std::nullopt);

// `count` values uniform in [-1, 1) from a fixed-seed generator.
std::vector<float> RandomValues(int64_t count, uint64_t seed);

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_REFERENCE_REFERENCE_ATTENTION_H_
