// Every oneDNN primitive the engine executes, on every path (fused and
// unfused SDPA, MHA with and without weights, f32 and bf16), runs on the
// fastest kernel oneDNN 2.6 has for the CPU. With AVX-512 that is a brgemm
// kernel: oneDNN's verbose log (dnnl_set_verbose) shows no "ref:" and no
// "gemm:jit" implementation, the slow ones it falls back to for layouts brgemm
// does not take. Without AVX-512 oneDNN 2.6 has no brgemm matmul at all, and
// its JIT sgemm ("gemm:jit") is the fast one; "ref:" is never accepted.
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "attnserve/core/attention_engine.h"
#include "core/sdpa_shape.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "oneapi/dnnl/dnnl.h"
#include "reference/reference_attention.h"

namespace attnserve {
namespace {

using ::attnserve::testing::RandomValues;
using ::attnserve::testing::SdpaShape;

// The implementation names of the primitives `body` executes, one per line.
template <typename Body>
std::vector<std::string> ExecutedImplementations(Body body) {
  ::testing::internal::CaptureStdout();
  EXPECT_EQ(dnnl_set_verbose(1), dnnl_success);
  body();
  EXPECT_EQ(dnnl_set_verbose(0), dnnl_success);
  std::fflush(stdout);
  const std::string log = ::testing::internal::GetCapturedStdout();
  std::vector<std::string> implementations;
  std::istringstream lines(log);
  std::string line;
  while (std::getline(lines, line)) {
    // onednn_verbose,exec,cpu,matmul,<implementation>,...
    if (line.rfind("onednn_verbose,exec,", 0) != 0) continue;
    std::vector<std::string> fields;
    std::istringstream parts(line);
    std::string field;
    while (std::getline(parts, field, ',')) fields.push_back(field);
    if (fields.size() > 4) implementations.push_back(fields[4]);
  }
  return implementations;
}

bool HasAvx512Core() {
  return (dnnl_get_effective_cpu_isa() & dnnl_cpu_isa_avx512_core) ==
         dnnl_cpu_isa_avx512_core;
}

void ExpectOnlyBrgemm(const std::vector<std::string>& implementations) {
  ASSERT_FALSE(implementations.empty())
      << "no oneDNN primitive ran: the verbose log was not captured";
  for (const std::string& name : implementations) {
    if (HasAvx512Core()) {
      EXPECT_THAT(name, ::testing::StartsWith("brg:")) << "a slow fallback ran";
    } else {
      EXPECT_EQ(name, "gemm:jit")
          << "a slow fallback ran on a CPU without AVX-512";
    }
  }
}

class OneDnnImplementationTest : public ::testing::TestWithParam<Precision> {};

TEST_P(OneDnnImplementationTest, SdpaOnBothPaths) {
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(EngineOptions{}).value();
  for (const AttentionShape& shape :
       {SdpaShape(2, 4, 4, 300, 300, 64), SdpaShape(1, 8, 2, 130, 520, 128)}) {
    SCOPED_TRACE(shape.DebugString());
    const std::vector<float> query = RandomValues(shape.QueryElements(), 1);
    const std::vector<float> key = RandomValues(shape.KeyElements(), 2);
    const std::vector<float> value = RandomValues(shape.ValueElements(), 3);
    std::vector<float> output(shape.OutputElements());
    std::vector<float> weights(shape.WeightsElements());
    AttentionOptions options;
    options.precision = GetParam();
    options.causal = true;
    ExpectOnlyBrgemm(ExecutedImplementations([&] {
      ASSERT_TRUE(engine
                      ->Attend(shape, options, query, key, value,
                               absl::MakeSpan(output))
                      .ok());
    }));
    options.weights = AttentionWeightsMode::kPerHead;  // The unfused path.
    ExpectOnlyBrgemm(ExecutedImplementations([&] {
      ASSERT_TRUE(engine
                      ->Attend(shape, options, query, key, value,
                               AttentionOutputs(absl::MakeSpan(output),
                                                absl::MakeSpan(weights)))
                      .ok());
    }));
  }
}

TEST_P(OneDnnImplementationTest, MultiHeadAttentionOnBothPaths) {
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(EngineOptions{}).value();
  MultiHeadShape shape;
  shape.batch = 2;
  shape.query_len = shape.key_len = 200;
  shape.embed_dim = shape.kv_embed_dim = 256;
  shape.heads = shape.kv_heads = 4;
  shape.key_dim = shape.value_dim = 64;
  const int64_t e = shape.embed_dim;
  const std::vector<float> w = RandomValues(e * e, 4);
  const std::vector<float> w_qkv = RandomValues(3 * e * e, 5);
  const std::vector<float> input =
      RandomValues(shape.batch * shape.query_len * e, 6);
  std::vector<float> output(input.size());
  std::vector<float> weights(shape.Heads().WeightsElements());
  ProjectionWeights projection;
  projection.w_q = projection.w_k = projection.w_v = projection.w_o = w;
  projection.w_qkv = w_qkv;
  AttentionOptions options;
  options.precision = GetParam();
  ExpectOnlyBrgemm(ExecutedImplementations([&] {
    ASSERT_TRUE(engine
                    ->MultiHeadAttention(shape, projection, options, input, {},
                                         absl::MakeSpan(output))
                    .ok());
  }));
  options.weights = AttentionWeightsMode::kPerHead;
  ExpectOnlyBrgemm(ExecutedImplementations([&] {
    ASSERT_TRUE(
        engine
            ->MultiHeadAttention(shape, projection, options, input, {},
                                 AttentionOutputs(absl::MakeSpan(output),
                                                  absl::MakeSpan(weights)))
            .ok());
  }));
}

INSTANTIATE_TEST_SUITE_P(Precisions, OneDnnImplementationTest,
                         ::testing::Values(Precision::kFloat32,
                                           Precision::kBFloat16),
                         [](const ::testing::TestParamInfo<Precision>& p) {
                           return p.param == Precision::kFloat32 ? "F32"
                                                                 : "BF16";
                         });

}  // namespace
}  // namespace attnserve
