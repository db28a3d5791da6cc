// Helpers shared by the projection-weights tests (weights_*_test.cc): random
// tensors, weights and MultiHeadAttention requests of a ReferenceMhaShape, the
// naive reference's answer for them, and checks of WeightsInfo and outputs.
#ifndef ATTNSERVE_TESTS_SERVER_WEIGHTS_HELPERS_H_
#define ATTNSERVE_TESTS_SERVER_WEIGHTS_HELPERS_H_

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "attnserve/client/client.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"

namespace attnserve::testing {

inline constexpr absl::Duration kTimeout = absl::Seconds(30);

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the .npy files below are written little-endian in place");

// The bytes of a .npy v1.0 file of `descr` ('<f4' or '<f8') holding `values`.
inline std::string NpyBytes(const std::string& descr,
                            const std::vector<int64_t>& shape,
                            const std::vector<float>& values) {
  const std::string dims = shape.size() == 1 ? absl::StrCat(shape[0], ",")
                                             : absl::StrJoin(shape, ", ");
  std::string header =
      absl::StrCat("{'descr': '", descr,
                   "', 'fortran_order': False, 'shape': (", dims, "), }");
  // Pad with spaces so that magic, version, length and header end on a
  // multiple of 64 bytes, the last being '\n'.
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');
  header.push_back('\n');
  std::string bytes("\x93NUMPY\x01\x00", 8);
  bytes.push_back(static_cast<char>(header.size() & 0xff));
  bytes.push_back(static_cast<char>(header.size() >> 8));
  bytes += header;
  if (descr == "<f8") {
    for (float value : values) {
      const double wide = value;
      bytes.append(reinterpret_cast<const char*>(&wide), sizeof(wide));
    }
  } else {
    bytes.append(reinterpret_cast<const char*>(values.data()),
                 values.size() * sizeof(float));
  }
  return bytes;
}

// f32 tolerance against the double reference: abs + rel * |expected|.
inline constexpr double kAbs = 1e-5;
inline constexpr double kRel = 1e-5;

inline int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t elements = 1;
  for (int64_t dim : shape) elements *= dim;
  return elements;
}

// A tensor of `dtype` and `shape` holding values uniform in [-scale, scale).
inline v1::Tensor RandomTensor(v1::DType dtype,
                               const std::vector<int64_t>& shape, uint64_t seed,
                               float scale) {
  std::vector<float> values = RandomValues(Elements(shape), seed);
  for (float& value : values) value *= scale;
  return MakeTensor(dtype, shape, values);
}

// The elements of a float tensor, widened to float (a test failure if it
// cannot be read).
inline std::vector<float> ValuesOf(const v1::Tensor& tensor) {
  absl::StatusOr<std::vector<float>> values = FloatValues(tensor);
  EXPECT_TRUE(values.ok()) << values.status();
  return values.ok() ? *std::move(values) : std::vector<float>();
}

enum class Biases { kNone, kAll, kQueryAndOutputOnly };

// Writes `contents` to `path`; false if it could not.
inline bool WriteFile(const std::filesystem::path& path,
                      const std::string& contents) {
  std::ofstream file(path, std::ios::binary);
  file << contents;
  return file.good();
}

// Writes `weights` as a --weights_dir folder: `config` as config.txt (none
// when empty) and one .npy of `descr` ('<f4' or '<f8') per tensor present.
// False if a file could not be written.
inline bool WriteWeightsFolder(const std::filesystem::path& folder,
                               const std::string& config,
                               const v1::ProjectionWeights& weights,
                               const std::string& descr) {
  std::filesystem::create_directories(folder);
  if (!config.empty() && !WriteFile(folder / "config.txt", config)) {
    return false;
  }
  const std::pair<const char*, const v1::Tensor*> tensors[] = {
      {"w_q", weights.has_w_q() ? &weights.w_q() : nullptr},
      {"w_k", weights.has_w_k() ? &weights.w_k() : nullptr},
      {"w_v", weights.has_w_v() ? &weights.w_v() : nullptr},
      {"w_o", weights.has_w_o() ? &weights.w_o() : nullptr},
      {"b_q", weights.has_b_q() ? &weights.b_q() : nullptr},
      {"b_k", weights.has_b_k() ? &weights.b_k() : nullptr},
      {"b_v", weights.has_b_v() ? &weights.b_v() : nullptr},
      {"b_o", weights.has_b_o() ? &weights.b_o() : nullptr},
  };
  for (const auto& [file, tensor] : tensors) {
    if (tensor == nullptr) continue;
    const std::vector<int64_t> shape(tensor->shape().begin(),
                                     tensor->shape().end());
    if (!WriteFile(folder / absl::StrCat(file, ".npy"),
                   NpyBytes(descr, shape, ValuesOf(*tensor)))) {
      return false;
    }
  }
  return true;
}

// Projection weights for the dimensions of `s` (B, Lq and Lk unused): Q and K
// in [-1, 1) so that the softmax is not flat, V and O scaled like
// nn.Linear's init so that outputs stay near 1.
inline v1::ProjectionWeights MakeWeights(const ReferenceMhaShape& s,
                                         uint64_t seed,
                                         Biases biases = Biases::kAll,
                                         v1::DType dtype = v1::FLOAT32) {
  const int64_t q_out = s.heads * s.key_dim;
  const int64_t k_out = s.kv_heads * s.key_dim;
  const int64_t v_out = s.kv_heads * s.value_dim;
  const int64_t o_in = s.heads * s.value_dim;
  v1::ProjectionWeights w;
  w.set_num_heads(s.heads);
  w.set_num_kv_heads(s.kv_heads);
  *w.mutable_w_q() = RandomTensor(dtype, {q_out, s.embed_dim}, seed, 1.0f);
  *w.mutable_w_k() =
      RandomTensor(dtype, {k_out, s.kv_embed_dim}, seed + 1, 1.0f);
  *w.mutable_w_v() =
      RandomTensor(dtype, {v_out, s.kv_embed_dim}, seed + 2,
                   1.0f / std::sqrt(static_cast<float>(s.kv_embed_dim)));
  *w.mutable_w_o() = RandomTensor(dtype, {s.embed_dim, o_in}, seed + 3,
                                  1.0f / std::sqrt(static_cast<float>(o_in)));
  if (biases != Biases::kNone) {
    *w.mutable_b_q() = RandomTensor(dtype, {q_out}, seed + 4, 0.5f);
    *w.mutable_b_o() = RandomTensor(dtype, {s.embed_dim}, seed + 7, 0.5f);
  }
  if (biases == Biases::kAll) {
    *w.mutable_b_k() = RandomTensor(dtype, {k_out}, seed + 5, 0.5f);
    *w.mutable_b_v() = RandomTensor(dtype, {v_out}, seed + 6, 0.5f);
  }
  return w;
}

// The reference's view of `w`: the values the server receives, after any
// rounding to the tensors' dtype.
inline ReferenceMhaWeights ReferenceWeightsOf(const v1::ProjectionWeights& w) {
  ReferenceMhaWeights r;
  r.w_q = ValuesOf(w.w_q());
  r.w_k = ValuesOf(w.w_k());
  r.w_v = ValuesOf(w.w_v());
  r.w_o = ValuesOf(w.w_o());
  if (w.has_b_q()) r.b_q = ValuesOf(w.b_q());
  if (w.has_b_k()) r.b_k = ValuesOf(w.b_k());
  if (w.has_b_v()) r.b_v = ValuesOf(w.b_v());
  if (w.has_b_o()) r.b_o = ValuesOf(w.b_o());
  return r;
}

// query_input [B, Lq, E] and, for cross-attention, kv_input [B, Lk, Ekv];
// no weights source yet.
inline v1::MultiHeadAttentionRequest MakeRequest(
    const ReferenceMhaShape& s, uint64_t seed, bool cross,
    v1::DType dtype = v1::FLOAT32) {
  v1::MultiHeadAttentionRequest request;
  *request.mutable_query_input() =
      RandomTensor(dtype, {s.batch, s.query_len, s.embed_dim}, seed, 1.0f);
  if (cross) {
    *request.mutable_kv_input() = RandomTensor(
        dtype, {s.batch, s.key_len, s.kv_embed_dim}, seed + 1, 1.0f);
  }
  return request;
}

inline ReferenceOptions ReferenceOptionsOf(const v1::AttentionOptions& proto) {
  ReferenceOptions options;
  if (proto.has_scale()) options.scale = proto.scale();
  options.causal = proto.causal();
  options.bottom_right =
      proto.causal_alignment() == v1::AttentionOptions::BOTTOM_RIGHT;
  options.key_lengths.assign(proto.key_lengths().begin(),
                             proto.key_lengths().end());
  return options;
}

// The reference's answer for `request` computed with weights `w`.
inline ReferenceResult Expected(const ReferenceMhaShape& s,
                                const v1::MultiHeadAttentionRequest& request,
                                const v1::ProjectionWeights& w) {
  std::optional<::attnserve::testing::ReferenceRope> rope;
  if (w.has_rope()) {
    rope.emplace();
    rope->theta = w.rope().theta() == 0.0f ? 10000.0 : w.rope().theta();
    rope->rotary_dim = w.rope().rotary_dim();
    rope->interleaved = w.rope().interleaved();
    const auto& options = request.options();
    rope->query_positions.assign(options.query_positions().begin(),
                                 options.query_positions().end());
    rope->key_positions.assign(options.key_positions().begin(),
                               options.key_positions().end());
  }
  return ReferenceMultiHeadAttention(
      s, ValuesOf(request.query_input()),
      request.has_kv_input() ? ValuesOf(request.kv_input())
                             : std::vector<float>(),
      ReferenceWeightsOf(w), ReferenceOptionsOf(request.options()), rope);
}

inline void ExpectNear(const v1::Tensor& actual_tensor,
                       const std::vector<double>& expected, double abs,
                       double rel, const std::string& what) {
  absl::StatusOr<std::vector<float>> actual = FloatValues(actual_tensor);
  ASSERT_TRUE(actual.ok()) << what << ": " << actual.status();
  ASSERT_EQ(actual->size(), expected.size()) << what;
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_NEAR((*actual)[i], expected[i], abs + rel * std::abs(expected[i]))
        << what << " index " << i;
  }
}

inline std::vector<std::string> NamesOf(const v1::ListWeightsResponse& list) {
  std::vector<std::string> names;
  for (const v1::WeightsInfo& info : list.weights())
    names.push_back(info.name());
  return names;
}

// Expects `info` to describe weights of the dimensions of `s`.
inline void ExpectDims(const v1::WeightsInfo& info, const ReferenceMhaShape& s,
                       bool has_bias) {
  SCOPED_TRACE(info.name());
  EXPECT_EQ(info.num_heads(), s.heads);
  EXPECT_EQ(info.num_kv_heads(), s.kv_heads);
  EXPECT_EQ(info.embed_dim(), s.embed_dim);
  EXPECT_EQ(info.kv_embed_dim(), s.kv_embed_dim);
  EXPECT_EQ(info.key_dim(), s.key_dim);
  EXPECT_EQ(info.value_dim(), s.value_dim);
  EXPECT_EQ(info.has_bias(), has_bias);
  EXPECT_GT(info.version(), 0);
  EXPECT_GT(info.bytes(), 0);
}

inline v1::PutWeightsRequest PutRequest(const std::string& name,
                                        const v1::ProjectionWeights& weights) {
  v1::PutWeightsRequest request;
  request.set_name(name);
  *request.mutable_weights() = weights;
  return request;
}

// Self-attention shape: E == Ekv, Lq == Lk.
inline constexpr ReferenceMhaShape kSelfShape{
    /*batch=*/2,        /*query_len=*/5,
    /*key_len=*/5,      /*embed_dim=*/8,
    /*kv_embed_dim=*/8, /*heads=*/2,
    /*kv_heads=*/2,     /*key_dim=*/4,
    /*value_dim=*/4};

// Cross-attention, grouped-query, Dv != Dk, Ekv != E, Lk != Lq.
inline constexpr ReferenceMhaShape kCrossShape{
    /*batch=*/2,        /*query_len=*/3,
    /*key_len=*/7,      /*embed_dim=*/8,
    /*kv_embed_dim=*/6, /*heads=*/4,
    /*kv_heads=*/2,     /*key_dim=*/2,
    /*value_dim=*/3};

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_SERVER_WEIGHTS_HELPERS_H_
