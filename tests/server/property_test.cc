// Property test: random Attend configurations — shapes with 1 and odd sizes,
// every option, every dtype and precision — through the server, against the
// double-precision reference, within the tolerances docs/api.md documents, on
// each SDPA path (fused, its portable fallback, unfused). A failure prints the
// seed that reproduces it:
//   ATTNSERVE_PROPERTY_SEED=<seed> build/tests/property_test
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"
#include "reference/tolerance.h"
#include "server/server_fixture.h"

namespace attnserve {
namespace {

using ::attnserve::testing::ExpectNear;
using ::attnserve::testing::kLseBf16;
using ::attnserve::testing::kLseF32;
using ::attnserve::testing::kOutputBf16;
using ::attnserve::testing::kOutputF32;
using ::attnserve::testing::ReferenceAttention;
using ::attnserve::testing::ReferenceMask;
using ::attnserve::testing::ReferenceOptions;
using ::attnserve::testing::ReferenceResult;
using ::attnserve::testing::ReferenceShape;
using ::attnserve::testing::Tolerance;

constexpr int kConfigurations = 240;

// The compute's error, by precision; then the rounding of the result to its
// dtype.
Tolerance ToleranceFor(v1::AttentionOptions::Precision precision,
                       v1::DType output_dtype) {
  Tolerance t =
      precision == v1::AttentionOptions::BF16 ? kOutputBf16 : kOutputF32;
  if (output_dtype == v1::BFLOAT16) t.rel += 1.0 / 256;  // 8 significant bits.
  if (output_dtype == v1::FLOAT16) t.rel += 1.0 / 2048;  // 11 significant bits.
  if (output_dtype != v1::FLOAT32)
    t.abs += 1e-4;  // f16 subnormal steps near 0.
  return t;
}

struct Configuration {
  ReferenceShape shape;
  v1::AttendRequest request;
  ReferenceOptions reference;
  std::string description;
};

template <typename T>
T Pick(std::mt19937_64& rng, std::initializer_list<T> choices) {
  std::uniform_int_distribution<size_t> index(0, choices.size() - 1);
  return *(choices.begin() + index(rng));
}

bool Chance(std::mt19937_64& rng, double p) {
  return std::uniform_real_distribution<double>(0, 1)(rng) < p;
}

std::vector<float> Uniform(std::mt19937_64& rng, int64_t count, float low,
                           float high) {
  std::uniform_real_distribution<float> distribution(low, high);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& v : values) v = distribution(rng);
  return values;
}

// Draws one configuration. The reference sees exactly the values the request
// carries (inputs rounded to their dtype are read back from the request).
Configuration Draw(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Configuration c;
  ReferenceShape& s = c.shape;
  s.batch = Pick<int64_t>(rng, {1, 2, 3});
  s.kv_heads = Pick<int64_t>(rng, {1, 2, 3});
  s.heads = s.kv_heads * Pick<int64_t>(rng, {1, 2, 3});
  // Mostly small; sometimes across the fused kernel's tile boundaries (query
  // blocks of 64 rows per kv-head group, key blocks of 256).
  if (Chance(rng, 0.2)) {
    s.query_len = Pick<int64_t>(rng, {31, 32, 33, 63, 64, 65});
    s.key_len = Pick<int64_t>(rng, {255, 256, 257, 511, 513});
  } else {
    s.query_len = Pick<int64_t>(rng, {1, 2, 3, 5, 17, 33});
    s.key_len = Pick<int64_t>(rng, {1, 2, 3, 7, 17, 40});
  }
  s.key_dim = Pick<int64_t>(rng, {1, 3, 8, 16, 33});
  s.value_dim = Pick<int64_t>(rng, {1, 4, 8, 17});
  const v1::DType dtype = Pick(rng, {v1::FLOAT32, v1::BFLOAT16, v1::FLOAT16});

  v1::AttendRequest& r = c.request;
  *r.mutable_query() = MakeTensor(
      dtype, {s.batch, s.heads, s.query_len, s.key_dim},
      Uniform(rng, s.batch * s.heads * s.query_len * s.key_dim, -1, 1));
  *r.mutable_key() = MakeTensor(
      dtype, {s.batch, s.kv_heads, s.key_len, s.key_dim},
      Uniform(rng, s.batch * s.kv_heads * s.key_len * s.key_dim, -1, 1));
  *r.mutable_value() = MakeTensor(
      dtype, {s.batch, s.kv_heads, s.key_len, s.value_dim},
      Uniform(rng, s.batch * s.kv_heads * s.key_len * s.value_dim, -1, 1));

  v1::AttentionOptions& o = *r.mutable_options();
  ReferenceOptions& ref = c.reference;
  if (Chance(rng, 0.4)) {
    o.set_scale(Uniform(rng, 1, 0.25f, 2.0f)[0] /
                std::sqrt(static_cast<float>(s.key_dim)));
    ref.scale = o.scale();
  }
  if (Chance(rng, 0.4)) {
    o.set_causal(true);
    ref.causal = true;
    ref.bottom_right = Chance(rng, 0.5);
    o.set_causal_alignment(ref.bottom_right ? v1::AttentionOptions::BOTTOM_RIGHT
                                            : v1::AttentionOptions::TOP_LEFT);
  }
  if (Chance(rng, 0.35)) {
    for (int64_t b = 0; b < s.batch; ++b) {
      const int64_t length =
          std::uniform_int_distribution<int64_t>(0, s.key_len)(rng);
      o.add_key_lengths(length);
      ref.key_lengths.push_back(length);
    }
  }
  if (Chance(rng, 0.45)) {
    // A broadcast pattern: each of [B, H, Lq, Lk] kept or 1, then leading 1s
    // dropped.
    std::vector<int64_t> dims = {
        Chance(rng, 0.5) ? s.batch : 1, Chance(rng, 0.5) ? s.heads : 1,
        Chance(rng, 0.6) ? s.query_len : 1, Chance(rng, 0.8) ? s.key_len : 1};
    const size_t drop = std::uniform_int_distribution<size_t>(0, 3)(rng);
    size_t leading_ones = 0;
    while (leading_ones < drop && dims[leading_ones] == 1) ++leading_ones;
    dims.erase(dims.begin(), dims.begin() + leading_ones);
    int64_t count = 1;
    for (int64_t d : dims) count *= d;
    ReferenceMask mask;
    mask.shape = dims;
    if (Chance(rng, 0.5)) {
      std::vector<bool> allowed;
      for (int64_t i = 0; i < count; ++i) allowed.push_back(Chance(rng, 0.75));
      *o.mutable_attn_mask() = MakeBoolTensor(dims, allowed);
      for (bool a : allowed) mask.allowed.push_back(a ? 1 : 0);
    } else {
      std::vector<float> bias = Uniform(rng, count, -2, 2);
      for (float& b : bias) {
        if (Chance(rng, 0.1)) b = -std::numeric_limits<float>::infinity();
      }
      *o.mutable_attn_mask() = MakeTensor(
          Pick(rng, {v1::FLOAT32, v1::BFLOAT16, v1::FLOAT16}), dims, bias);
      mask.bias = FloatValues(o.attn_mask()).value();
    }
    ref.mask = mask;
  }
  o.set_return_weights(
      Pick(rng, {v1::AttentionOptions::NONE, v1::AttentionOptions::PER_HEAD,
                 v1::AttentionOptions::HEAD_MEAN}));
  o.set_return_lse(Chance(rng, 0.5));
  o.set_precision(Chance(rng, 0.5) ? v1::AttentionOptions::BF16
                                   : v1::AttentionOptions::F32);
  if (Chance(rng, 0.3))
    o.set_output_dtype(Pick(rng, {v1::FLOAT32, v1::BFLOAT16, v1::FLOAT16}));
  // The variants: window, sinks, ALiBi, softcap (and the alignment that
  // places them without causality).
  if (!o.causal() && Chance(rng, 0.3)) {
    o.set_causal_alignment(v1::AttentionOptions::BOTTOM_RIGHT);
    ref.bottom_right = true;
  }
  if (Chance(rng, 0.3)) {
    if (Chance(rng, 0.8)) {
      o.set_window_left(Pick<int64_t>(rng, {-1, 0, 1, 4, 30, 300}));
      ref.window_left = o.window_left();
    }
    if (Chance(rng, 0.6)) {
      o.set_window_right(Pick<int64_t>(rng, {-1, 0, 2, 20}));
      ref.window_right = o.window_right();
    }
  }
  if (Chance(rng, 0.2)) {
    o.set_num_sink_tokens(Pick<int64_t>(rng, {1, 3, 100}));
    ref.num_sink_tokens = o.num_sink_tokens();
  }
  if (Chance(rng, 0.25)) {
    const std::vector<float> slopes = Uniform(rng, s.heads, -0.2f, 0.6f);
    *o.mutable_alibi_slopes() = MakeTensor(v1::FLOAT32, {s.heads}, slopes);
    ref.alibi_slopes.assign(slopes.begin(), slopes.end());
  }
  if (Chance(rng, 0.25)) {
    o.set_softcap(Pick(rng, {0.7f, 4.0f, 50.0f}));
    ref.softcap = o.softcap();
  }

  std::ostringstream d;
  d << "seed " << seed << ": B=" << s.batch << " H=" << s.heads
    << " Hkv=" << s.kv_heads << " Lq=" << s.query_len << " Lk=" << s.key_len
    << " Dk=" << s.key_dim << " Dv=" << s.value_dim
    << " dtype=" << v1::DType_Name(dtype) << " options={"
    << o.ShortDebugString().substr(0, 300) << "}";
  c.description = d.str();
  return c;
}

// The server's SDPA path: the fused kernel (AVX-512 where the CPU has it), its
// portable fallback, or the unfused path.
struct Path {
  const char* name;
  AttentionKernel kernel;
  bool portable;
};

class PropertyTest : public ::attnserve::testing::ServerFixture,
                     public ::testing::WithParamInterface<Path> {
 protected:
  void SetUp() override {
    ServerOptions options = DefaultOptions();
    options.engine.kernel = GetParam().kernel;
    options.engine.portable_kernels = GetParam().portable;
    StartServer(options);
  }
};

TEST_P(PropertyTest, RandomConfigurationsMatchReference) {
  uint64_t first_seed = 1000;
  int count = kConfigurations;
  if (const char* seed = std::getenv("ATTNSERVE_PROPERTY_SEED")) {
    first_seed = std::strtoull(seed, nullptr, 10);
    count = 1;
  }
  for (int n = 0; n < count; ++n) {
    const Configuration c = Draw(first_seed + static_cast<uint64_t>(n));
    SCOPED_TRACE(c.description);
    absl::StatusOr<v1::AttendResponse> response =
        client_->Attend(c.request, absl::Seconds(60));
    ASSERT_TRUE(response.ok()) << response.status();
    const ReferenceResult expected =
        ReferenceAttention(c.shape, FloatValues(c.request.query()).value(),
                           FloatValues(c.request.key()).value(),
                           FloatValues(c.request.value()).value(), c.reference);
    const v1::AttentionOptions& o = c.request.options();
    const v1::DType output_dtype = o.output_dtype() == v1::DTYPE_UNSPECIFIED
                                       ? c.request.query().dtype()
                                       : o.output_dtype();
    const Tolerance tolerance = ToleranceFor(o.precision(), output_dtype);
    ASSERT_EQ(response->output().dtype(), output_dtype);
    ExpectNear("output", FloatValues(response->output()).value(),
               expected.output, tolerance);
    const ReferenceShape& s = c.shape;
    if (o.return_weights() == v1::AttentionOptions::PER_HEAD) {
      ExpectNear("weights", FloatValues(response->weights()).value(),
                 expected.weights, tolerance);
    } else if (o.return_weights() == v1::AttentionOptions::HEAD_MEAN) {
      ExpectNear(
          "head-mean weights", FloatValues(response->weights()).value(),
          ::attnserve::testing::HeadMean(expected.weights, s.batch, s.heads,
                                         s.query_len, s.key_len),
          tolerance);
    } else {
      EXPECT_FALSE(response->has_weights());
    }
    if (o.return_lse()) {
      ExpectNear(
          "lse", FloatValues(response->lse()).value(), expected.lse,
          o.precision() == v1::AttentionOptions::BF16 ? kLseBf16 : kLseF32);
    } else {
      EXPECT_FALSE(response->has_lse());
    }
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Packed sequences over the wire: ragged lengths (a sequence without keys
// among them) with the variants, each sequence against the reference alone.
TEST_P(PropertyTest, PackedSequencesMatchTheReferenceOneByOne) {
  std::mt19937_64 rng(2213);
  for (int round = 0; round < 12; ++round) {
    const int64_t hkv = Pick<int64_t>(rng, {1, 2});
    const int64_t h = hkv * Pick<int64_t>(rng, {1, 2});
    const int64_t dk = Pick<int64_t>(rng, {4, 16}),
                  dv = Pick<int64_t>(rng, {3, 8});
    std::vector<int64_t> cu_q = {0}, cu_k = {0};
    const int64_t sequences = Pick<int64_t>(rng, {1, 3, 4});
    for (int64_t s = 0; s < sequences; ++s) {
      cu_q.push_back(cu_q.back() + Pick<int64_t>(rng, {1, 2, 9, 30}));
      cu_k.push_back(cu_k.back() + Pick<int64_t>(rng, {0, 1, 9, 40}));
    }
    if (cu_k.back() == 0) cu_k.back() = 1;  // every tensor holds a row
    const v1::DType dtype = Pick(rng, {v1::FLOAT32, v1::BFLOAT16});
    v1::AttendRequest request;
    *request.mutable_query() = MakeTensor(
        dtype, {cu_q.back(), h, dk}, Uniform(rng, cu_q.back() * h * dk, -1, 1));
    *request.mutable_key() =
        MakeTensor(dtype, {cu_k.back(), hkv, dk},
                   Uniform(rng, cu_k.back() * hkv * dk, -1, 1));
    *request.mutable_value() =
        MakeTensor(dtype, {cu_k.back(), hkv, dv},
                   Uniform(rng, cu_k.back() * hkv * dv, -1, 1));
    v1::AttentionOptions& o = *request.mutable_options();
    for (const int64_t x : cu_q) o.add_cu_seqlens_q(x);
    for (const int64_t x : cu_k) o.add_cu_seqlens_k(x);
    ReferenceOptions ref;
    o.set_causal(Chance(rng, 0.5));
    ref.causal = o.causal();
    ref.bottom_right = Chance(rng, 0.5);
    o.set_causal_alignment(ref.bottom_right ? v1::AttentionOptions::BOTTOM_RIGHT
                                            : v1::AttentionOptions::TOP_LEFT);
    if (Chance(rng, 0.5)) {
      o.set_window_left(Pick<int64_t>(rng, {0, 2, 10}));
      ref.window_left = o.window_left();
    }
    if (Chance(rng, 0.5)) {
      const std::vector<float> slopes = Uniform(rng, h, 0.0f, 0.5f);
      *o.mutable_alibi_slopes() = MakeTensor(v1::FLOAT32, {h}, slopes);
      ref.alibi_slopes.assign(slopes.begin(), slopes.end());
    }
    o.set_return_lse(true);
    SCOPED_TRACE(absl::StrCat("round ", round, ": ", o.ShortDebugString()));
    absl::StatusOr<v1::AttendResponse> response =
        client_->Attend(request, absl::Seconds(60));
    ASSERT_TRUE(response.ok()) << response.status();
    const int64_t total_q = cu_q.back();
    ASSERT_EQ(response->output().shape_size(), 3);
    ASSERT_EQ(response->lse().shape(0), h);
    ASSERT_EQ(response->lse().shape(1), total_q);
    const std::vector<float> q = FloatValues(request.query()).value();
    const std::vector<float> k = FloatValues(request.key()).value();
    const std::vector<float> v = FloatValues(request.value()).value();
    const std::vector<float> out = FloatValues(response->output()).value();
    const std::vector<float> lse = FloatValues(response->lse()).value();
    for (int64_t s = 0; s < sequences; ++s) {
      const int64_t q0 = cu_q[s], lq = cu_q[s + 1] - q0;
      const int64_t k0 = cu_k[s], lk = cu_k[s + 1] - k0;
      std::vector<float> got = ::attnserve::testing::PackedRowsAsHeads(
                             out, q0, lq, h, dv),
                         got_lse;
      for (int64_t hh = 0; hh < h; ++hh) {
        got_lse.insert(got_lse.end(), lse.begin() + hh * total_q + q0,
                       lse.begin() + hh * total_q + q0 + lq);
      }
      std::vector<double> want(got.size(), 0.0);
      std::vector<double> want_lse(got_lse.size(),
                                   -std::numeric_limits<double>::infinity());
      if (lk > 0) {
        const ReferenceResult r = ReferenceAttention(
            {1, h, hkv, lq, lk, dk, dv},
            ::attnserve::testing::PackedRowsAsHeads(q, q0, lq, h, dk),
            ::attnserve::testing::PackedRowsAsHeads(k, k0, lk, hkv, dk),
            ::attnserve::testing::PackedRowsAsHeads(v, k0, lk, hkv, dv), ref);
        want = r.output;
        want_lse = r.lse;
      }
      SCOPED_TRACE(absl::StrCat("sequence ", s, ": Lq ", lq, " Lk ", lk));
      ExpectNear("output", got, want,
                 ToleranceFor(v1::AttentionOptions::F32, dtype));
      ExpectNear("lse", got_lse, want_lse, kLseF32);
      if (HasFatalFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Paths, PropertyTest,
    ::testing::Values(Path{"Fused", AttentionKernel::kAuto, false},
                      Path{"FusedPortable", AttentionKernel::kAuto, true},
                      Path{"Unfused", AttentionKernel::kUnfused, false}),
    [](const ::testing::TestParamInfo<Path>& param) {
      return param.param.name;
    });

}  // namespace
}  // namespace attnserve
