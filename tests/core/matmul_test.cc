// core/internal/matmul.h: the class of shapes kept off oneDNN 2.6's AMX bf16
// matmul, the primitive descriptors made around it, and BF16 precision computed
// as f32 matmuls over bf16 values (the path of CPUs without a bf16 matmul,
// forced here so that every CPU checks it against the reference).
#include "internal/matmul.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "attnserve/core/attention_engine.h"
#include "core/sdpa_shape.h"
#include "gtest/gtest.h"
#include "internal/linear.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "reference/reference_attention.h"
#include "reference/tolerance.h"

namespace attnserve {
namespace {

using ::attnserve::internal::AvoidsAmxBf16Matmul;
using ::attnserve::internal::MakeMatmulPrimitiveDesc;
using ::attnserve::testing::ExpectNear;
using ::attnserve::testing::kOutputBf16;
using ::attnserve::testing::RandomValues;
using ::attnserve::testing::ReferenceAttention;
using ::attnserve::testing::ReferenceMhaShape;
using ::attnserve::testing::ReferenceMhaWeights;
using ::attnserve::testing::ReferenceMultiHeadAttention;
using ::attnserve::testing::ReferenceOptions;
using ::attnserve::testing::ReferenceResult;
using ::attnserve::testing::ReferenceShape;
using ::attnserve::testing::SdpaShape;
using dnnl::memory;

// RunLinear computes its rows in runs (512 rows here, of 2 · 2048 · 2048
// FLOPs each), polling the stop check between runs: every row, the last
// partial run's included, is x wᵀ + b; a check that says stop at its second
// poll leaves the third run's rows unwritten.
TEST(RunLinearTest, PollsBetweenRunsOfRowsAndStops) {
  internal::LinearProblem p;
  p.rows = 1100;
  p.in = p.out = 2048;
  ASSERT_EQ(internal::LinearRowsBetweenPolls(p), 512);
  const std::vector<float> x = RandomValues(p.rows * p.in, 71);
  const std::vector<float> w = RandomValues(p.out * p.in, 72);
  const std::vector<float> bias = RandomValues(p.out, 73);
  p.x = x.data();
  p.x_stride = p.in;
  p.w = w.data();
  p.bias = bias.data();
  p.y_stride = p.out;
  const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  for (const Precision precision :
       {Precision::kFloat32, Precision::kBFloat16}) {
    SCOPED_TRACE(precision == Precision::kBFloat16 ? "bf16" : "f32");
    std::vector<float> y(p.rows * p.out, -7.0f);
    p.y = y.data();
    dnnl::stream stream(engine);
    int polls = 0;
    ASSERT_TRUE(internal::RunLinear(engine, stream, p, precision, [&polls] {
                  ++polls;
                  return absl::OkStatus();
                }).ok());
    EXPECT_EQ(polls, 2);
    const auto round = [precision](float v) {
      if (precision == Precision::kFloat32) return static_cast<double>(v);
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;
      float rounded;
      std::memcpy(&rounded, &bits, 4);
      return static_cast<double>(rounded);
    };
    for (const int64_t row : {int64_t{0}, int64_t{511}, int64_t{512},
                              int64_t{1023}, int64_t{1024}, int64_t{1099}}) {
      for (const int64_t col : {int64_t{0}, int64_t{777}, int64_t{2047}}) {
        double expected = bias[col];
        for (int64_t k = 0; k < p.in; ++k) {
          expected += round(x[row * p.in + k]) * round(w[col * p.in + k]);
        }
        ASSERT_NEAR(y[row * p.out + col], expected, 1e-3)
            << "row " << row << " col " << col;
      }
    }
    std::fill(y.begin(), y.end(), -7.0f);
    polls = 0;
    const absl::Status stopped =
        internal::RunLinear(engine, stream, p, precision, [&polls] {
          return ++polls >= 2 ? absl::CancelledError("stopped by the test")
                              : absl::OkStatus();
        });
    EXPECT_EQ(stopped.code(), absl::StatusCode::kCancelled) << stopped;
    EXPECT_NE(y[1023 * p.out], -7.0f);
    EXPECT_EQ(y[1024 * p.out], -7.0f);
    EXPECT_EQ(y[1099 * p.out + 2047], -7.0f);
  }
}

TEST(AvoidsAmxBf16MatmulTest, EveryReductionThatIsNotWholeTileRows) {
  struct Case {
    int64_t m, k, n;
    bool avoided;
  };
  for (const Case& c :
       {Case{33, 63, 4, true}, Case{65, 63, 2, true}, Case{1, 1, 1, true},
        Case{64, 31, 64, true}, Case{64, 33, 64, true}, Case{129, 65, 64, true},
        Case{33, 32, 4, false}, Case{65, 64, 2, false}, Case{1, 128, 1, false},
        Case{300, 4096, 4096, false}}) {
    SCOPED_TRACE(::testing::Message()
                 << "m=" << c.m << " k=" << c.k << " n=" << c.n);
    EXPECT_EQ(AvoidsAmxBf16Matmul(c.m, c.k, c.n), c.avoided);
  }
}

// A plain 3-D matmul [1, m, k] x [1, k, n] of `type` inputs.
dnnl::matmul::desc MatmulDesc(int64_t m, int64_t k, int64_t n,
                              memory::data_type type) {
  return dnnl::matmul::desc(
      memory::desc({1, m, k}, type, memory::format_tag::abc),
      memory::desc({1, k, n}, type, memory::format_tag::abc),
      memory::desc({1, m, n}, memory::data_type::f32, memory::format_tag::abc));
}

std::string Implementation(const dnnl::matmul::desc& desc, bool guarded) {
  const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return guarded ? MakeMatmulPrimitiveDesc(desc, {}, engine).impl_info_str()
                 : dnnl::matmul::primitive_desc(desc, engine).impl_info_str();
}

TEST(MakeMatmulPrimitiveDescTest, KeepsOneDnnsChoiceOutsideTheClass) {
  std::vector<memory::data_type> types = {memory::data_type::f32};
  if (internal::NativeBf16Matmuls()) types.push_back(memory::data_type::bf16);
  for (memory::data_type type : types) {
    for (int64_t k : {32, 64, 256}) {
      SCOPED_TRACE(::testing::Message() << "k=" << k);
      const dnnl::matmul::desc desc = MatmulDesc(33, k, 4, type);
      EXPECT_EQ(Implementation(desc, true), Implementation(desc, false));
    }
  }
  // f32 inside the class too: the guard touches only the AMX bf16 kernel.
  const dnnl::matmul::desc f32 = MatmulDesc(33, 63, 4, memory::data_type::f32);
  EXPECT_EQ(Implementation(f32, true), Implementation(f32, false));
}

TEST(MakeMatmulPrimitiveDescTest, TakesTheAvx512KernelInsideTheClassOnAmx) {
  if (dnnl::get_effective_cpu_isa() != dnnl::cpu_isa::avx512_core_amx) {
    GTEST_SKIP() << "this CPU has no AMX: oneDNN never picks its AMX bf16 "
                    "matmul here, so there is nothing to step over";
  }
  const auto bf16 = memory::data_type::bf16;
  // The first shape seen to crash: unguarded, oneDNN picks AMX for it.
  EXPECT_EQ(Implementation(MatmulDesc(33, 63, 4, bf16), false),
            internal::kAmxBf16MatmulImplementation);
  EXPECT_EQ(Implementation(MatmulDesc(33, 63, 4, bf16), true),
            "brg:avx512_core_bf16");
  EXPECT_EQ(Implementation(MatmulDesc(33, 64, 4, bf16), true),
            internal::kAmxBf16MatmulImplementation);
}

// BF16 precision on f32 matmuls over bf16 values, on every path, against the
// double-precision reference.
class Bf16AsF32MatmulsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    internal::EmulateBf16MatmulsForTesting(true);
    ASSERT_EQ(internal::MatmulInputFor(Precision::kBFloat16),
              internal::MatmulInput::kRoundedF32);
  }
  void TearDown() override { internal::EmulateBf16MatmulsForTesting(false); }
};

TEST_F(Bf16AsF32MatmulsTest, SdpaOnBothPathsMatchesReference) {
  for (AttentionKernel kernel :
       {AttentionKernel::kAuto, AttentionKernel::kUnfused}) {
    EngineOptions engine_options;
    engine_options.kernel = kernel;
    engine_options.num_threads = 2;
    std::unique_ptr<AttentionEngine> engine =
        AttentionEngine::Create(engine_options).value();
    for (const AttentionShape& s :
         {SdpaShape(2, 4, 2, 65, 63, 8, 4), SdpaShape(1, 8, 8, 130, 300, 64),
          SdpaShape(1, 16, 2, 1, 700, 64, 32)}) {
      SCOPED_TRACE(s.DebugString() +
                   (kernel == AttentionKernel::kAuto ? " fused" : " unfused"));
      const std::vector<float> query = RandomValues(s.QueryElements(), 1);
      const std::vector<float> key = RandomValues(s.KeyElements(), 2);
      const std::vector<float> value = RandomValues(s.ValueElements(), 3);
      std::vector<float> output(s.OutputElements());
      AttentionOptions options;
      options.precision = Precision::kBFloat16;
      options.causal = true;
      options.causal_alignment = CausalAlignment::kBottomRight;
      ASSERT_TRUE(
          engine->Attend(s, options, query, key, value, absl::MakeSpan(output))
              .ok());
      ReferenceOptions reference;
      reference.causal = true;
      reference.bottom_right = true;
      const ReferenceResult expected = ReferenceAttention(
          ReferenceShape{s.batch, s.heads, s.kv_heads, s.query_len, s.key_len,
                         s.key_dim, s.value_dim},
          query, key, value, reference);
      ExpectNear("output", output, expected.output, kOutputBf16);
    }
  }
}

TEST_F(Bf16AsF32MatmulsTest, MultiHeadAttentionMatchesReference) {
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(EngineOptions{}).value();
  MultiHeadShape s;
  s.batch = 2;
  s.query_len = s.key_len = 33;
  s.embed_dim = s.kv_embed_dim = 63;
  s.heads = 3;
  s.kv_heads = 1;
  s.key_dim = s.value_dim = 16;
  // Weights uniform in ±1/sqrt(fan in), as torch.nn.Linear draws them, so that
  // the softmax is neither flat nor saturated.
  const auto linear = [](int64_t out, int64_t in, uint64_t seed) {
    std::vector<float> w = RandomValues(out * in, seed);
    for (float& x : w) x /= std::sqrt(static_cast<float>(in));
    return w;
  };
  ReferenceMhaWeights w;
  w.w_q = linear(s.heads * s.key_dim, s.embed_dim, 4);
  w.w_k = linear(s.kv_heads * s.key_dim, s.embed_dim, 5);
  w.w_v = linear(s.kv_heads * s.value_dim, s.embed_dim, 6);
  w.w_o = linear(s.embed_dim, s.heads * s.value_dim, 7);
  w.b_o = RandomValues(s.embed_dim, 8);
  const std::vector<float> input =
      RandomValues(s.batch * s.query_len * s.embed_dim, 9);
  std::vector<float> output(input.size());
  ProjectionWeights projection;
  projection.w_q = w.w_q;
  projection.w_k = w.w_k;
  projection.w_v = w.w_v;
  projection.w_o = w.w_o;
  projection.b_o = w.b_o;
  AttentionOptions options;
  options.precision = Precision::kBFloat16;
  ASSERT_TRUE(engine
                  ->MultiHeadAttention(s, projection, options, input, {},
                                       absl::MakeSpan(output))
                  .ok());
  const ReferenceResult expected = ReferenceMultiHeadAttention(
      ReferenceMhaShape{s.batch, s.query_len, s.key_len, s.embed_dim,
                        s.kv_embed_dim, s.heads, s.kv_heads, s.key_dim,
                        s.value_dim},
      input, {}, w);
  ExpectNear("output", output, expected.output, kOutputBf16);
}

}  // namespace
}  // namespace attnserve
