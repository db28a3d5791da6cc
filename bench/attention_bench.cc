// Attention throughput next to the same run's oneDNN GEMM rate.
//
//   build/bench/attention_bench [--benchmark_filter=...]
//   [--benchmark_repetitions=N]
//
// Each benchmark reports FLOP/s: a GEMM counts 2·M·N·K, attention 4·B·H·Lq·Lk·D
// (the FlashAttention convention, D = (Dk + Dv) / 2). After the runs, a summary
// prints each attention shape's median rate as a ratio of the median f32 GEMM
// rate, the practical ceiling on this machine. Absolute rates drift on shared
// machines; the ratios are what BENCHMARKS.md records.
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "attnserve/core/attention_engine.h"
#include "benchmark/benchmark.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve {
namespace {

constexpr char kGemmName[] = "BM_OneDnnGemmF32";

std::vector<float> Filled(int64_t count, float value) {
  return std::vector<float>(static_cast<size_t>(count), value);
}

// The ceiling: one square f32 matmul through oneDNN, primitive built once.
void BM_OneDnnGemmF32(benchmark::State& state) {
  const int64_t n = state.range(0);
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const dnnl::memory::desc md({n, n}, dnnl::memory::data_type::f32,
                              dnnl::memory::format_tag::ab);
  std::vector<float> a = Filled(n * n, 0.5f), b = Filled(n * n, 0.25f),
                     c = Filled(n * n, 0.0f);
  dnnl::memory a_mem(md, engine, a.data()), b_mem(md, engine, b.data()),
      c_mem(md, engine, c.data());
  dnnl::matmul matmul(
      dnnl::matmul::primitive_desc(dnnl::matmul::desc(md, md, md), engine));
  for (auto _ : state) {
    matmul.execute(stream, {{DNNL_ARG_SRC, a_mem},
                            {DNNL_ARG_WEIGHTS, b_mem},
                            {DNNL_ARG_DST, c_mem}});
    stream.wait();
  }
  state.counters["FLOPS"] = benchmark::Counter(
      2.0 * n * n * n, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_OneDnnGemmF32)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// SDPA with B, H (= Hkv), Lq, Lk, D (= Dk = Dv) from the arguments, at
// `precision`.
void RunAttention(benchmark::State& state, Precision precision) {
  AttentionShape shape;
  shape.batch = state.range(0);
  shape.heads = shape.kv_heads = state.range(1);
  shape.query_len = state.range(2);
  shape.key_len = state.range(3);
  shape.key_dim = shape.value_dim = state.range(4);
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(EngineOptions{}).value();
  const std::vector<float> query = Filled(shape.QueryElements(), 0.01f);
  const std::vector<float> key = Filled(shape.KeyElements(), 0.02f);
  const std::vector<float> value = Filled(shape.ValueElements(), 0.03f);
  std::vector<float> output = Filled(shape.OutputElements(), 0.0f);
  AttentionOptions options;
  options.precision = precision;
  for (auto _ : state) {
    const absl::Status status = engine->Attend(shape, options, query, key,
                                               value, absl::MakeSpan(output));
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      break;
    }
  }
  const double flops = 4.0 * shape.batch * shape.heads * shape.query_len *
                       shape.key_len * static_cast<double>(shape.key_dim);
  state.counters["FLOPS"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}
void BM_AttentionF32(benchmark::State& state) {
  RunAttention(state, Precision::kFloat32);
}
void BM_AttentionBF16(benchmark::State& state) {
  RunAttention(state, Precision::kBFloat16);
}

BENCHMARK(BM_AttentionBF16)
    ->ArgNames({"B", "H", "Lq", "Lk", "D"})
    ->Args({1, 8, 512, 512, 64})
    ->Args({1, 16, 2048, 2048, 128})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK(BM_AttentionF32)
    ->ArgNames({"B", "H", "Lq", "Lk", "D"})
    ->Args({4, 16, 128, 128, 64})
    ->Args({1, 8, 512, 512, 64})
    ->Args({1, 8, 2048, 2048, 64})
    ->Args({1, 16, 2048, 2048, 128})
    ->Args({8, 32, 1, 4096, 128})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Self-attention MHA with B, L, E, H (Dk = Dv = E / H) from the arguments,
// weights stacked for the fused QKV projection as the registry keeps them.
// FLOPs count the projections (2·B·L·E·4E) and the attention (4·B·H·L²·Dk).
void BM_MultiHeadSelfAttentionF32(benchmark::State& state) {
  MultiHeadShape shape;
  shape.batch = state.range(0);
  shape.query_len = shape.key_len = state.range(1);
  shape.embed_dim = shape.kv_embed_dim = state.range(2);
  shape.heads = shape.kv_heads = state.range(3);
  shape.key_dim = shape.value_dim = shape.embed_dim / shape.heads;
  const int64_t e = shape.embed_dim;
  const std::vector<float> w = Filled(e * e, 0.01f),
                           w_qkv = Filled(3 * e * e, 0.01f);
  const std::vector<float> input =
      Filled(shape.batch * shape.query_len * e, 0.5f);
  std::vector<float> output = Filled(shape.batch * shape.query_len * e, 0.0f);
  ProjectionWeights weights;
  weights.w_q = weights.w_k = weights.w_v = weights.w_o = w;
  weights.w_qkv = w_qkv;
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(EngineOptions{}).value();
  for (auto _ : state) {
    const absl::Status status = engine->MultiHeadAttention(
        shape, weights, {}, input, {}, absl::MakeSpan(output));
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      break;
    }
  }
  const double tokens = static_cast<double>(shape.batch * shape.query_len);
  const double flops = 2.0 * tokens * e * 4 * e +
                       4.0 * tokens * shape.query_len * static_cast<double>(e);
  state.counters["FLOPS"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_MultiHeadSelfAttentionF32)
    ->ArgNames({"B", "L", "E", "H"})
    ->Args({8, 128, 512, 8})
    ->Args({1, 1024, 1024, 16})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Prints the console table as usual and keeps each benchmark's median FLOP/s
// for the summary.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      const bool is_median =
          run.run_type == Run::RT_Aggregate && run.aggregate_name == "median";
      const bool single =
          run.run_type == Run::RT_Iteration && run.repetitions <= 1;
      auto flops = run.counters.find("FLOPS");
      if ((is_median || single) && flops != run.counters.end() &&
          !run.error_occurred) {
        medians_[run.run_name.str()] = flops->second.value;
      }
    }
  }

  void PrintSummary() const {
    double gemm = 0.0;
    for (const auto& [name, rate] : medians_) {
      if (name.rfind(kGemmName, 0) == 0) gemm = rate;
    }
    std::printf("\n%-58s %12s %14s\n", "median of repetitions", "GFLOP/s",
                "ratio to GEMM");
    for (const auto& [name, rate] : medians_) {
      std::printf(
          "%-58s %12.1f %14s\n", name.c_str(), rate / 1e9,
          gemm > 0 ? std::to_string(rate / gemm).substr(0, 5).c_str() : "n/a");
    }
  }

 private:
  std::map<std::string, double> medians_;
};

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  // Five repetitions by default (the performance method's minimum); a flag
  // given later wins.
  std::vector<char*> args(argv, argv + argc);
  char repetitions[] = "--benchmark_repetitions=5";
  args.insert(args.begin() + 1, repetitions);
  int count = static_cast<int>(args.size());
  benchmark::Initialize(&count, args.data());
  if (benchmark::ReportUnrecognizedArguments(count, args.data())) return 2;
  attnserve::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintSummary();
  benchmark::Shutdown();
  return 0;
}
