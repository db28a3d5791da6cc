// AttendHalf and AttendPackedHalf: bf16 and f16 inputs read where they lie
// give exactly what Attend and AttendPacked give over the same values widened
// to f32 (the tiles see the same numbers either way), across shapes that take
// every tile path (oneDNN tiles, tiles of few rows, split keys, GQA), every
// option the fused kernel takes, both precisions, the AVX-512 and portable
// tile code; decode calls and the unfused kernel through their own routes;
// and the refusals.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/common/dtype.h"
#include "attnserve/core/attention_engine.h"
#include "core/sdpa_shape.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"

namespace attnserve {
namespace {

using ::attnserve::testing::RandomValues;
using ::testing::HasSubstr;

// `values` stored as `dtype` (2 bytes each), and those stored values widened
// back: the f32 inputs Attend must see to match.
struct HalfTensor {
  std::vector<char> bytes;
  std::vector<float> widened;
};

HalfTensor Store(const std::vector<float>& values, DataType dtype) {
  HalfTensor t;
  // One spare byte in front, so that tests can take a misaligned view.
  t.bytes.resize(values.size() * 2 + 2);
  ConvertFromFloat32(values.data(), static_cast<int64_t>(values.size()), dtype,
                     t.bytes.data() + 2);
  t.widened.resize(values.size());
  ConvertToFloat32(dtype, t.bytes.data() + 2,
                   static_cast<int64_t>(values.size()), t.widened.data());
  return t;
}

absl::Span<const char> Bytes(const HalfTensor& t) {
  return absl::MakeConstSpan(t.bytes).subspan(2);
}

struct Case {
  AttentionShape shape;
  AttentionOptions options;
  std::vector<int64_t> key_lengths;
  std::vector<uint8_t> mask;
  std::vector<float> slopes;
};

Case Draw(std::mt19937_64& rng) {
  const auto pick = [&rng](std::initializer_list<int64_t> values) {
    return *(values.begin() +
             std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng));
  };
  Case c;
  AttentionShape& s = c.shape;
  s.batch = pick({1, 2});
  s.kv_heads = pick({1, 2});
  s.heads = s.kv_heads * pick({1, 4});
  s.query_len = pick({2, 5, 64, 130});
  s.key_len = pick({1, 7, 64, 300, 600});
  s.key_dim = pick({16, 33, 64});
  s.value_dim = pick({16, 24, 64});
  AttentionOptions& o = c.options;
  o.causal = pick({0, 1}) == 1;
  o.causal_alignment = pick({0, 1}) == 1 ? CausalAlignment::kBottomRight
                                         : CausalAlignment::kTopLeft;
  if (pick({0, 1, 2}) == 1) {
    o.window_left = pick({0, 5, 100});
    o.num_sink_tokens = pick({0, 3});
  }
  if (pick({0, 1, 2}) == 1) o.softcap = 4.0f;
  if (pick({0, 1, 2}) == 1) {
    for (int64_t h = 0; h < s.heads; ++h) c.slopes.push_back(0.05f * (h + 1));
  }
  if (pick({0, 1, 2}) == 1) {
    for (int64_t b = 0; b < s.batch; ++b) {
      c.key_lengths.push_back(pick({1, s.key_len / 2 + 1, s.key_len}));
    }
  }
  if (pick({0, 1, 2}) == 1) {
    c.mask.resize(static_cast<size_t>(s.query_len * s.key_len));
    for (uint8_t& allowed : c.mask) allowed = pick({0, 1, 1, 1}) == 1;
  }
  o.precision = pick({0, 1}) == 1 ? Precision::kBFloat16 : Precision::kFloat32;
  o.return_lse = true;
  return c;
}

// Points the case's options at its own vectors (after any copy).
AttentionOptions OptionsOf(const Case& c) {
  AttentionOptions o = c.options;
  o.key_lengths = c.key_lengths;
  o.alibi_slopes = c.slopes;
  if (!c.mask.empty()) {
    AttentionMask mask;
    mask.allowed = c.mask.data();
    mask.dims = {1, 1, c.shape.query_len, c.shape.key_len};
    o.mask = mask;
  }
  return o;
}

struct Result {
  std::vector<float> output, lse;
};

// Bit for bit (the inputs are NaN-free: every row sees a key or none).
void ExpectSameBits(const Result& a, const Result& b) {
  ASSERT_EQ(a.output.size(), b.output.size());
  ASSERT_EQ(a.lse.size(), b.lse.size());
  // A packed call without queries has no data to compare.
  if (a.output.empty()) return;
  EXPECT_EQ(std::memcmp(a.output.data(), b.output.data(),
                        a.output.size() * sizeof(float)),
            0);
  EXPECT_EQ(
      std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)), 0);
}

class HalfInputsTest
    : public ::testing::TestWithParam<std::tuple<DataType, bool>> {
 protected:
  std::unique_ptr<AttentionEngine> MakeEngine(
      AttentionKernel kernel = AttentionKernel::kAuto) {
    EngineOptions options;
    options.portable_kernels = std::get<1>(GetParam());
    options.kernel = kernel;
    options.max_workspace_bytes = int64_t{1} << 30;
    return AttentionEngine::Create(options).value();
  }
};

// Runs case `c` through AttendHalf over its inputs stored as `dtype` (drawn
// from `seed` on) and through Attend over those widened, and expects the same
// bits.
void ExpectHalfEqualsWidened(AttentionEngine& engine, const Case& c,
                             DataType dtype, uint64_t seed) {
  const AttentionShape& s = c.shape;
  const AttentionOptions options = OptionsOf(c);
  const HalfTensor query = Store(RandomValues(s.QueryElements(), seed), dtype);
  const HalfTensor key = Store(RandomValues(s.KeyElements(), seed + 1), dtype);
  const HalfTensor value =
      Store(RandomValues(s.ValueElements(), seed + 2), dtype);
  Result half{std::vector<float>(s.OutputElements(), -7.0f),
              std::vector<float>(s.LseElements(), -7.0f)};
  Result wide = half;
  ASSERT_TRUE(engine
                  .AttendHalf(s, options, dtype, Bytes(query), Bytes(key),
                              Bytes(value),
                              AttentionOutputs(absl::MakeSpan(half.output), {},
                                               absl::MakeSpan(half.lse)))
                  .ok());
  ASSERT_TRUE(engine
                  .Attend(s, options, query.widened, key.widened, value.widened,
                          AttentionOutputs(absl::MakeSpan(wide.output), {},
                                           absl::MakeSpan(wide.lse)))
                  .ok());
  ExpectSameBits(half, wide);
}

TEST_P(HalfInputsTest, EqualAttendOverTheWidenedValues) {
  const DataType dtype = std::get<0>(GetParam());
  std::unique_ptr<AttentionEngine> engine = MakeEngine();
  std::mt19937_64 rng(dtype == DataType::kBFloat16 ? 77 : 78);
  for (int round = 0; round < 40; ++round) {
    const Case c = Draw(rng);
    SCOPED_TRACE(absl::StrCat("round ", round, " ", c.shape.DebugString(),
                              " bf16 precision ",
                              c.options.precision == Precision::kBFloat16));
    ASSERT_NO_FATAL_FAILURE(
        ExpectHalfEqualsWidened(*engine, c, dtype, round * 3 + 1));
  }
}

// Windowed tiles run their bands over a part of a key block: where the tiles
// widen a block first (f32 precision), the part lies in the widened copy.
TEST_P(HalfInputsTest, WindowedBandsReadTheirPartOfAWidenedBlock) {
  const DataType dtype = std::get<0>(GetParam());
  std::unique_ptr<AttentionEngine> engine = MakeEngine();
  for (const bool causal : {false, true}) {
    for (const Precision precision :
         {Precision::kFloat32, Precision::kBFloat16}) {
      Case c;
      c.shape = testing::SdpaShape(2, 2, 1, 300, 700, 16, 24);
      c.options.causal = causal;
      c.options.causal_alignment = CausalAlignment::kBottomRight;
      c.options.window_left = 130;
      c.options.window_right = causal ? -1 : 70;
      c.options.precision = precision;
      c.options.return_lse = true;
      SCOPED_TRACE(absl::StrCat("causal ", causal, " bf16 precision ",
                                precision == Precision::kBFloat16));
      ASSERT_NO_FATAL_FAILURE(ExpectHalfEqualsWidened(*engine, c, dtype, 11));
    }
  }
}

TEST_P(HalfInputsTest, DecodeAndTheUnfusedKernelAndMisalignedSpansAgree) {
  const DataType dtype = std::get<0>(GetParam());
  std::unique_ptr<AttentionEngine> fused = MakeEngine();
  std::unique_ptr<AttentionEngine> unfused =
      MakeEngine(AttentionKernel::kUnfused);
  AttentionShape s;
  s.batch = 2;
  s.heads = 8;
  s.kv_heads = 2;
  s.key_len = 333;
  s.key_dim = s.value_dim = 64;
  for (const int64_t query_len : {1, 40}) {
    s.query_len = query_len;
    SCOPED_TRACE(s.DebugString());
    AttentionOptions options;
    options.causal = true;
    options.causal_alignment = CausalAlignment::kBottomRight;
    const HalfTensor query = Store(RandomValues(s.QueryElements(), 5), dtype);
    const HalfTensor key = Store(RandomValues(s.KeyElements(), 6), dtype);
    const HalfTensor value = Store(RandomValues(s.ValueElements(), 7), dtype);
    std::vector<float> expected(s.OutputElements());
    ASSERT_TRUE(fused
                    ->Attend(s, options, query.widened, key.widened,
                             value.widened,
                             AttentionOutputs(absl::MakeSpan(expected)))
                    .ok());
    // Decode goes to the paged kernel, whose sums run in another order.
    const auto expect_close = [&expected](const std::vector<float>& actual) {
      for (size_t i = 0; i < expected.size(); ++i) {
        ASSERT_NEAR(actual[i], expected[i], 1e-5) << "element " << i;
      }
    };
    std::vector<float> output(s.OutputElements());
    ASSERT_TRUE(fused
                    ->AttendHalf(s, options, dtype, Bytes(query), Bytes(key),
                                 Bytes(value),
                                 AttentionOutputs(absl::MakeSpan(output)))
                    .ok());
    expect_close(output);
    // Widened first, then the same kernels as Attend.
    ASSERT_TRUE(unfused
                    ->AttendHalf(s, options, dtype, Bytes(query), Bytes(key),
                                 Bytes(value),
                                 AttentionOutputs(absl::MakeSpan(output)))
                    .ok());
    expect_close(output);
    // A view one byte off: widened first too.
    std::vector<char> shifted(query.bytes.size() + 1);
    std::memcpy(shifted.data() + 1, Bytes(query).data(), Bytes(query).size());
    ASSERT_TRUE(fused
                    ->AttendHalf(s, options, dtype,
                                 absl::MakeConstSpan(shifted).subspan(
                                     1, Bytes(query).size()),
                                 Bytes(key), Bytes(value),
                                 AttentionOutputs(absl::MakeSpan(output)))
                    .ok());
    expect_close(output);
  }
}

TEST_P(HalfInputsTest, PackedSequencesEqualAttendPackedOverTheWidenedValues) {
  const DataType dtype = std::get<0>(GetParam());
  std::unique_ptr<AttentionEngine> engine = MakeEngine();
  std::mt19937_64 rng(dtype == DataType::kBFloat16 ? 91 : 92);
  const auto pick = [&rng](std::initializer_list<int64_t> values) {
    return *(values.begin() +
             std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng));
  };
  for (int round = 0; round < 20; ++round) {
    PackedShape shape;
    shape.kv_heads = pick({1, 2});
    shape.heads = shape.kv_heads * pick({1, 4});
    shape.key_dim = pick({16, 33});
    shape.value_dim = pick({16, 24});
    std::vector<int64_t> cu_q = {0}, cu_k = {0};
    for (int64_t i = 0, n = pick({1, 3}); i < n; ++i) {
      cu_q.push_back(cu_q.back() + pick({0, 1, 9, 70}));
      cu_k.push_back(cu_k.back() + pick({0, 1, 40, 300}));
    }
    shape.cu_seqlens_q = cu_q;
    shape.cu_seqlens_k = cu_k;
    AttentionOptions options;
    options.causal = pick({0, 1}) == 1;
    options.causal_alignment = CausalAlignment::kBottomRight;
    if (pick({0, 1}) == 1) options.window_left = pick({3, 50});
    options.precision =
        pick({0, 1}) == 1 ? Precision::kBFloat16 : Precision::kFloat32;
    options.return_lse = true;
    SCOPED_TRACE(absl::StrCat("round ", round, " H ", shape.heads, " Hkv ",
                              shape.kv_heads, " Dk ", shape.key_dim, " Dv ",
                              shape.value_dim, " bf16 precision ",
                              options.precision == Precision::kBFloat16));
    const int64_t total_q = cu_q.back(), total_k = cu_k.back();
    const HalfTensor query = Store(
        RandomValues(total_q * shape.heads * shape.key_dim, round + 1), dtype);
    const HalfTensor key =
        Store(RandomValues(total_k * shape.kv_heads * shape.key_dim, round + 2),
              dtype);
    const HalfTensor value = Store(
        RandomValues(total_k * shape.kv_heads * shape.value_dim, round + 3),
        dtype);
    Result half{std::vector<float>(total_q * shape.heads * shape.value_dim),
                std::vector<float>(total_q * shape.heads)};
    Result wide = half;
    ASSERT_TRUE(
        engine
            ->AttendPackedHalf(shape, options, dtype, Bytes(query), Bytes(key),
                               Bytes(value),
                               AttentionOutputs(absl::MakeSpan(half.output), {},
                                                absl::MakeSpan(half.lse)))
            .ok());
    ASSERT_TRUE(
        engine
            ->AttendPacked(shape, options, query.widened, key.widened,
                           value.widened,
                           AttentionOutputs(absl::MakeSpan(wide.output), {},
                                            absl::MakeSpan(wide.lse)))
            .ok());
    ExpectSameBits(half, wide);
  }
}

// Half values read in place (bf16 tiles) or widened (f32 tiles, f16 ones into
// bf16 tiles): a NaN or ±inf value no row sees (past key_lengths) stays out of
// every row of a tile of many rows (4 heads of a kv head × 20 queries), whose
// P · V is a matmul, and a value a row does see makes that row NaN.
TEST_P(HalfInputsTest, HiddenNonFiniteValuesStayOutOfTilesOfManyRows) {
  const DataType dtype = std::get<0>(GetParam());
  std::unique_ptr<AttentionEngine> engine = MakeEngine();
  const AttentionShape s = testing::SdpaShape(1, 4, 1, 20, 70, 16, 16);
  const HalfTensor query = Store(RandomValues(s.QueryElements(), 51), dtype);
  const HalfTensor key = Store(RandomValues(s.KeyElements(), 52), dtype);
  const std::vector<float> finite = RandomValues(s.ValueElements(), 53);
  const std::vector<int64_t> lengths = {50};  // Outlives every call.
  const float inf = std::numeric_limits<float>::infinity();
  for (const Precision precision :
       {Precision::kFloat32, Precision::kBFloat16}) {
    AttentionOptions options;
    options.precision = precision;
    options.key_lengths = lengths;
    // The output over `values` stored as the dtype.
    const auto attend = [&](const std::vector<float>& values,
                            std::vector<float>* output) {
      const HalfTensor value = Store(values, dtype);
      output->assign(s.OutputElements(), 0.0f);
      ASSERT_TRUE(engine
                      ->AttendHalf(s, options, dtype, Bytes(query), Bytes(key),
                                   Bytes(value),
                                   AttentionOutputs(absl::MakeSpan(*output)))
                      .ok());
    };
    std::vector<float> expected, output;
    ASSERT_NO_FATAL_FAILURE(attend(finite, &expected));
    for (const float bad : {std::nanf(""), inf, -inf}) {
      SCOPED_TRACE(absl::StrCat("bf16 precision ",
                                precision == Precision::kBFloat16, " value ",
                                bad));
      std::vector<float> values = finite;
      std::fill(values.begin() + 50 * 16, values.end(), bad);
      ASSERT_NO_FATAL_FAILURE(attend(values, &output));
      // The block holding them is summed row by row, in another order.
      for (size_t i = 0; i < output.size(); ++i) {
        ASSERT_NEAR(output[i], expected[i], 1e-5) << "element " << i;
      }
    }
    // A NaN value every row sees (key 10 is within every row's length).
    std::vector<float> values = finite;
    std::fill_n(values.begin() + 10 * 16, 16, std::nanf(""));
    ASSERT_NO_FATAL_FAILURE(attend(values, &output));
    for (size_t i = 0; i < output.size(); ++i) {
      ASSERT_TRUE(std::isnan(output[i])) << "element " << i;
    }
  }
}

TEST_P(HalfInputsTest, RefusesAnotherDtypeAndSpansThatDoNotFit) {
  const DataType dtype = std::get<0>(GetParam());
  std::unique_ptr<AttentionEngine> engine = MakeEngine();
  AttentionShape s;
  s.heads = s.kv_heads = 2;
  s.query_len = 4;
  s.key_len = 8;
  s.key_dim = s.value_dim = 16;
  const HalfTensor query = Store(RandomValues(s.QueryElements(), 1), dtype);
  const HalfTensor key = Store(RandomValues(s.KeyElements(), 2), dtype);
  const HalfTensor value = Store(RandomValues(s.ValueElements(), 3), dtype);
  std::vector<float> output(s.OutputElements());
  const AttentionOutputs outputs(absl::MakeSpan(output));
  absl::Status status =
      engine->AttendHalf(s, AttentionOptions(), DataType::kFloat32,
                         Bytes(query), Bytes(key), Bytes(value), outputs);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("BFLOAT16 or FLOAT16"));
  status = engine->AttendHalf(s, AttentionOptions(), dtype, Bytes(query),
                              Bytes(key).subspan(2), Bytes(value), outputs);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              HasSubstr("key has 510 bytes, expected 512 (256 16-bit"));
}

INSTANTIATE_TEST_SUITE_P(
    DtypesAndTileCode, HalfInputsTest,
    ::testing::Combine(::testing::Values(DataType::kBFloat16,
                                         DataType::kFloat16),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<HalfInputsTest::ParamType>& param_info) {
      return absl::StrCat(
          std::get<0>(param_info.param) == DataType::kBFloat16 ? "Bf16" : "F16",
          std::get<1>(param_info.param) ? "Portable" : "Native");
    });

}  // namespace
}  // namespace attnserve
