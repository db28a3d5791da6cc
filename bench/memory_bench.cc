// Peak memory of one long SDPA: B=1, H=8, Lq=Lk=32768, D=64, f32, through the
// engine's default (fused) path. Its scores would take 32 GiB; the target is a
// peak resident set under 1.5 × (inputs + output) + 256 MiB.
//
//   build/bench/memory_bench [--benchmark_filter=...]
//
// One iteration per benchmark (about 15 s on 2 cores); the process's peak RSS
// (getrusage) is read after it and printed with the bound. Run it as its own
// process: peak RSS is a high-water mark for the whole process.
#include <sys/resource.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include "attnserve/core/attention_engine.h"
#include "benchmark/benchmark.h"

namespace attnserve {
namespace {

double PeakRssMiB() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is KiB.
}

void BM_LongSdpaPeakMemory(benchmark::State& state) {
  AttentionShape shape;
  shape.batch = 1;
  shape.heads = shape.kv_heads = 8;
  shape.query_len = shape.key_len = state.range(0);
  shape.key_dim = shape.value_dim = 64;
  AttentionOptions options;
  options.causal = state.range(1) != 0;
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(EngineOptions{}).value();
  const double before = PeakRssMiB();
  std::vector<float> query(static_cast<size_t>(shape.QueryElements()), 0.01f);
  std::vector<float> key(static_cast<size_t>(shape.KeyElements()), 0.02f);
  std::vector<float> value(static_cast<size_t>(shape.ValueElements()), 0.03f);
  std::vector<float> output(static_cast<size_t>(shape.OutputElements()), 0.0f);
  for (auto _ : state) {
    const absl::Status status = engine->Attend(shape, options, query, key,
                                               value, absl::MakeSpan(output));
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      return;
    }
  }
  const double tensors_mib =
      4.0 *
      static_cast<double>(shape.QueryElements() + shape.KeyElements() +
                          shape.ValueElements() + shape.OutputElements()) /
      (1 << 20);
  const double bound_mib = 1.5 * tensors_mib + 256.0;
  const double peak = PeakRssMiB();
  state.counters["tensors_MiB"] = tensors_mib;
  state.counters["peak_rss_MiB"] = peak;
  state.counters["bound_MiB"] = bound_mib;
  std::printf(
      "L=%lld causal=%d: inputs+output %.0f MiB, peak RSS %.0f MiB (%.0f MiB "
      "before the tensors), bound 1.5 x %.0f + 256 = %.0f MiB: %s\n",
      static_cast<long long>(shape.query_len), options.causal ? 1 : 0,
      tensors_mib, peak, before, tensors_mib, bound_mib,
      peak < bound_mib ? "under" : "OVER");
}
BENCHMARK(BM_LongSdpaPeakMemory)
    ->ArgNames({"L", "causal"})
    ->Args({32768, 0})
    ->Iterations(1)
    ->Unit(benchmark::kSecond)
    ->UseRealTime();

}  // namespace
}  // namespace attnserve

BENCHMARK_MAIN();
