// oneDNN 2.6.3's AMX bf16 matmul (brg:avx512_core_amx_bf16) dies with SIGILL
// on some shapes. These tests sweep matmul shapes (M, K, N), each case in a
// child process (crash_sweep.h), so that a crash is a failure naming its shape:
//
// - EnginePathsNeverCrash: every bf16 path of the engine (unfused slabs, fused
//   tiles and tails, decode tiles, MHA projections) over the sweep's shapes,
//   through AttentionEngine, so the guard in core/internal/matmul.h is what is
//   tested.
// - RawCrashesStayInTheAvoidedClass: plain bf16 matmuls [1, M, K] x [1, K, N]
//   straight on oneDNN, AMX allowed for every shape; each crash it finds must
//   lie in the class the engine avoids (AvoidsAmxBf16Matmul). On a oneDNN
//   without the bug it finds none and says so: the guard may then go.
//
// Both need a CPU with AMX and skip, saying so, without one; set
// ATTNSERVE_AMX_SWEEP=force to run them anyway (the harness and the paths
// then run on the CPU's own kernels). docs/reliability.md has the story.
#include <omp.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/core/attention_engine.h"
#include "core/crash_sweep.h"
#include "core/sdpa_shape.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "internal/matmul.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve {
namespace {

using ::attnserve::testing::RunCasesInChildren;
using ::attnserve::testing::SdpaShape;
using ::attnserve::testing::SweepFailure;

struct Triple {
  int64_t m, k, n;
};

// The shapes swept: every K from 1 to 130 at a few M and N (the crashes seen
// were at K = 63, M = 33 and 65, N = 2 to 16), and the K values that stay on
// the AMX kernel (multiples of 32) over every M from 1 to 66 and the M tails
// around 128 and 256 (the fused kernel's tiles take up to 256 query rows), at
// small and tail N.
std::vector<Triple> SweepTriples() {
  std::vector<Triple> triples;
  for (int64_t k = 1; k <= 130; ++k) {
    for (int64_t m : {1, 16, 33, 65}) {
      for (int64_t n : {2, 4, 8, 16, 64}) triples.push_back({m, k, n});
    }
  }
  for (int64_t k : {32, 64, 96, 128, 192, 256}) {
    std::vector<int64_t> ms;
    for (int64_t m = 1; m <= 66; ++m) ms.push_back(m);
    for (int64_t m : {127, 128, 129, 255, 256, 257}) ms.push_back(m);
    for (int64_t m : ms) {
      for (int64_t n : {1, 2, 3, 4, 8, 16, 17, 64})
        triples.push_back({m, k, n});
    }
  }
  return triples;
}

bool HasAmx() {
  return dnnl::get_effective_cpu_isa() == dnnl::cpu_isa::avx512_core_amx;
}

bool Forced() {
  const char* value = std::getenv("ATTNSERVE_AMX_SWEEP");
  return value != nullptr && std::strcmp(value, "force") == 0;
}

// Skips the test on a CPU without AMX, unless forced. Reads the ISA in a child
// process: this one must not start oneDNN's threads before it forks.
#define ATTNSERVE_SKIP_WITHOUT_AMX()                                         \
  do {                                                                       \
    if (!Forced() && !HasAmxInChild()) {                                     \
      GTEST_SKIP() << "this CPU has no AMX (oneDNN's ISA here is not "       \
                      "avx512_core_amx), so oneDNN never runs its AMX bf16 " \
                      "matmul; set ATTNSERVE_AMX_SWEEP=force to run the "    \
                      "sweep anyway";                                        \
    }                                                                        \
  } while (false)

bool HasAmxInChild() {
  const std::vector<SweepFailure> failures = RunCasesInChildren(1, [](int64_t) {
    return HasAmx() ? absl::OkStatus() : absl::NotFoundError("no AMX");
  });
  return failures.empty();
}

// One engine call over bf16 inputs.
struct EngineCase {
  std::string name;
  enum Path { kUnfused, kFused, kMultiHead } path;
  AttentionShape shape;  // kUnfused, kFused
  MultiHeadShape mha;    // kMultiHead
};

std::vector<EngineCase> EngineCases() {
  std::vector<EngineCase> cases;
  auto sdpa = [&](EngineCase::Path path, const char* what,
                  const AttentionShape& shape) {
    cases.push_back({absl::StrCat(what, " ", shape.DebugString()), path, shape,
                     MultiHeadShape{}});
  };
  for (const Triple& t : SweepTriples()) {
    for (EngineCase::Path path : {EngineCase::kUnfused, EngineCase::kFused}) {
      const char* name = path == EngineCase::kUnfused ? "unfused" : "fused";
      // Q Kᵀ is (M, K = Dk, N = Lk); P V is (M, K = Lk, N = Dv).
      sdpa(path, name, SdpaShape(1, 1, 1, t.m, t.n, t.k, 4));
      sdpa(path, name, SdpaShape(1, 1, 1, t.m, t.k, 8, t.n));
    }
    // Fused: a whole key block of 256 and a tail of K keys.
    sdpa(EngineCase::kFused, "fused tail",
         SdpaShape(1, 1, 1, t.m, 256 + t.k, 8, t.n));
    // Decode: one query of 8 heads per kv head, tiles of 8 rows.
    if (t.m == 1) {
      sdpa(EngineCase::kFused, "decode", SdpaShape(1, 16, 2, 1, t.k, 64, t.n));
      sdpa(EngineCase::kFused, "decode",
           SdpaShape(1, 16, 2, 1, 512 + t.k, 64, t.n));
    }
    // Projections are (B·L, E, H·Dk) and (B·L, H·Dv, E).
    MultiHeadShape mha;
    mha.query_len = mha.key_len = t.m;
    mha.embed_dim = mha.kv_embed_dim = t.k;
    mha.key_dim = mha.value_dim = t.n;
    cases.push_back(
        {absl::StrCat("mha B=1 L=", t.m, " E=", t.k, " H=1 D=", t.n),
         EngineCase::kMultiHead, AttentionShape{}, mha});
  }
  // The shapes of the first report: the server repro and the unit test's slab
  // 3x2x4x65x63:3x2x1x63x4.
  sdpa(EngineCase::kUnfused, "unfused", SdpaShape(1, 1, 1, 65, 63, 8, 4));
  sdpa(EngineCase::kUnfused, "unfused", SdpaShape(3, 8, 2, 65, 63, 1, 4));
  return cases;
}

absl::Status RunEngineCase(AttentionEngine& engine, const EngineCase& c) {
  AttentionOptions options;
  options.precision = Precision::kBFloat16;
  if (c.path == EngineCase::kMultiHead) {
    const MultiHeadShape& s = c.mha;
    const int64_t e = s.embed_dim;
    const std::vector<float> w_in(static_cast<size_t>(s.heads * s.key_dim * e),
                                  0.25f);
    const std::vector<float> w_o(static_cast<size_t>(e * s.heads * s.value_dim),
                                 0.5f);
    const std::vector<float> input(
        static_cast<size_t>(s.batch * s.query_len * e), 1.0f);
    std::vector<float> output(input.size());
    ProjectionWeights weights;
    weights.w_q = weights.w_k = weights.w_v = w_in;
    weights.w_o = w_o;
    return engine.MultiHeadAttention(s, weights, options, input, {},
                                     absl::MakeSpan(output));
  }
  const AttentionShape& s = c.shape;
  const std::vector<float> query(static_cast<size_t>(s.QueryElements()), 0.5f);
  const std::vector<float> key(static_cast<size_t>(s.KeyElements()), 0.25f);
  const std::vector<float> value(static_cast<size_t>(s.ValueElements()), 1.0f);
  std::vector<float> output(static_cast<size_t>(s.OutputElements()));
  std::vector<float> weights;
  if (c.path == EngineCase::kUnfused) {
    options.weights = AttentionWeightsMode::kPerHead;
    weights.resize(static_cast<size_t>(s.WeightsElements()));
  }
  const absl::Status status = engine.Attend(
      s, options, query, key, value,
      AttentionOutputs(absl::MakeSpan(output), absl::MakeSpan(weights)));
  if (!status.ok()) return status;
  // Every value is 1, so every output is 1 (to bf16 accuracy).
  for (float x : output) {
    if (!(x > 0.99f && x < 1.01f)) {
      return absl::InternalError(absl::StrCat("an output is ", x, ", not 1"));
    }
  }
  return absl::OkStatus();
}

std::string Describe(const std::vector<SweepFailure>& failures,
                     const std::function<std::string(int64_t)>& name) {
  std::string text;
  for (const SweepFailure& f : failures) {
    absl::StrAppend(&text, "\n  ", name(f.index), ": ", f.reason);
  }
  return text;
}

TEST(AmxSweepTest, EnginePathsNeverCrash) {
  ATTNSERVE_SKIP_WITHOUT_AMX();
  const std::vector<EngineCase> cases = EngineCases();
  std::unique_ptr<AttentionEngine> engine;
  const std::vector<SweepFailure> failures =
      RunCasesInChildren(static_cast<int64_t>(cases.size()), [&](int64_t i) {
        if (engine == nullptr) {
          EngineOptions options;
          options.num_threads = 2;  // Decode tiles split their keys.
          absl::StatusOr<std::unique_ptr<AttentionEngine>> created =
              AttentionEngine::Create(options);
          if (!created.ok()) return created.status();
          engine = std::move(created).value();
        }
        return RunEngineCase(*engine, cases[static_cast<size_t>(i)]);
      });
  EXPECT_TRUE(failures.empty())
      << failures.size() << " of " << cases.size()
      << " engine calls failed:" << Describe(failures, [&](int64_t i) {
           return cases[static_cast<size_t>(i)].name;
         });
}

absl::Status RunRawMatmul(const Triple& t) {
  using dnnl::memory;
  try {
    const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    dnnl::stream stream(engine);
    const memory::desc a({1, t.m, t.k}, memory::data_type::bf16,
                         memory::format_tag::abc);
    const memory::desc b({1, t.k, t.n}, memory::data_type::bf16,
                         memory::format_tag::abc);
    const memory::desc c({1, t.m, t.n}, memory::data_type::f32,
                         memory::format_tag::abc);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), engine);
    const dnnl::matmul matmul(pd);
    std::vector<uint16_t> a_data(static_cast<size_t>(t.m * t.k), 0x3f80);
    std::vector<uint16_t> b_data(static_cast<size_t>(t.k * t.n), 0x3f80);
    std::vector<float> c_data(static_cast<size_t>(t.m * t.n));
    matmul.execute(stream,
                   {{DNNL_ARG_SRC, memory(a, engine, a_data.data())},
                    {DNNL_ARG_WEIGHTS, memory(b, engine, b_data.data())},
                    {DNNL_ARG_DST, memory(c, engine, c_data.data())}});
    stream.wait();
    for (float x : c_data) {
      if (x != static_cast<float>(t.k)) {
        return absl::InternalError(
            absl::StrCat("a product is ", x, ", not ", t.k));
      }
    }
    return absl::OkStatus();
  } catch (const dnnl::error& error) {
    return absl::InternalError(error.what());
  }
}

std::string TripleName(const Triple& t) {
  return absl::StrCat("[1, ", t.m, ", ", t.k, "] x [1, ", t.k, ", ", t.n, "]");
}

// oneDNN picks M blocks (and so which tail kernels run) from the thread count,
// so the set of crashing shapes depends on it: the raw sweep runs at each.
constexpr int kRawSweepThreads[] = {1, 2, 4};

TEST(AmxSweepTest, RawCrashesStayInTheAvoidedClass) {
  ATTNSERVE_SKIP_WITHOUT_AMX();
  if (!RunCasesInChildren(1, [](int64_t) {
         return internal::NativeBf16Matmuls()
                    ? absl::OkStatus()
                    : absl::UnimplementedError("no bf16 matmul");
       }).empty()) {
    GTEST_SKIP() << "oneDNN has no bf16 matmul on this CPU (no AVX-512)";
  }
  const std::vector<Triple> triples = SweepTriples();
  const int64_t count = static_cast<int64_t>(triples.size());
  const auto triple = [&](int64_t i) -> const Triple& {
    return triples[static_cast<size_t>(i % count)];
  };
  const auto threads = [&](int64_t i) {
    return kRawSweepThreads[static_cast<size_t>(i / count)];
  };
  const std::vector<SweepFailure> failures = RunCasesInChildren(
      count * static_cast<int64_t>(std::size(kRawSweepThreads)),
      [&](int64_t i) {
        omp_set_num_threads(threads(i));
        return RunRawMatmul(triple(i));
      });
  std::vector<SweepFailure> outside;
  for (const SweepFailure& f : failures) {
    const Triple& t = triple(f.index);
    if (!internal::AvoidsAmxBf16Matmul(t.m, t.k, t.n)) outside.push_back(f);
  }
  const auto name = [&](int64_t i) {
    return absl::StrCat(TripleName(triple(i)), " on ", threads(i), " threads");
  };
  std::printf("raw bf16 matmuls: %zu of %lld failed (oneDNN %d.%d.%d)%s\n",
              failures.size(),
              static_cast<long long>(count * std::size(kRawSweepThreads)),
              dnnl_version()->major, dnnl_version()->minor,
              dnnl_version()->patch, Describe(failures, name).c_str());
  if (failures.empty()) {
    std::printf("no crash: this oneDNN may not need the AMX guard any more\n");
  }
  EXPECT_TRUE(outside.empty())
      << outside.size()
      << " crashing shapes are outside the class the engine avoids:"
      << Describe(outside, name);
}

// The harness itself: a case that dies is reported with its index and the
// signal, and the sweep goes on with the next case.
TEST(AmxSweepTest, CrashIsReportedWithItsCase) {
  const std::vector<SweepFailure> failures =
      RunCasesInChildren(6, [](int64_t i) {
        if (i == 2) std::raise(SIGILL);
        if (i == 4) return absl::InvalidArgumentError("case four");
        if (i == 5) return absl::InvalidArgumentError("case five");
        return absl::OkStatus();
      });
  ASSERT_EQ(failures.size(), 3u);
  EXPECT_EQ(failures[0].index, 2);
  EXPECT_THAT(failures[0].reason, ::testing::HasSubstr("signal 4"));
  EXPECT_EQ(failures[1].index, 4);
  EXPECT_THAT(failures[1].reason, ::testing::HasSubstr("case four"));
  EXPECT_EQ(failures[2].index, 5);
}

}  // namespace
}  // namespace attnserve
