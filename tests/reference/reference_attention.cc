#include "reference/reference_attention.h"

#include <cmath>
#include <limits>
#include <random>

namespace attnserve::testing {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

// The mask's element for (b, h, i, j), broadcasting each dimension of size 1.
struct MaskLookup {
  const ReferenceMask* mask;
  int64_t dims[4];

  explicit MaskLookup(const ReferenceMask& m) : mask(&m) {
    const size_t rank = m.shape.size();
    for (size_t d = 0; d < 4; ++d)
      dims[d] = d + rank >= 4 ? m.shape[d + rank - 4] : 1;
  }

  int64_t Index(int64_t b, int64_t h, int64_t i, int64_t j) const {
    const int64_t at[4] = {b, h, i, j};
    int64_t index = 0;
    for (int d = 0; d < 4; ++d)
      index = index * dims[d] + (dims[d] == 1 ? 0 : at[d]);
    return index;
  }
};

// Scores (already scaled and masked) of one query row; −inf where the key is
// excluded.
// Where query i of batch item b stands among the keys.
int64_t Position(const ReferenceShape& s, const ReferenceOptions& o, int64_t b,
                 int64_t i) {
  const int64_t length = o.key_lengths.empty() ? s.key_len : o.key_lengths[b];
  return o.bottom_right ? i + length - s.query_len : i;
}

bool KeyVisible(const ReferenceShape& s, const ReferenceOptions& o, int64_t b,
                int64_t i, int64_t j) {
  const int64_t length = o.key_lengths.empty() ? s.key_len : o.key_lengths[b];
  const int64_t p = Position(s, o, b, i);
  if (j >= length) return false;
  if (o.causal && j > p) return false;
  if (j < o.num_sink_tokens) return true;
  if (o.window_left >= 0 && j < p - o.window_left) return false;
  if (o.window_right >= 0 && j > p + o.window_right) return false;
  return true;
}

std::vector<double> Linear(const std::vector<float>& x, int64_t rows,
                           int64_t in, const std::vector<float>& w,
                           const std::vector<float>& bias, int64_t out) {
  std::vector<double> y(rows * out);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double sum = bias.empty() ? 0.0 : bias[o];
      for (int64_t k = 0; k < in; ++k)
        sum += double{x[r * in + k]} * double{w[o * in + k]};
      y[r * out + o] = sum;
    }
  }
  return y;
}

}  // namespace

ReferenceResult ReferenceAttention(const ReferenceShape& s,
                                   const std::vector<float>& query,
                                   const std::vector<float>& key,
                                   const std::vector<float>& value,
                                   const ReferenceOptions& o) {
  const double alpha =
      o.scale.value_or(1.0 / std::sqrt(static_cast<double>(s.key_dim)));
  const int64_t group = s.heads / s.kv_heads;
  ReferenceResult result;
  result.output.assign(s.batch * s.heads * s.query_len * s.value_dim, 0.0);
  result.weights.assign(s.batch * s.heads * s.query_len * s.key_len, 0.0);
  result.lse.assign(s.batch * s.heads * s.query_len, -kInfinity);
  std::optional<MaskLookup> mask;
  if (o.mask) mask.emplace(*o.mask);
  std::vector<double> scores(s.key_len);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t kv = h / group;
      for (int64_t i = 0; i < s.query_len; ++i) {
        const int64_t row = (b * s.heads + h) * s.query_len + i;
        const float* q = &query[row * s.key_dim];
        double max_score = -kInfinity;
        for (int64_t j = 0; j < s.key_len; ++j) {
          scores[j] = -kInfinity;
          if (!KeyVisible(s, o, b, i, j)) continue;
          if (mask && !o.mask->allowed.empty() &&
              o.mask->allowed[mask->Index(b, h, i, j)] == 0) {
            continue;
          }
          const float* k =
              &key[((b * s.kv_heads + kv) * s.key_len + j) * s.key_dim];
          double dot = 0.0;
          for (int64_t d = 0; d < s.key_dim; ++d)
            dot += double{q[d]} * double{k[d]};
          scores[j] = alpha * dot;
          if (o.softcap)
            scores[j] = *o.softcap * std::tanh(scores[j] / *o.softcap);
          if (!o.alibi_slopes.empty()) {
            scores[j] -=
                o.alibi_slopes[h] *
                std::abs(static_cast<double>(Position(s, o, b, i) - j));
          }
          if (mask && !o.mask->bias.empty())
            scores[j] += o.mask->bias[mask->Index(b, h, i, j)];
          max_score = std::max(max_score, scores[j]);
        }
        if (max_score == -kInfinity)
          continue;  // Nothing to attend: zeros, lse −inf.
        double sum = 0.0;
        for (int64_t j = 0; j < s.key_len; ++j)
          sum += std::exp(scores[j] - max_score);
        result.lse[row] = max_score + std::log(sum);
        double* out = &result.output[row * s.value_dim];
        for (int64_t j = 0; j < s.key_len; ++j) {
          const double p = std::exp(scores[j] - max_score) / sum;
          result.weights[row * s.key_len + j] = p;
          const float* v =
              &value[((b * s.kv_heads + kv) * s.key_len + j) * s.value_dim];
          for (int64_t d = 0; d < s.value_dim; ++d) out[d] += p * double{v[d]};
        }
      }
    }
  }
  return result;
}

std::vector<double> HeadMean(const std::vector<double>& weights, int64_t batch,
                             int64_t heads, int64_t query_len,
                             int64_t key_len) {
  std::vector<double> mean(batch * query_len * key_len, 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t x = 0; x < query_len * key_len; ++x) {
        mean[b * query_len * key_len + x] +=
            weights[(b * heads + h) * query_len * key_len + x] /
            static_cast<double>(heads);
      }
    }
  }
  return mean;
}

ReferenceResult ReferenceMultiHeadAttention(
    const ReferenceMhaShape& s, const std::vector<float>& query_input,
    const std::vector<float>& kv_input, const ReferenceMhaWeights& w,
    const ReferenceOptions& options, const std::optional<ReferenceRope>& rope) {
  const std::vector<float>& kv_source =
      kv_input.empty() ? query_input : kv_input;
  const std::vector<double> q =
      Linear(query_input, s.batch * s.query_len, s.embed_dim, w.w_q, w.b_q,
             s.heads * s.key_dim);
  const std::vector<double> k =
      Linear(kv_source, s.batch * s.key_len, s.kv_embed_dim, w.w_k, w.b_k,
             s.kv_heads * s.key_dim);
  const std::vector<double> v =
      Linear(kv_source, s.batch * s.key_len, s.kv_embed_dim, w.w_v, w.b_v,
             s.kv_heads * s.value_dim);
  // RoPE on [B, L, heads, Dk], from the definition, in double.
  const auto rotate = [&](std::vector<double> x, int64_t len, int64_t heads,
                          const std::vector<int64_t>& positions) {
    if (!rope) return x;
    const int64_t dim = rope->rotary_dim == 0 ? s.key_dim : rope->rotary_dim;
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t l = 0; l < len; ++l) {
        const double p =
            static_cast<double>(positions.empty() ? l : positions[b * len + l]);
        for (int64_t h = 0; h < heads; ++h) {
          double* head = &x[((b * len + l) * heads + h) * s.key_dim];
          for (int64_t m = 0; m < dim / 2; ++m) {
            const double angle =
                p / std::pow(rope->theta, 2.0 * m / static_cast<double>(dim));
            const int64_t i = rope->interleaved ? 2 * m : m;
            const int64_t j = rope->interleaved ? 2 * m + 1 : m + dim / 2;
            const double a = head[i], c = head[j];
            head[i] = a * std::cos(angle) - c * std::sin(angle);
            head[j] = a * std::sin(angle) + c * std::cos(angle);
          }
        }
      }
    }
    return x;
  };
  const std::vector<double> q_rotated =
      rotate(q, s.query_len, s.heads,
             rope ? rope->query_positions : std::vector<int64_t>{});
  const std::vector<double> k_rotated =
      rotate(k, s.key_len, s.kv_heads,
             rope ? rope->key_positions : std::vector<int64_t>{});
  // [B, L, heads, D] → [B, heads, L, D], rounded to float: the SDPA reference
  // takes floats, and the projections' rounding is far below any tolerance the
  // tests use.
  auto split = [&](const std::vector<double>& x, int64_t len, int64_t heads,
                   int64_t dim) {
    std::vector<float> y(x.size());
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t l = 0; l < len; ++l)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t d = 0; d < dim; ++d)
            y[((b * heads + h) * len + l) * dim + d] =
                static_cast<float>(x[((b * len + l) * heads + h) * dim + d]);
    return y;
  };
  const ReferenceShape heads{s.batch,   s.heads,   s.kv_heads, s.query_len,
                             s.key_len, s.key_dim, s.value_dim};
  ReferenceResult attention = ReferenceAttention(
      heads, split(q_rotated, s.query_len, s.heads, s.key_dim),
      split(k_rotated, s.key_len, s.kv_heads, s.key_dim),
      split(v, s.key_len, s.kv_heads, s.value_dim), options);
  // Concatenate heads ([B, H, Lq, Dv] → [B, Lq, H·Dv]) and project with w_o.
  const int64_t context_width = s.heads * s.value_dim;
  std::vector<double> output(s.batch * s.query_len * s.embed_dim);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t i = 0; i < s.query_len; ++i) {
      for (int64_t e = 0; e < s.embed_dim; ++e) {
        double sum = w.b_o.empty() ? 0.0 : w.b_o[e];
        for (int64_t h = 0; h < s.heads; ++h) {
          for (int64_t d = 0; d < s.value_dim; ++d) {
            sum += attention.output[((b * s.heads + h) * s.query_len + i) *
                                        s.value_dim +
                                    d] *
                   double{w.w_o[e * context_width + h * s.value_dim + d]};
          }
        }
        output[(b * s.query_len + i) * s.embed_dim + e] = sum;
      }
    }
  }
  attention.output = std::move(output);
  return attention;
}

std::vector<float> PackedRowsAsHeads(const std::vector<float>& packed,
                                     int64_t first, int64_t count,
                                     int64_t heads, int64_t dim) {
  std::vector<float> out;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = first; t < first + count; ++t) {
      const float* row = packed.data() + (t * heads + h) * dim;
      out.insert(out.end(), row, row + dim);
    }
  }
  return out;
}

std::vector<float> RandomValues(int64_t count, uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::uniform_real_distribution<float> distribution(-1.0f, 1.0f);
  std::vector<float> values(count);
  for (float& v : values) v = distribution(generator);
  return values;
}

}  // namespace attnserve::testing
