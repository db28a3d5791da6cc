// libFuzzer target: AttentionEngine::Attend against the double-precision
// reference (tests/reference) on tiny shapes.
//
// The input decodes (through FuzzedDataProvider) into a shape with B, H / Hkv,
// Hkv ≤ 3, Lq, Lk ≤ 20 and Dk, Dv ≤ 16; options (scale up to 2/sqrt(Dk) in
// magnitude, causal and its alignment, key_lengths, a BOOL or float mask with
// any broadcast pattern, weights mode, lse, precision); and inputs uniform in
// [-1, 1), float masks in [-2, 2] or −inf: the domain where docs/api.md states
// its tolerances. Every output, weight and lse must be within them, and a row
// that sees no key must give lse −inf; else the target prints the case and
// traps.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attnserve/core/attention_engine.h"
#include "reference/reference_attention.h"

namespace attnserve::fuzz {
namespace {

using ::attnserve::testing::HeadMean;
using ::attnserve::testing::ReferenceAttention;
using ::attnserve::testing::ReferenceMask;
using ::attnserve::testing::ReferenceOptions;
using ::attnserve::testing::ReferenceResult;
using ::attnserve::testing::ReferenceShape;

// docs/api.md, "Numerics": |actual − expected| ≤ abs + rel·|expected|.
struct Tolerance {
  double abs, rel;
};

constexpr Tolerance kOutputF32 = {1e-5, 1e-5};
constexpr Tolerance kOutputBf16 = {2e-2, 2e-2};
constexpr Tolerance kLseF32 = {1e-4, 1e-5};
constexpr Tolerance kLseBf16 = {5e-2, 1e-2};

// One decoded case: what the engine gets, and the same for the reference.
struct Case {
  ReferenceShape shape{};
  std::vector<float> query, key, value;
  ReferenceOptions reference;
  AttentionOptions options;  // mask and key_lengths point into `reference`
  std::vector<float> alibi_slopes;  // options.alibi_slopes points here
  std::string description;
};

std::vector<float> Inputs(FuzzedDataProvider& data, int64_t count) {
  std::vector<float> values(static_cast<size_t>(count));
  for (float& v : values) {
    v = static_cast<float>(data.ConsumeIntegral<uint16_t>()) / 32768.0f - 1.0f;
  }
  return values;
}

int64_t Dim(FuzzedDataProvider& data, int64_t max) {
  return data.ConsumeIntegralInRange<int64_t>(1, max);
}

// A mask broadcastable to [B, H, Lq, Lk]: each dimension kept or 1, leading 1s
// dropped (as far as the input asks), BOOL or float.
ReferenceMask DecodeMask(FuzzedDataProvider& data, const ReferenceShape& s) {
  const int64_t full[4] = {s.batch, s.heads, s.query_len, s.key_len};
  std::vector<int64_t> dims;
  for (int64_t dim : full) dims.push_back(data.ConsumeBool() ? dim : 1);
  const size_t drop = data.ConsumeIntegralInRange<size_t>(0, 3);
  size_t leading_ones = 0;
  while (leading_ones < drop && dims[leading_ones] == 1) ++leading_ones;
  dims.erase(dims.begin(), dims.begin() + static_cast<ptrdiff_t>(leading_ones));
  int64_t count = 1;
  for (int64_t d : dims) count *= d;
  ReferenceMask mask;
  mask.shape = dims;
  if (data.ConsumeBool()) {
    for (int64_t i = 0; i < count; ++i) {
      mask.allowed.push_back(data.ConsumeIntegral<uint8_t>() % 4 != 0 ? 1 : 0);
    }
  } else {
    for (int64_t i = 0; i < count; ++i) {
      const uint8_t byte = data.ConsumeIntegral<uint8_t>();
      mask.bias.push_back(byte == 0 ? -std::numeric_limits<float>::infinity()
                                    : (byte - 128) / 64.0f);
    }
  }
  return mask;
}

Case Decode(FuzzedDataProvider& data) {
  Case c;
  ReferenceShape& s = c.shape;
  s.batch = Dim(data, 3);
  s.kv_heads = Dim(data, 3);
  s.heads = s.kv_heads * Dim(data, 3);
  s.query_len = Dim(data, 20);
  s.key_len = Dim(data, 20);
  s.key_dim = Dim(data, 16);
  s.value_dim = Dim(data, 16);

  ReferenceOptions& ref = c.reference;
  AttentionOptions& options = c.options;
  if (data.ConsumeBool()) {
    const float scale = data.ConsumeFloatingPointInRange(-2.0f, 2.0f) /
                        std::sqrt(static_cast<float>(s.key_dim));
    options.scale = scale;
    ref.scale = scale;
  }
  ref.causal = options.causal = data.ConsumeBool();
  ref.bottom_right = data.ConsumeBool();
  options.causal_alignment = ref.bottom_right ? CausalAlignment::kBottomRight
                                              : CausalAlignment::kTopLeft;
  if (data.ConsumeBool()) {
    for (int64_t b = 0; b < s.batch; ++b) {
      ref.key_lengths.push_back(
          data.ConsumeIntegralInRange<int64_t>(0, s.key_len));
    }
    options.key_lengths = ref.key_lengths;
  }
  if (data.ConsumeBool()) {
    ref.mask = DecodeMask(data, s);
    AttentionMask mask;
    const size_t rank = ref.mask->shape.size();
    for (size_t d = 0; d < 4; ++d) {
      mask.dims[d] = d + rank >= 4 ? ref.mask->shape[d + rank - 4] : 1;
    }
    if (ref.mask->allowed.empty()) {
      mask.bias = ref.mask->bias.data();
    } else {
      mask.allowed = ref.mask->allowed.data();
    }
    options.mask = mask;
  }
  options.weights =
      static_cast<AttentionWeightsMode>(data.ConsumeIntegralInRange<int>(0, 2));
  options.return_lse = data.ConsumeBool();
  options.precision =
      data.ConsumeBool() ? Precision::kBFloat16 : Precision::kFloat32;
  // The variants: window, sinks, ALiBi, softcap.
  ref.window_left = options.window_left =
      data.ConsumeIntegralInRange<int64_t>(-1, 25);
  ref.window_right = options.window_right =
      data.ConsumeIntegralInRange<int64_t>(-1, 25);
  ref.num_sink_tokens = options.num_sink_tokens =
      data.ConsumeIntegralInRange<int64_t>(0, 5);
  if (data.ConsumeBool()) {
    for (int64_t h = 0; h < s.heads; ++h) {
      c.alibi_slopes.push_back(data.ConsumeFloatingPointInRange(-1.0f, 1.0f));
      ref.alibi_slopes.push_back(c.alibi_slopes.back());
    }
    options.alibi_slopes = c.alibi_slopes;
  }
  if (data.ConsumeBool()) {
    options.softcap = data.ConsumeFloatingPointInRange(0.25f, 50.0f);
    ref.softcap = *options.softcap;
  }

  c.query = Inputs(data, s.batch * s.heads * s.query_len * s.key_dim);
  c.key = Inputs(data, s.batch * s.kv_heads * s.key_len * s.key_dim);
  c.value = Inputs(data, s.batch * s.kv_heads * s.key_len * s.value_dim);

  c.description = absl::StrCat(
      "B=", s.batch, " H=", s.heads, " Hkv=", s.kv_heads, " Lq=", s.query_len,
      " Lk=", s.key_len, " Dk=", s.key_dim, " Dv=", s.value_dim,
      " scale=", ref.scale ? absl::StrCat(*ref.scale) : "default",
      " causal=", ref.causal, " bottom_right=", ref.bottom_right,
      " key_lengths=[", absl::StrJoin(ref.key_lengths, ","), "] mask=",
      ref.mask ? absl::StrCat(ref.mask->allowed.empty() ? "float[" : "bool[",
                              absl::StrJoin(ref.mask->shape, ","), "]")
               : "none",
      " weights=", static_cast<int>(options.weights),
      " lse=", options.return_lse,
      " bf16=", options.precision == Precision::kBFloat16, " window=(",
      options.window_left, ",", options.window_right,
      ") sinks=", options.num_sink_tokens, " alibi=[",
      absl::StrJoin(c.alibi_slopes, ","),
      "] softcap=", options.softcap ? absl::StrCat(*options.softcap) : "none");
  return c;
}

void Compare(const Case& c, const char* what, const std::vector<float>& actual,
             const std::vector<double>& expected, Tolerance t) {
  for (size_t i = 0; i < actual.size(); ++i) {
    const bool ok = std::isinf(expected[i])
                        ? actual[i] == expected[i]
                        : std::abs(actual[i] - expected[i]) <=
                              t.abs + t.rel * std::abs(expected[i]);
    if (!ok) {
      std::fprintf(stderr,
                   "attention_options_fuzzer: %s[%zu] is %.9g, expected %.9g "
                   "(tolerance %g + %g·|expected|)\n  case: %s\n",
                   what, i, actual[i], expected[i], t.abs, t.rel,
                   c.description.c_str());
      __builtin_trap();
    }
  }
}

AttentionEngine& Engine() {
  static AttentionEngine* const engine = [] {
    EngineOptions options;
    options.num_threads = 1;
    absl::StatusOr<std::unique_ptr<AttentionEngine>> created =
        AttentionEngine::Create(options);
    if (!created.ok()) __builtin_trap();
    return created->release();
  }();
  return *engine;
}

void Run(const Case& c) {
  const ReferenceShape& s = c.shape;
  AttentionShape shape;
  shape.batch = s.batch;
  shape.heads = s.heads;
  shape.kv_heads = s.kv_heads;
  shape.query_len = s.query_len;
  shape.key_len = s.key_len;
  shape.key_dim = s.key_dim;
  shape.value_dim = s.value_dim;
  const AttentionOptions& options = c.options;
  std::vector<float> output(static_cast<size_t>(shape.OutputElements()));
  std::vector<float> weights(
      static_cast<size_t>(options.weights == AttentionWeightsMode::kPerHead
                              ? shape.WeightsElements()
                          : options.weights == AttentionWeightsMode::kHeadMean
                              ? shape.HeadMeanWeightsElements()
                              : 0));
  std::vector<float> lse(
      static_cast<size_t>(options.return_lse ? shape.LseElements() : 0));
  const absl::Status status = Engine().Attend(
      shape, options, c.query, c.key, c.value,
      AttentionOutputs(absl::MakeSpan(output), absl::MakeSpan(weights),
                       absl::MakeSpan(lse)));
  if (!status.ok()) {
    std::fprintf(stderr,
                 "attention_options_fuzzer: Attend failed: %s\n  case: %s\n",
                 status.ToString().c_str(), c.description.c_str());
    __builtin_trap();
  }

  const ReferenceResult expected =
      ReferenceAttention(s, c.query, c.key, c.value, c.reference);
  const bool bf16 = options.precision == Precision::kBFloat16;
  const Tolerance tolerance = bf16 ? kOutputBf16 : kOutputF32;
  Compare(c, "output", output, expected.output, tolerance);
  if (options.weights == AttentionWeightsMode::kPerHead) {
    Compare(c, "weights", weights, expected.weights, tolerance);
  } else if (options.weights == AttentionWeightsMode::kHeadMean) {
    Compare(
        c, "head-mean weights", weights,
        HeadMean(expected.weights, s.batch, s.heads, s.query_len, s.key_len),
        tolerance);
  }
  if (options.return_lse) {
    Compare(c, "lse", lse, expected.lse, bf16 ? kLseBf16 : kLseF32);
  }
}

}  // namespace
}  // namespace attnserve::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider provider(data, size);
  attnserve::fuzz::Run(attnserve::fuzz::Decode(provider));
  return 0;
}
