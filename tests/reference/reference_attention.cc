#include "reference/reference_attention.h"

#include <cmath>
#include <random>

namespace attnserve::testing {

std::vector<double> ReferenceAttention(const ReferenceShape& s,
                                       const std::vector<float>& query,
                                       const std::vector<float>& key,
                                       const std::vector<float>& value,
                                       std::optional<double> scale) {
  const double alpha =
      scale.value_or(1.0 / std::sqrt(static_cast<double>(s.key_dim)));
  const int64_t group = s.heads / s.kv_heads;
  std::vector<double> output(s.batch * s.heads * s.query_len * s.value_dim,
                             0.0);
  std::vector<double> scores(s.key_len);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t kv = h / group;
      for (int64_t i = 0; i < s.query_len; ++i) {
        const float* q =
            &query[((b * s.heads + h) * s.query_len + i) * s.key_dim];
        double max_score = -INFINITY;
        for (int64_t j = 0; j < s.key_len; ++j) {
          const float* k =
              &key[((b * s.kv_heads + kv) * s.key_len + j) * s.key_dim];
          double dot = 0.0;
          for (int64_t d = 0; d < s.key_dim; ++d)
            dot += double{q[d]} * double{k[d]};
          scores[j] = alpha * dot;
          max_score = std::max(max_score, scores[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j < s.key_len; ++j) {
          scores[j] = std::exp(scores[j] - max_score);
          sum += scores[j];
        }
        double* out =
            &output[((b * s.heads + h) * s.query_len + i) * s.value_dim];
        for (int64_t j = 0; j < s.key_len; ++j) {
          const float* v =
              &value[((b * s.kv_heads + kv) * s.key_len + j) * s.value_dim];
          for (int64_t d = 0; d < s.value_dim; ++d)
            out[d] += scores[j] / sum * double{v[d]};
        }
      }
    }
  }
  return output;
}

std::vector<float> RandomValues(int64_t count, uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::uniform_real_distribution<float> distribution(-1.0f, 1.0f);
  std::vector<float> values(count);
  for (float& v : values) v = distribution(generator);
  return values;
}

}  // namespace attnserve::testing
