// Attention throughput next to the same run's oneDNN GEMM rate.
//
//   build/bench/attention_bench [--benchmark_filter=...]
//   [--benchmark_repetitions=N]
//
// Each benchmark reports FLOP/s: a GEMM counts 2·M·N·K, attention 4·B·H·Lq·Lk·D
// (the FlashAttention convention, D = (Dk + Dv) / 2; half that when causal).
// After the runs, a summary prints each attention run's median rate as a ratio
// of the same run's median GEMM rate at its precision (the practical ceiling
// on this machine), fused against unfused, causal time against non-causal
// time, and decode's K/V bytes per second (stateless, and over paged caches
// as the server's sessions keep them) against a plain streaming read.
// Absolute rates drift on shared machines; the ratios are what BENCHMARKS.md
// records.
#include <omp.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/common/dtype.h"
#include "attnserve/core/attention_engine.h"
#include "benchmark/benchmark.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve {
namespace {

std::vector<float> Filled(int64_t count, float value) {
  return std::vector<float>(static_cast<size_t>(count), value);
}

// One square n×n matmul through oneDNN, the ceiling the attention rates are
// measured against: `in` inputs (f32, or bf16 as the bf16-precision tiles take
// them), f32 output. Everything but the matmul itself is outside the timing:
// the primitive is built once, and the weights are reordered once into the
// layout oneDNN picks for them (a plain row-major B would be repacked into it
// on every execute, which on AMX costs the bf16 GEMM half its rate). The
// label names the implementation oneDNN picked (its ISA).
void RunOneDnnGemm(benchmark::State& state, dnnl::memory::data_type in) {
  const int64_t n = state.range(0);
  const size_t count = static_cast<size_t>(n * n);
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const auto tag = dnnl::memory::format_tag::ab;
  const dnnl::memory::desc in_md({n, n}, in, tag);
  const dnnl::memory::desc out_md({n, n}, dnnl::memory::data_type::f32, tag);
  // 0.5 and 0.25, in whichever type the inputs take.
  const bool bf16 = in == dnnl::memory::data_type::bf16;
  std::vector<float> a(bf16 ? 0 : count, 0.5f), b(bf16 ? 0 : count, 0.25f);
  std::vector<uint16_t> a16(bf16 ? count : 0, 0x3f00),
      b16(bf16 ? count : 0, 0x3e80);
  std::vector<float> c(count, 0.0f);
  dnnl::memory a_mem(in_md, engine,
                     bf16 ? static_cast<void*>(a16.data()) : a.data());
  dnnl::memory b_mem(in_md, engine,
                     bf16 ? static_cast<void*>(b16.data()) : b.data());
  dnnl::memory c_mem(out_md, engine, c.data());
  const dnnl::memory::desc weights_any({n, n}, in,
                                       dnnl::memory::format_tag::any);
  dnnl::matmul::primitive_desc pd;
  try {
    pd = dnnl::matmul::primitive_desc(
        dnnl::matmul::desc(in_md, weights_any, out_md), engine);
  } catch (const dnnl::error&) {
    state.SkipWithError(
        "oneDNN has no matmul of this type on this CPU (bf16 needs AVX-512); "
        "BF16 precision then runs on f32 matmuls, measured against the f32 "
        "GEMM");
    return;
  }
  dnnl::memory weights = b_mem;
  if (pd.weights_desc() != in_md) {
    weights = dnnl::memory(pd.weights_desc(), engine);
    dnnl::reorder(b_mem, weights).execute(stream, b_mem, weights);
    stream.wait();
  }
  dnnl::matmul matmul(pd);
  state.SetLabel(pd.impl_info_str());
  for (auto _ : state) {
    matmul.execute(stream, {{DNNL_ARG_SRC, a_mem},
                            {DNNL_ARG_WEIGHTS, weights},
                            {DNNL_ARG_DST, c_mem}});
    stream.wait();
  }
  state.counters["FLOPS"] = benchmark::Counter(
      2.0 * n * n * n, benchmark::Counter::kIsIterationInvariantRate);
}

// The ceilings: f32, and bf16 in with f32 out.
void BM_OneDnnGemmF32(benchmark::State& state) {
  RunOneDnnGemm(state, dnnl::memory::data_type::f32);
}
void BM_OneDnnGemmBF16(benchmark::State& state) {
  RunOneDnnGemm(state, dnnl::memory::data_type::bf16);
}
BENCHMARK(BM_OneDnnGemmF32)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_OneDnnGemmBF16)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Sums n floats with eight independent vector accumulators (so that the adds
// never wait on each other and only memory bounds the loop), AVX-512 where the
// CPU has it.
__attribute__((target_clones("avx512f", "default"))) float SumFloats(
    const float* data, int64_t n) {
  float lanes[8][16] = {};
  for (int64_t i = 0; i + 128 <= n; i += 128) {
    for (int a = 0; a < 8; ++a) {
#pragma omp simd
      for (int l = 0; l < 16; ++l) lanes[a][l] += data[i + a * 16 + l];
    }
  }
  float sum = 0.0f;
  for (const auto& accumulator : lanes) {
    for (float v : accumulator) sum += v;
  }
  return sum;
}

// First passes: the memory-bound benchmarks run untimed passes over their
// buffers for half a second before the timed ones. On some virtual machines (a
// 2-vCPU AMD EPYC Zen 5 PVM guest, 2026-12-03) the first reads of freshly
// written memory in a process run up to ~25x slower than later ones (660 ms
// against 28 ms for 512 MiB of K/V on one thread, with no page fault in the
// calls), and google-benchmark rebuilds the buffers for each repetition:
// without these passes a short run reported that warm-up as the kernel's rate
// (0.8 GB/s where the steady rate is 19). A session's cache and a server's
// buffers are read many times; the steady rate is the one that matters.
absl::Status WarmUp(const std::function<absl::Status()>& pass) {
  const absl::Time end = absl::Now() + absl::Milliseconds(500);
  for (int i = 0; i < 2 || (absl::Now() < end && i < 100); ++i) {
    if (absl::Status status = pass(); !status.ok()) return status;
  }
  return absl::OkStatus();
}

// The memory ceiling for decode: every thread sums its share of a buffer far
// larger than the caches, as decode streams K and V once.
void BM_StreamRead(benchmark::State& state) {
  const int64_t floats = int64_t{1} << 28;  // 1 GiB
  std::vector<float> buffer = Filled(floats, 1.0f);
  const auto read = [&buffer, floats] {
    float sum = 0.0f;
#pragma omp parallel reduction(+ : sum)
    {
      const int64_t share = floats / omp_get_num_threads();
      sum += SumFloats(buffer.data() + share * omp_get_thread_num(), share);
    }
    return sum;
  };
  float total = 0.0f;
  WarmUp([&] {
    total += read();
    return absl::OkStatus();
  }).IgnoreError();
  for (auto _ : state) total += read();
  benchmark::DoNotOptimize(total);
  state.counters["BYTES"] = benchmark::Counter(
      4.0 * floats, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_StreamRead)->Unit(benchmark::kMillisecond)->UseRealTime();

// Times Attends of `shape` with `options` on an engine of `engine_options`,
// over inputs of small constant values.
void TimeAttends(benchmark::State& state, const AttentionShape& shape,
                 const AttentionOptions& options,
                 const EngineOptions& engine_options) {
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(engine_options).value();
  const std::vector<float> query = Filled(shape.QueryElements(), 0.01f);
  const std::vector<float> key = Filled(shape.KeyElements(), 0.02f);
  const std::vector<float> value = Filled(shape.ValueElements(), 0.03f);
  std::vector<float> output = Filled(shape.OutputElements(), 0.0f);
  for (auto _ : state) {
    const absl::Status status = engine->Attend(shape, options, query, key,
                                               value, absl::MakeSpan(output));
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      break;
    }
  }
}

// SDPA with B, H, Hkv, Lq, Lk, D (= Dk = Dv), causal, bf16 precision and the
// unfused kernel from the arguments. Counts FLOPs by the FlashAttention
// convention (4·B·H·Lq·Lk·D, halved when causal) and the bytes of K and V.
void BM_Attention(benchmark::State& state) {
  AttentionShape shape;
  shape.batch = state.range(0);
  shape.heads = state.range(1);
  shape.kv_heads = state.range(2);
  shape.query_len = state.range(3);
  shape.key_len = state.range(4);
  shape.key_dim = shape.value_dim = state.range(5);
  AttentionOptions options;
  options.causal = state.range(6) != 0;
  options.precision =
      state.range(7) != 0 ? Precision::kBFloat16 : Precision::kFloat32;
  EngineOptions engine_options;
  engine_options.max_workspace_bytes = int64_t{4} << 30;
  if (state.range(8) != 0) engine_options.kernel = AttentionKernel::kUnfused;
  TimeAttends(state, shape, options, engine_options);
  double flops = 4.0 * shape.batch * shape.heads * shape.query_len *
                 shape.key_len * static_cast<double>(shape.key_dim);
  if (options.causal) flops /= 2;
  state.counters["FLOPS"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["BYTES"] = benchmark::Counter(
      4.0 * static_cast<double>(shape.KeyElements() + shape.ValueElements()),
      benchmark::Counter::kIsIterationInvariantRate);
}

// Each shape fused, non-causal and causal, f32 and bf16, then unfused
// non-causal as the baseline.
void AttentionTable(benchmark::internal::Benchmark* b) {
  b->ArgNames({"B", "H", "Hkv", "Lq", "Lk", "D", "causal", "bf16", "unfused"});
  const std::vector<std::vector<int64_t>> shapes = {
      {1, 16, 16, 2048, 2048, 64}, {1, 16, 16, 1024, 1024, 128},
      {4, 8, 8, 512, 512, 64},     {1, 32, 32, 4096, 4096, 64},
      {1, 32, 8, 2048, 2048, 128},  // GQA
  };
  for (const std::vector<int64_t>& shape : shapes) {
    for (int64_t bf16 : {0, 1}) {
      for (int64_t causal : {0, 1}) {
        std::vector<int64_t> args = shape;
        args.insert(args.end(), {causal, bf16, 0});
        b->Args(args);
      }
      std::vector<int64_t> args = shape;
      args.insert(args.end(), {0, bf16, 1});
      b->Args(args);
    }
  }
  // Decode: one query per head against a long cache.
  for (int64_t bf16 : {0, 1}) {
    for (int64_t unfused : {0, 1}) {
      b->Args({8, 32, 32, 1, 4096, 128, 0, bf16, unfused});
    }
  }
  // The service benchmark's small Attend alone and as a batch of 32 (dynamic
  // batching), f32; alone at bf16 precision too, whose tiles read a bf16 copy.
  for (int64_t batch : {1, 32}) {
    for (int64_t unfused : {0, 1}) {
      b->Args({batch, 8, 8, 128, 128, 64, 0, 0, unfused});
    }
  }
  b->Args({1, 8, 8, 128, 128, 64, 0, 1, 0});
}
BENCHMARK(BM_Attention)
    ->Apply(AttentionTable)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// What dynamic batching computes: P requests of (1, H, Hkv, Lq, Lk, D), f32,
// fused, by `how`: 0 AttendBatch (each part cut into the tiles and key splits
// it would get alone, as the server's batches run), 1 one Attend of B = P over
// one set of tensors (the one kernel call and its tiling of B = P, what
// batches ran before they kept each part's bits), 2 P Attends one after the
// other (no batching). FLOPS counts all P requests.
void BM_AttendBatch(benchmark::State& state) {
  const int64_t parts = state.range(0);
  AttentionShape one;
  one.heads = state.range(1);
  one.kv_heads = state.range(2);
  one.query_len = state.range(3);
  one.key_len = state.range(4);
  one.key_dim = one.value_dim = state.range(5);
  const int64_t how = state.range(6);
  EngineOptions engine_options;
  engine_options.max_workspace_bytes = int64_t{4} << 30;
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(engine_options).value();
  const AttentionOptions options;
  AttentionShape all = one;
  all.batch = parts;
  const std::vector<float> query = Filled(all.QueryElements(), 0.01f);
  const std::vector<float> key = Filled(all.KeyElements(), 0.02f);
  const std::vector<float> value = Filled(all.ValueElements(), 0.03f);
  std::vector<float> output = Filled(all.OutputElements(), 0.0f);
  std::vector<AttendPart> batch;
  for (int64_t p = 0; p < parts; ++p) {
    const auto slice = [p](const std::vector<float>& v, int64_t n) {
      return absl::MakeConstSpan(v).subspan(static_cast<size_t>(p * n),
                                            static_cast<size_t>(n));
    };
    AttendPart part;
    part.query = slice(query, one.QueryElements());
    part.key = slice(key, one.KeyElements());
    part.value = slice(value, one.ValueElements());
    part.outputs.output = absl::MakeSpan(output).subspan(
        static_cast<size_t>(p * one.OutputElements()),
        static_cast<size_t>(one.OutputElements()));
    batch.push_back(part);
  }
  for (auto _ : state) {
    absl::Status status;
    if (how == 0) {
      status = engine->AttendBatch(one, options, batch);
    } else if (how == 1) {
      status = engine->Attend(all, options, query, key, value,
                              absl::MakeSpan(output));
    } else {
      for (const AttendPart& part : batch) {
        status.Update(engine->Attend(one, options, part.query, part.key,
                                     part.value, part.outputs));
      }
    }
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      break;
    }
  }
  state.counters["FLOPS"] =
      benchmark::Counter(4.0 * parts * one.heads * one.query_len * one.key_len *
                             static_cast<double>(one.key_dim),
                         benchmark::Counter::kIsIterationInvariantRate);
}
// The server benchmark's small Attend, whose parts are cut as the batch's
// were; a few query rows over long keys, whose parts split their keys alone.
BENCHMARK(BM_AttendBatch)
    ->ArgNames({"P", "H", "Hkv", "Lq", "Lk", "D", "how"})
    ->ArgsProduct({{32}, {8}, {8}, {128}, {128}, {64}, {0, 1, 2}})
    ->ArgsProduct({{32}, {2}, {2}, {64}, {1024}, {64}, {0, 1, 2}})
    ->ArgsProduct({{8}, {8}, {2}, {16}, {4096}, {128}, {0, 1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// A causal self-attention of L tokens with a sliding window of W keys back
// (W = 0: none, the full causal call; 4,096 is Mistral 7B's) and S sinks, on
// the fused kernel, H 8 query heads over Hkv kv heads (2: groups of four, as
// Mistral's; 1 with W 128: groups of eight and gpt-oss's window). FLOPS counts
// the full causal call's work whatever the window, so that the report's time
// ratio against W = 0 is the ratio of the rates.
void BM_WindowedAttention(benchmark::State& state) {
  AttentionShape shape;
  shape.heads = 8;
  shape.kv_heads = state.range(4);
  shape.query_len = shape.key_len = state.range(0);
  shape.key_dim = shape.value_dim = 64;
  AttentionOptions options;
  options.causal = true;
  if (state.range(1) > 0) options.window_left = state.range(1);
  options.num_sink_tokens = state.range(2);
  options.precision =
      state.range(3) != 0 ? Precision::kBFloat16 : Precision::kFloat32;
  EngineOptions engine_options;
  engine_options.max_workspace_bytes = int64_t{4} << 30;
  TimeAttends(state, shape, options, engine_options);
  state.counters["FLOPS"] =
      benchmark::Counter(2.0 * shape.heads * shape.query_len * shape.key_len *
                             static_cast<double>(shape.key_dim),
                         benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_WindowedAttention)
    ->ArgNames({"L", "W", "sinks", "bf16", "Hkv"})
    ->ArgsProduct({{8192}, {0, 256, 4096}, {0}, {0, 1}, {8, 2}})
    ->Args({8192, 128, 0, 0, 1})
    ->Args({8192, 128, 0, 1, 1})
    ->Args({8192, 0, 0, 0, 1})
    ->Args({8192, 0, 0, 1, 1})
    ->Args({8192, 256, 4, 0, 8})
    ->Args({8192, 256, 4, 1, 8})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// `count` elements of `value` stored in `dtype`.
std::vector<char> Stored(DataType dtype, int64_t count, float value) {
  std::vector<char> bytes(static_cast<size_t>(count * DataTypeBytes(dtype)));
  const std::vector<float> values = Filled(count, value);
  ConvertFromFloat32(values.data(), count, dtype, bytes.data());
  return bytes;
}

// A non-causal (1, H, H, L, L, D) Attend whose query, key and value arrive as
// bf16 (dtype 1) or f16 (2), at f32 or bf16 precision: read where they lie
// (AttendHalf, route 0), or widened to f32 copies first and then computed
// (route 1, what the server did before AttendHalf). FLOPS as BM_Attention.
void BM_HalfInputs(benchmark::State& state) {
  AttentionShape shape;
  shape.heads = shape.kv_heads = state.range(0);
  shape.query_len = shape.key_len = state.range(1);
  shape.key_dim = shape.value_dim = state.range(2);
  const DataType dtype = static_cast<DataType>(state.range(3));
  AttentionOptions options;
  options.precision =
      state.range(4) != 0 ? Precision::kBFloat16 : Precision::kFloat32;
  const bool widen_first = state.range(5) != 0;
  EngineOptions engine_options;
  engine_options.max_workspace_bytes = int64_t{4} << 30;
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(engine_options).value();
  const std::vector<char> query = Stored(dtype, shape.QueryElements(), 0.01f);
  const std::vector<char> key = Stored(dtype, shape.KeyElements(), 0.02f);
  const std::vector<char> value = Stored(dtype, shape.ValueElements(), 0.03f);
  std::vector<float> output = Filled(shape.OutputElements(), 0.0f);
  std::vector<float> query_f32, key_f32, value_f32;
  const auto widened = [dtype](const std::vector<char>& bytes,
                               std::vector<float>* out) {
    out->resize(bytes.size() / 2);
    ConvertToFloat32(dtype, bytes.data(), static_cast<int64_t>(out->size()),
                     out->data());
    return absl::MakeConstSpan(*out);
  };
  for (auto _ : state) {
    absl::Status status;
    if (widen_first) {
      status = engine->Attend(
          shape, options, widened(query, &query_f32), widened(key, &key_f32),
          widened(value, &value_f32), absl::MakeSpan(output));
      std::vector<float>().swap(query_f32);  // Each call allocates anew.
      std::vector<float>().swap(key_f32);
      std::vector<float>().swap(value_f32);
    } else {
      status = engine->AttendHalf(shape, options, dtype, query, key, value,
                                  absl::MakeSpan(output));
    }
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      break;
    }
  }
  state.counters["FLOPS"] =
      benchmark::Counter(4.0 * shape.heads * shape.query_len * shape.key_len *
                             static_cast<double>(shape.key_dim),
                         benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_HalfInputs)
    ->ArgNames({"H", "L", "D", "dtype", "bf16", "widen"})
    ->ArgsProduct({{16}, {2048}, {64}, {1, 2}, {0, 1}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// A stateless decode call, (B, 32, 8, 1, L, 128) at f32 precision, whose
// query, key and value arrive in `dtype` (0 f32 through Attend; 1 bf16, 2 f16
// through AttendHalf, read where they lie): BYTES counts K and V in their
// dtype, so the rate compares with BM_StreamRead (more than an L3's worth of
// them at B 16). At B 1 (8 or 16 MiB, a server's L3 or near it) the kernel's
// own work shows more than the memory's. The kernel issue asks the bf16 call
// to take at most the f32 one's time.
void BM_DecodeInputs(benchmark::State& state) {
  AttentionShape shape;
  shape.batch = state.range(0);
  shape.heads = 32;
  shape.kv_heads = 8;
  shape.query_len = 1;
  shape.key_len = state.range(1);
  shape.key_dim = shape.value_dim = 128;
  const DataType dtype = static_cast<DataType>(state.range(2));
  EngineOptions engine_options;
  engine_options.max_workspace_bytes = int64_t{4} << 30;
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(engine_options).value();
  const std::vector<char> query = Stored(dtype, shape.QueryElements(), 0.01f);
  const std::vector<char> key = Stored(dtype, shape.KeyElements(), 0.02f);
  const std::vector<char> value = Stored(dtype, shape.ValueElements(), 0.03f);
  const auto floats = [](const std::vector<char>& bytes) {
    return absl::MakeConstSpan(reinterpret_cast<const float*>(bytes.data()),
                               bytes.size() / 4);
  };
  std::vector<float> output = Filled(shape.OutputElements(), 0.0f);
  const auto attend = [&] {
    return dtype == DataType::kFloat32
               ? engine->Attend(shape, AttentionOptions(), floats(query),
                                floats(key), floats(value),
                                absl::MakeSpan(output))
               : engine->AttendHalf(shape, AttentionOptions(), dtype, query,
                                    key, value, absl::MakeSpan(output));
  };
  if (const absl::Status first = WarmUp(attend); !first.ok()) {
    state.SkipWithError(first.ToString().c_str());
    return;
  }
  for (auto _ : state) {
    const absl::Status status = attend();
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      break;
    }
  }
  state.counters["BYTES"] =
      benchmark::Counter(static_cast<double>(key.size() + value.size()),
                         benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_DecodeInputs)
    ->ArgNames({"B", "L", "dtype"})
    ->ArgsProduct({{1, 16}, {4096}, {0, 1, 2}})
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

// Decode over paged KV caches (AttentionEngine::AttendPaged, the server's
// Step): S sessions of L tokens each (H, Hkv, D; pages of 64 tokens) stored
// as f32 (dtype 0), bf16 (1) or f16 (2), keys by dimension as the sessions
// store them (T 1) or as rows (T 0), one query token each, all in one call.
// BYTES counts the keys and values read, for the ratio to the streaming read.
void BM_PagedDecode(benchmark::State& state) {
  const int64_t sessions = state.range(0);
  const int64_t heads = state.range(1);
  PageLayout layout;
  layout.kv_heads = state.range(2);
  const int64_t length = state.range(3);
  layout.key_dim = layout.value_dim = state.range(4);
  layout.dtype = static_cast<DataType>(state.range(5));
  layout.page_tokens = 64;
  // 1: keys laid out by dimension, as the sessions' pages; 0: as rows.
  layout.keys_transposed = state.range(6) != 0;
  EngineOptions engine_options;
  engine_options.max_workspace_bytes = int64_t{4} << 30;
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(engine_options).value();
  const int64_t pages_each =
      (length + layout.page_tokens - 1) / layout.page_tokens;
  // Every page filled with small values (0x3c00 is 1.0 in f16, 0x3f80 in
  // bf16; scaled down so the softmax stays finite).
  std::vector<std::vector<char>> pages(
      static_cast<size_t>(sessions * pages_each),
      std::vector<char>(static_cast<size_t>(layout.PageBytes()),
                        static_cast<char>(0x21)));
  std::vector<std::vector<const char*>> tables(static_cast<size_t>(sessions));
  const std::vector<float> query = Filled(heads * layout.key_dim, 0.01f);
  std::vector<std::vector<float>> outputs(static_cast<size_t>(sessions));
  std::vector<PagedAttend> items(static_cast<size_t>(sessions));
  for (int64_t s = 0; s < sessions; ++s) {
    for (int64_t p = 0; p < pages_each; ++p) {
      tables[static_cast<size_t>(s)].push_back(
          pages[static_cast<size_t>(s * pages_each + p)].data());
    }
    outputs[static_cast<size_t>(s)] = Filled(heads * layout.value_dim, 0.0f);
    PagedAttend& item = items[static_cast<size_t>(s)];
    item.layout = layout;
    item.pages = tables[static_cast<size_t>(s)];
    item.length = length;
    item.heads = heads;
    item.query_len = 1;
    item.query = query;
    item.scale = 0.088f;
    item.output = absl::MakeSpan(outputs[static_cast<size_t>(s)]);
  }
  const auto attend = [&] { return engine->AttendPaged(items); };
  if (const absl::Status first = WarmUp(attend); !first.ok()) {
    state.SkipWithError(first.ToString().c_str());
    return;
  }
  for (auto _ : state) {
    const absl::Status status = attend();
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      break;
    }
  }
  state.counters["FLOPS"] = benchmark::Counter(
      4.0 * sessions * heads * length * static_cast<double>(layout.key_dim),
      benchmark::Counter::kIsIterationInvariantRate);
  state.counters["BYTES"] = benchmark::Counter(
      static_cast<double>(sessions) * length * layout.kv_heads *
          (layout.key_dim + layout.value_dim) * DataTypeBytes(layout.dtype),
      benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_PagedDecode)
    ->ArgNames({"S", "H", "Hkv", "L", "D", "dtype", "T"})
    ->Args({32, 32, 8, 8192, 128, 1, 1})
    ->Args({32, 32, 8, 4096, 128, 0, 1})
    ->Args({32, 32, 8, 8192, 128, 2, 1})
    ->Args({1, 32, 8, 4096, 128, 1, 1})
    ->Args({32, 32, 8, 8192, 128, 1, 0})
    ->Args({32, 32, 8, 4096, 128, 0, 0})
    ->Args({32, 32, 8, 8192, 128, 2, 0})
    ->Args({1, 32, 8, 4096, 128, 1, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Prints the console table as usual and keeps each benchmark's median
// counters, then a summary: each attention run's rate as a ratio of the same
// run's GEMM rate at its precision, fused against unfused, causal time against
// non-causal time, and decode's K/V read rate against the streaming read.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      const bool is_median =
          run.run_type == Run::RT_Aggregate && run.aggregate_name == "median";
      const bool single =
          run.run_type == Run::RT_Iteration && run.repetitions <= 1;
      if (!(is_median || single) || run.error_occurred) continue;
      Medians& m = medians_[run.run_name.str()];
      m.label = run.report_label;
      if (auto it = run.counters.find("FLOPS"); it != run.counters.end())
        m.flops = it->second.value;
      if (auto it = run.counters.find("BYTES"); it != run.counters.end())
        m.bytes = it->second.value;
    }
  }

  void PrintSummary() const {
    const double gemm_f32 = Rate("BM_OneDnnGemmF32", &Medians::flops);
    // Without a bf16 matmul (no AVX-512), BF16 precision runs on f32 ones.
    const double gemm_bf16 = Rate("BM_OneDnnGemmBF16", &Medians::flops) > 0
                                 ? Rate("BM_OneDnnGemmBF16", &Medians::flops)
                                 : gemm_f32;
    const double stream = Rate("BM_StreamRead", &Medians::bytes);
    std::printf("\nCPU: %s\n", CpuModel().c_str());
    std::printf(
        "GEMM f32 %.1f GFLOP/s (%s), GEMM bf16 %.1f GFLOP/s (%s), streaming "
        "read %.1f GB/s (medians)\n",
        gemm_f32 / 1e9, Label("BM_OneDnnGemmF32").c_str(), gemm_bf16 / 1e9,
        Rate("BM_OneDnnGemmBF16", &Medians::flops) > 0
            ? Label("BM_OneDnnGemmBF16").c_str()
            : "none: the f32 GEMM",
        stream / 1e9);
    std::printf("%-44s %5s %6s %9s %8s %9s %8s %8s\n",
                "attention (B,H,Hkv,Lq,Lk,D)", "prec", "causal", "GFLOP/s",
                "/GEMM", "/unfused", "time/nc", "KV/read");
    for (const auto& [name, m] : medians_) {
      if (name.rfind("BM_Attention/", 0) != 0) continue;
      const std::map<std::string, int64_t> a = Args(name);
      const bool bf16 = a.at("bf16") != 0, causal = a.at("causal") != 0,
                 unfused = a.at("unfused") != 0;
      const double gemm = bf16 ? gemm_bf16 : gemm_f32;
      const std::string shape = absl::StrCat(
          "(", a.at("B"), ",", a.at("H"), ",", a.at("Hkv"), ",", a.at("Lq"),
          ",", a.at("Lk"), ",", a.at("D"), ")", unfused ? " unfused" : "");
      std::string vs_unfused = "", causal_time = "", kv_read = "";
      if (!unfused) {
        const double baseline =
            Lookup(WithArg(name, "causal", 0), "unfused", 1);
        if (baseline > 0) {
          // Causal runs count half the FLOPs; compare work done per second.
          vs_unfused = Ratio(m.flops / baseline);
        }
        if (causal) {
          const double full = Lookup(name, "causal", 0);
          // Time ratio: (flops/2 / rate_causal) / (flops / rate_full).
          if (full > 0) causal_time = Ratio(0.5 * full / m.flops);
        }
      }
      if (a.at("Lq") == 1 && stream > 0) kv_read = Ratio(m.bytes / stream);
      std::printf("%-44s %5s %6s %9.1f %8s %9s %8s %8s\n", shape.c_str(),
                  bf16 ? "bf16" : "f32", causal ? "yes" : "no", m.flops / 1e9,
                  gemm > 0 ? Ratio(m.flops / gemm).c_str() : "n/a",
                  vs_unfused.c_str(), causal_time.c_str(), kv_read.c_str());
    }
    std::printf("\n%-44s %5s %9s %9s\n",
                "windowed causal (H=8,Hkv,D=64,L,W,sinks)", "prec", "ms",
                "time/full");
    for (const auto& [name, m] : medians_) {
      if (name.rfind("BM_WindowedAttention/", 0) != 0) continue;
      const std::map<std::string, int64_t> a = Args(name);
      // Every run counts the full causal call's FLOPs: time = work / rate.
      const double full = Lookup(WithArg(name, "W", 0), "sinks", 0);
      const double work = 2.0 * 8 * a.at("L") * a.at("L") * 64;
      const std::string shape =
          absl::StrCat("(", a.at("Hkv"), ",", a.at("L"), ",", a.at("W"), ",",
                       a.at("sinks"), ")");
      std::printf("%-44s %5s %9.1f %9s\n", shape.c_str(),
                  a.at("bf16") != 0 ? "bf16" : "f32", 1e3 * work / m.flops,
                  full > 0 ? Ratio(full / m.flops).c_str() : "n/a");
    }
    std::printf("\n%-44s %6s %8s %8s %8s\n",
                "decode, inputs in their dtype (B,H,Hkv,L,D)", "inputs", "GB/s",
                "KV/read", "time/f32");
    for (const auto& [name, m] : medians_) {
      if (name.rfind("BM_DecodeInputs/", 0) != 0) continue;
      const std::map<std::string, int64_t> a = Args(name);
      const char* const kDtypes[] = {"f32", "bf16", "f16"};
      const int64_t element = a.at("dtype") == 0 ? 4 : 2;
      // Time against the f32 call: (bytes / rate) over (2·bytes / rate_f32).
      const double f32 = Lookup(name, "dtype", 0, &Medians::bytes);
      const std::string shape =
          absl::StrCat("(", a.at("B"), ",32,8,", a.at("L"), ",128)");
      std::printf(
          "%-44s %6s %8.1f %8s %8s\n", shape.c_str(), kDtypes[a.at("dtype")],
          m.bytes / 1e9, stream > 0 ? Ratio(m.bytes / stream).c_str() : "n/a",
          f32 > 0 ? Ratio(f32 * element / (4.0 * m.bytes)).c_str() : "n/a");
    }
    std::printf("\n%-44s %-22s %9s %8s %9s\n",
                "batched f32 (P × (1,H,Hkv,Lq,Lk,D))", "how", "GFLOP/s",
                "/GEMM", "/one-by-one");
    for (const auto& [name, m] : medians_) {
      if (name.rfind("BM_AttendBatch/", 0) != 0) continue;
      const std::map<std::string, int64_t> a = Args(name);
      const char* const kHows[] = {"AttendBatch", "one Attend of B = P",
                                   "P Attends one by one"};
      const double alone = Lookup(name, "how", 2);
      const std::string shape =
          absl::StrCat(a.at("P"), " × (1,", a.at("H"), ",", a.at("Hkv"), ",",
                       a.at("Lq"), ",", a.at("Lk"), ",", a.at("D"), ")");
      std::printf("%-44s %-22s %9.1f %8s %9s\n", shape.c_str(),
                  kHows[a.at("how")], m.flops / 1e9,
                  gemm_f32 > 0 ? Ratio(m.flops / gemm_f32).c_str() : "n/a",
                  alone > 0 ? Ratio(m.flops / alone).c_str() : "n/a");
    }
    std::printf("\n%-44s %6s %6s %8s %8s\n", "paged decode (S,H,Hkv,L,D)",
                "cache", "keys", "GB/s", "KV/read");
    for (const auto& [name, m] : medians_) {
      if (name.rfind("BM_PagedDecode/", 0) != 0) continue;
      const std::map<std::string, int64_t> a = Args(name);
      const char* const kDtypes[] = {"f32", "bf16", "f16"};
      const std::string shape =
          absl::StrCat("(", a.at("S"), ",", a.at("H"), ",", a.at("Hkv"), ",",
                       a.at("L"), ",", a.at("D"), ")");
      std::printf("%-44s %6s %6s %8.1f %8s\n", shape.c_str(),
                  kDtypes[a.at("dtype")], a.at("T") != 0 ? "by dim" : "rows",
                  m.bytes / 1e9,
                  stream > 0 ? Ratio(m.bytes / stream).c_str() : "n/a");
    }
  }

 private:
  struct Medians {
    double flops = 0, bytes = 0;
    std::string label;  // The GEMMs': the oneDNN implementation.
  };

  // /proc/cpuinfo's model name, and whether the CPU has AMX and AVX-512.
  static std::string CpuModel() {
    std::FILE* file = std::fopen("/proc/cpuinfo", "r");
    if (file == nullptr) return "unknown";
    std::string model = "unknown", flags;
    char line[8192];
    while (std::fgets(line, sizeof(line), file) != nullptr) {
      const absl::string_view text(line);
      const size_t colon = text.find(':');
      if (colon == absl::string_view::npos) continue;
      const absl::string_view key =
          absl::StripAsciiWhitespace(text.substr(0, colon));
      const absl::string_view value =
          absl::StripAsciiWhitespace(text.substr(colon + 1));
      if (key == "model name" && model == "unknown") model = std::string(value);
      if (key == "flags" && flags.empty())
        flags = absl::StrCat(" ", value, " ");
    }
    std::fclose(file);
    const bool amx = flags.find(" amx_bf16 ") != std::string::npos;
    const bool avx512 = flags.find(" avx512f ") != std::string::npos;
    return absl::StrCat(model, amx ? ", AMX" : "",
                        avx512 ? ", AVX-512" : ", no AVX-512");
  }

  std::string Label(const std::string& prefix) const {
    for (const auto& [name, m] : medians_) {
      if (name.rfind(prefix, 0) == 0) return m.label;
    }
    return "";
  }

  static std::string Ratio(double r) { return absl::StrFormat("%.3f", r); }

  // "BM_Attention/B:1/H:16/.../unfused:0/real_time" → {"B": 1, ...}.
  static std::map<std::string, int64_t> Args(const std::string& name) {
    std::map<std::string, int64_t> args;
    for (absl::string_view part : absl::StrSplit(name, '/')) {
      const size_t colon = part.find(':');
      if (colon == absl::string_view::npos) continue;
      int64_t value = 0;
      if (absl::SimpleAtoi(part.substr(colon + 1), &value)) {
        args[std::string(part.substr(0, colon))] = value;
      }
    }
    return args;
  }

  // `name` with argument `arg` set to `value`.
  static std::string WithArg(const std::string& name, const std::string& arg,
                             int64_t value) {
    std::vector<std::string> parts = absl::StrSplit(name, '/');
    for (std::string& part : parts) {
      if (part.rfind(arg + ":", 0) == 0) part = absl::StrCat(arg, ":", value);
    }
    return absl::StrJoin(parts, "/");
  }

  // The FLOP rate of `name` with `arg` set to `value`, 0 if absent.
  double Lookup(const std::string& name, const std::string& arg, int64_t value,
                double Medians::*counter = &Medians::flops) const {
    auto it = medians_.find(WithArg(name, arg, value));
    return it == medians_.end() ? 0.0 : it->second.*counter;
  }

  double Rate(const std::string& prefix, double Medians::*counter) const {
    for (const auto& [name, m] : medians_) {
      if (name.rfind(prefix, 0) == 0) return m.*counter;
    }
    return 0.0;
  }

  std::map<std::string, Medians> medians_;
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
