#include "attnserve/core/attention_engine.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <ostream>
#include <vector>

#include "attnserve/common/dtype.h"
#include "core/sdpa_shape.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"

namespace attnserve {
namespace {

using ::attnserve::testing::SdpaShape;

using ::attnserve::testing::RandomValues;
using ::attnserve::testing::ReferenceAttention;
using ::attnserve::testing::ReferenceShape;
using ::testing::HasSubstr;

// f32 end to end: the engine's error against a double reference stays within a
// few ulps of the output's magnitude (|output| <= 1 for inputs in [-1, 1)).
constexpr double kFloat32AbsTolerance = 2e-6;
constexpr double kFloat32RelTolerance = 1e-5;

std::unique_ptr<AttentionEngine> MakeEngine(EngineOptions options = {}) {
  absl::StatusOr<std::unique_ptr<AttentionEngine>> engine =
      AttentionEngine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return std::move(engine).value();
}

struct ShapeCase {
  const char* name;
  AttentionShape shape;
  std::optional<float> scale;
};

::attnserve::testing::ReferenceOptions ReferenceOptionsWithScale(
    std::optional<float> scale) {
  ::attnserve::testing::ReferenceOptions options;
  if (scale) options.scale = *scale;
  return options;
}

void PrintTo(const ShapeCase& test_case, std::ostream* os) {
  *os << test_case.name << " " << test_case.shape.DebugString();
}

class EngineMatchesReference : public ::testing::TestWithParam<ShapeCase> {};

TEST_P(EngineMatchesReference, WithinFloat32Tolerance) {
  const ShapeCase& test_case = GetParam();
  const AttentionShape& shape = test_case.shape;
  SCOPED_TRACE(shape.DebugString());
  const std::vector<float> query = RandomValues(shape.QueryElements(), 1);
  const std::vector<float> key = RandomValues(shape.KeyElements(), 2);
  const std::vector<float> value = RandomValues(shape.ValueElements(), 3);
  std::vector<float> output(shape.OutputElements(),
                            std::numeric_limits<float>::quiet_NaN());

  AttentionOptions options;
  options.scale = test_case.scale;
  // A small workspace limit makes the multi-shape cases run in several slabs.
  EngineOptions engine_options;
  engine_options.max_workspace_bytes = 64 << 20;
  ASSERT_TRUE(
      MakeEngine(engine_options)
          ->Attend(shape, options, query, key, value, absl::MakeSpan(output))
          .ok());

  const std::vector<double> expected =
      ReferenceAttention(
          ReferenceShape{shape.batch, shape.heads, shape.kv_heads,
                         shape.query_len, shape.key_len, shape.key_dim,
                         shape.value_dim},
          query, key, value, ReferenceOptionsWithScale(test_case.scale))
          .output;
  ASSERT_EQ(output.size(), expected.size());
  for (size_t i = 0; i < output.size(); ++i) {
    ASSERT_NEAR(
        output[i], expected[i],
        kFloat32AbsTolerance + kFloat32RelTolerance * std::abs(expected[i]))
        << "at flat index " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, EngineMatchesReference,
    ::testing::Values(
        ShapeCase{"AllOnes", SdpaShape(1, 1, 1, 1, 1, 1, 1), std::nullopt},
        ShapeCase{"SingleKey", SdpaShape(2, 3, 3, 5, 1, 8, 8), std::nullopt},
        ShapeCase{"SingleQuery", SdpaShape(1, 2, 2, 1, 129, 16, 16),
                  std::nullopt},
        ShapeCase{"OddSizes", SdpaShape(3, 3, 3, 17, 17, 3, 3), std::nullopt},
        ShapeCase{"QueryLongerThanKeys", SdpaShape(1, 2, 2, 129, 17, 32, 32),
                  std::nullopt},
        ShapeCase{"KeysLongerThanQuery", SdpaShape(2, 1, 1, 3, 129, 17, 17),
                  std::nullopt},
        ShapeCase{"ValueDimDiffers", SdpaShape(1, 4, 4, 17, 33, 64, 3),
                  std::nullopt},
        ShapeCase{"KeyDimDiffers", SdpaShape(2, 2, 2, 9, 9, 1, 129),
                  std::nullopt},
        ShapeCase{"Typical", SdpaShape(2, 8, 8, 128, 128, 64, 64),
                  std::nullopt},
        ShapeCase{"GroupedQuery", SdpaShape(2, 6, 2, 17, 33, 16, 8),
                  std::nullopt},
        ShapeCase{"MultiQuery", SdpaShape(1, 4, 1, 3, 129, 32, 17),
                  std::nullopt},
        ShapeCase{"CustomScale", SdpaShape(1, 2, 2, 17, 17, 16, 16), 0.5f},
        ShapeCase{"LargeScale", SdpaShape(1, 1, 1, 9, 65, 16, 16), 8.0f}),
    [](const ::testing::TestParamInfo<ShapeCase>& param) {
      return param.param.name;
    });

TEST(AttentionEngineTest, SplitsWorkIntoSlabsThatFitTheWorkspace) {
  // Unfused, 4 groups of 32x32 scores need 16 KiB; a 5 KiB limit fits one
  // group (4 KiB) per slab.
  const AttentionShape shape = SdpaShape(2, 2, 2, 32, 32, 8, 8);
  EngineOptions options;
  options.kernel = AttentionKernel::kUnfused;
  options.max_workspace_bytes = 5 << 10;
  const std::vector<float> query = RandomValues(shape.QueryElements(), 4);
  const std::vector<float> key = RandomValues(shape.KeyElements(), 5);
  const std::vector<float> value = RandomValues(shape.ValueElements(), 6);
  std::vector<float> output(shape.OutputElements());
  ASSERT_TRUE(MakeEngine(options)
                  ->Attend(shape, {}, query, key, value, absl::MakeSpan(output))
                  .ok());
  const std::vector<double> expected =
      ReferenceAttention(ReferenceShape{2, 2, 2, 32, 32, 8, 8}, query, key,
                         value)
          .output;
  for (size_t i = 0; i < output.size(); ++i) {
    ASSERT_NEAR(output[i], expected[i],
                kFloat32AbsTolerance + kFloat32RelTolerance);
  }
}

TEST(AttentionEngineTest, RejectsWorkspaceOverLimitBeforeComputing) {
  // Unfused, the least slab is one query row of the 4 heads sharing a kv
  // head: 4 x 1024 scores, 16 KiB.
  const AttentionShape shape = SdpaShape(1, 4, 1, 8, 1024, 1, 1);
  EngineOptions options;
  options.kernel = AttentionKernel::kUnfused;
  options.max_workspace_bytes = 4 * 1024 * 4 - 1;
  std::vector<float> query(32), key(1024), value(1024), output(32);
  const absl::Status status = MakeEngine(options)->Attend(
      shape, {}, query, key, value, absl::MakeSpan(output));
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("16384 bytes"));
  EXPECT_THAT(status.message(), HasSubstr("16383"));
}

// Slabs of a few query rows (a workspace smaller than a kv head's group of
// scores) give what whole groups give, with every option the score pass
// takes row by row: causality, key_lengths, a per-head mask, the lse and
// both kinds of weights.
TEST(AttentionEngineTest, UnfusedSlabsOfQueryRowsEqualWholeGroups) {
  const AttentionShape shape = SdpaShape(2, 4, 2, 37, 50, 8, 8);
  const std::vector<float> query = RandomValues(shape.QueryElements(), 61);
  const std::vector<float> key = RandomValues(shape.KeyElements(), 62);
  const std::vector<float> value = RandomValues(shape.ValueElements(), 63);
  const std::vector<int64_t> lengths = {50, 31};
  std::vector<uint8_t> allowed(4 * 37 * 50);
  for (size_t i = 0; i < allowed.size(); ++i) allowed[i] = i % 7 != 3;
  EngineOptions rows_options;
  rows_options.kernel = AttentionKernel::kUnfused;
  rows_options.max_workspace_bytes = 1 << 10;  // 2 rows of 2 heads x 50.
  EngineOptions groups_options = rows_options;
  groups_options.max_workspace_bytes = 1 << 20;
  std::unique_ptr<AttentionEngine> rows = MakeEngine(rows_options);
  std::unique_ptr<AttentionEngine> groups = MakeEngine(groups_options);
  for (const AttentionWeightsMode mode :
       {AttentionWeightsMode::kPerHead, AttentionWeightsMode::kHeadMean}) {
    AttentionOptions options;
    options.causal = true;
    options.causal_alignment = CausalAlignment::kBottomRight;
    options.key_lengths = lengths;
    AttentionMask mask;
    mask.dims = {1, 4, 37, 50};
    mask.allowed = allowed.data();
    options.mask = mask;
    options.return_lse = true;
    options.weights = mode;
    const int64_t weights_size = mode == AttentionWeightsMode::kPerHead
                                     ? shape.WeightsElements()
                                     : shape.HeadMeanWeightsElements();
    std::vector<float> output[2], lse[2], weights[2];
    int run = 0;
    for (AttentionEngine* engine : {rows.get(), groups.get()}) {
      output[run].assign(shape.OutputElements(), 0.0f);
      lse[run].assign(shape.LseElements(), 0.0f);
      weights[run].assign(weights_size, 0.0f);
      ASSERT_TRUE(engine
                      ->Attend(shape, options, query, key, value,
                               AttentionOutputs(absl::MakeSpan(output[run]),
                                                absl::MakeSpan(weights[run]),
                                                absl::MakeSpan(lse[run])))
                      .ok());
      ++run;
    }
    for (size_t i = 0; i < output[0].size(); ++i) {
      ASSERT_NEAR(output[0][i], output[1][i], 1e-6) << "output " << i;
    }
    for (size_t i = 0; i < lse[0].size(); ++i) {
      if (lse[0][i] == lse[1][i]) continue;  // −inf: a row that sees no key.
      ASSERT_NEAR(lse[0][i], lse[1][i], 1e-6) << "lse " << i;
    }
    for (size_t i = 0; i < weights[0].size(); ++i) {
      ASSERT_NEAR(weights[0][i], weights[1][i], 1e-6) << "weights " << i;
    }
  }
}

TEST(AttentionEngineTest, RejectsSpansThatDoNotMatchTheShape) {
  const AttentionShape shape = SdpaShape(1, 1, 1, 2, 2, 2, 2);
  std::vector<float> query(4), key(3), value(4), output(4);
  const absl::Status status = MakeEngine()->Attend(shape, {}, query, key, value,
                                                   absl::MakeSpan(output));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("key has 3 elements, expected 4"));
}

TEST(AttentionEngineTest, RejectsHeadsNotAMultipleOfKvHeads) {
  const AttentionShape shape = SdpaShape(1, 3, 2, 1, 1, 1, 1);
  std::vector<float> query(3), key(2), value(2), output(3);
  const absl::Status status = MakeEngine()->Attend(shape, {}, query, key, value,
                                                   absl::MakeSpan(output));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("shape.heads is 3"));
}

TEST(AttentionEngineTest, RejectsOverflowingShape) {
  const AttentionShape shape =
      SdpaShape(int64_t{1} << 40, 1, 1, int64_t{1} << 30, 1, 1, 1);
  const absl::Status status =
      MakeEngine()->Attend(shape, {}, {}, {}, {}, absl::Span<float>());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("2^63"));
}

TEST(AttentionEngineTest, RejectsNonFiniteScale) {
  const AttentionShape shape = SdpaShape(1, 1, 1, 1, 1, 1, 1);
  std::vector<float> one(1), output(1);
  AttentionOptions options;
  options.scale = std::numeric_limits<float>::infinity();
  const absl::Status status = MakeEngine()->Attend(shape, options, one, one,
                                                   one, absl::MakeSpan(output));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("options.scale"));
}

TEST(AttentionEngineTest, NonFiniteInputsPropagateWithoutCrashing) {
  const AttentionShape shape = SdpaShape(1, 1, 1, 2, 2, 1, 1);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> query = {nan, 0.5f}, key = {0.25f, -0.25f},
                     value = {1.0f, 2.0f};
  std::vector<float> output(2);
  ASSERT_TRUE(MakeEngine()
                  ->Attend(shape, {}, query, key, value, absl::MakeSpan(output))
                  .ok());
  EXPECT_TRUE(std::isnan(output[0]));
  EXPECT_TRUE(std::isfinite(output[1]));
}

// A score of +inf makes its row NaN, as exp(inf − inf) is, on every path
// (the fused kernel's first and later blocks, at both precisions, the unfused
// path with weights); the other rows stay finite. A +inf from the mask, and
// one from a product that overflows.
TEST(AttentionEngineTest, APositiveInfiniteScoreMakesItsRowNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  for (const int64_t query_len : {1, 5, 70}) {
    for (const int64_t key_len : {9, 300}) {
      for (const bool bf16 : {false, true}) {
        for (const bool weights : {false, true}) {
          for (const bool overflow : {false, true}) {
            SCOPED_TRACE(::testing::Message()
                         << "Lq " << query_len << " Lk " << key_len << " bf16 "
                         << bf16 << " weights " << weights << " overflow "
                         << overflow);
            const AttentionShape shape =
                SdpaShape(1, 1, 1, query_len, key_len, 8, 8);
            std::vector<float> query = RandomValues(shape.QueryElements(), 1);
            std::vector<float> key = RandomValues(shape.KeyElements(), 2);
            const std::vector<float> value =
                RandomValues(shape.ValueElements(), 3);
            const int64_t row = query_len - 1, column = key_len - 5;
            std::vector<float> bias(static_cast<size_t>(query_len * key_len),
                                    0.0f);
            AttentionOptions options;
            if (overflow) {  // q · k = 8 · 1e20 · 1e20: +inf in f32.
              std::fill_n(query.begin() + row * 8, 8, 1e20f);
              std::fill_n(key.begin() + column * 8, 8, 1e20f);
              for (int64_t j = 0; j < key_len; ++j) {
                if (j != column) std::fill_n(key.begin() + j * 8, 8, 0.0f);
              }
            } else {
              bias[static_cast<size_t>(row * key_len + column)] = inf;
              AttentionMask mask;
              mask.dims = {1, 1, query_len, key_len};
              mask.bias = bias.data();
              options.mask = mask;
            }
            if (bf16) options.precision = Precision::kBFloat16;
            if (weights) options.weights = AttentionWeightsMode::kPerHead;
            options.return_lse = true;
            std::vector<float> output(shape.OutputElements());
            std::vector<float> weights_out(weights ? shape.WeightsElements()
                                                   : 0);
            std::vector<float> lse(shape.LseElements());
            ASSERT_TRUE(
                MakeEngine()
                    ->Attend(shape, options, query, key, value,
                             AttentionOutputs(absl::MakeSpan(output),
                                              absl::MakeSpan(weights_out),
                                              absl::MakeSpan(lse)))
                    .ok());
            for (int64_t r = 0; r < query_len; ++r) {
              for (int64_t c = 0; c < 8; ++c) {
                const float o = output[static_cast<size_t>(r * 8 + c)];
                if (r == row) {
                  EXPECT_TRUE(std::isnan(o)) << "row " << r << ": " << o;
                } else if (!overflow) {
                  EXPECT_TRUE(std::isfinite(o)) << "row " << r << ": " << o;
                }
              }
            }
          }
        }
      }
    }
  }
}

// Asking for the weights changes no other answer: NaN in the value rows of
// keys no query sees (padding past key_lengths, a masked key) stays out of the
// output and lse, as without the weights, and a batch item that sees no key
// answers 0 and −inf. (The unfused product P·V alone took 0 · NaN in.)
TEST(AttentionEngineTest, HiddenNaNValuesStayOutWhenTheWeightsAreAsked) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const AttentionShape shape = SdpaShape(2, 2, 1, 3, 6, 4, 4);
  const std::vector<float> query = RandomValues(shape.QueryElements(), 31);
  const std::vector<float> key = RandomValues(shape.KeyElements(), 32);
  std::vector<float> value = RandomValues(shape.ValueElements(), 33);
  // Batch 0 sees keys 0 to 4: key 5 is padding. Batch 1 sees none.
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t j = b == 0 ? 5 : 0; j < 6; ++j) {
      std::fill_n(value.begin() + (b * 6 + j) * 4, 4, nan);
    }
  }
  const std::vector<int64_t> key_lengths = {5, 0};
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "f32");
    std::vector<float> plain_output(shape.OutputElements()),
        plain_lse(shape.LseElements());
    for (const AttentionWeightsMode mode :
         {AttentionWeightsMode::kNone, AttentionWeightsMode::kPerHead,
          AttentionWeightsMode::kHeadMean}) {
      AttentionOptions options;
      options.key_lengths = key_lengths;
      options.return_lse = true;
      options.weights = mode;
      if (bf16) options.precision = Precision::kBFloat16;
      std::vector<float> output(shape.OutputElements()),
          lse(shape.LseElements()),
          weights(mode == AttentionWeightsMode::kNone ? 0
                  : mode == AttentionWeightsMode::kPerHead
                      ? shape.WeightsElements()
                      : shape.HeadMeanWeightsElements());
      ASSERT_TRUE(MakeEngine()
                      ->Attend(shape, options, query, key, value,
                               AttentionOutputs(absl::MakeSpan(output),
                                                absl::MakeSpan(weights),
                                                absl::MakeSpan(lse)))
                      .ok());
      for (size_t i = 0; i < output.size(); ++i) {
        ASSERT_TRUE(std::isfinite(output[i])) << "output " << i;
        if (i >= output.size() / 2) {
          EXPECT_EQ(output[i], 0.0f) << i;
        }
      }
      for (size_t i = lse.size() / 2; i < lse.size(); ++i) {
        EXPECT_EQ(lse[i], -std::numeric_limits<float>::infinity());
      }
      if (mode == AttentionWeightsMode::kNone) {
        plain_output = output;
        plain_lse = lse;
      } else {
        EXPECT_EQ(output, plain_output);
        EXPECT_EQ(lse, plain_lse);
      }
    }
  }
}

// Tiles of many rows (here 4 heads of a kv head × 20 queries) take P · V as a
// matmul, which would take 0 · NaN into every row: a NaN or ±inf value stays
// out of the rows that do not see its key (padding past key_lengths, keys past
// a causal edge, a BOOL mask's), on every kernel and precision, and a row that
// sees it is NaN.
TEST(AttentionEngineTest, HiddenNonFiniteValuesStayOutOfTilesOfManyRows) {
  const float inf = std::numeric_limits<float>::infinity();
  const AttentionShape shape = SdpaShape(1, 4, 1, 20, 70, 16, 16);
  const std::vector<float> query = RandomValues(shape.QueryElements(), 41);
  const std::vector<float> key = RandomValues(shape.KeyElements(), 42);
  const std::vector<float> finite = RandomValues(shape.ValueElements(), 43);
  struct Case {
    const char* name;
    int64_t first_hidden;  // Value rows [first_hidden, 70) no query sees.
    std::function<void(AttentionOptions&)> set;
  };
  // The options' spans point into these, which outlive every call.
  const std::vector<int64_t> lengths = {50};
  std::vector<uint8_t> allowed(20 * 70, 1);
  for (int64_t i = 0; i < 20; ++i) allowed[i * 70 + 69] = 0;
  const std::vector<Case> cases = {
      {"key_lengths", 50,
       [&lengths](AttentionOptions& o) { o.key_lengths = lengths; }},
      {"causal", 20, [](AttentionOptions& o) { o.causal = true; }},
      {"bool mask", 69,
       [&allowed](AttentionOptions& o) {
         AttentionMask mask;
         mask.dims = {1, 1, 20, 70};
         mask.allowed = allowed.data();
         o.mask = mask;
       }},
  };
  for (const bool portable : {false, true}) {
    EngineOptions engine_options;
    engine_options.portable_kernels = portable;
    std::unique_ptr<AttentionEngine> engine = MakeEngine(engine_options);
    for (const Precision precision :
         {Precision::kFloat32, Precision::kBFloat16}) {
      for (const Case& test_case : cases) {
        for (const float bad : {std::nanf(""), inf, -inf}) {
          SCOPED_TRACE(::testing::Message()
                       << test_case.name << (portable ? " portable" : "")
                       << (precision == Precision::kBFloat16 ? " bf16" : "")
                       << " value " << bad);
          AttentionOptions options;
          options.precision = precision;
          test_case.set(options);
          std::vector<float> value = finite;
          for (int64_t j = test_case.first_hidden; j < 70; ++j) {
            std::fill_n(value.begin() + j * 16, 16, bad);
          }
          std::vector<float> expected(shape.OutputElements()),
              output(shape.OutputElements());
          ASSERT_TRUE(engine
                          ->Attend(shape, options, query, key, finite,
                                   AttentionOutputs(absl::MakeSpan(expected)))
                          .ok());
          ASSERT_TRUE(engine
                          ->Attend(shape, options, query, key, value,
                                   AttentionOutputs(absl::MakeSpan(output)))
                          .ok());
          for (size_t i = 0; i < output.size(); ++i) {
            ASSERT_NEAR(output[i], expected[i], 1e-5) << i;
          }
        }
      }
      // Causal: value row 10 is seen by the queries from 10 on only.
      SCOPED_TRACE(::testing::Message()
                   << "seen by some" << (portable ? " portable" : "")
                   << (precision == Precision::kBFloat16 ? " bf16" : ""));
      AttentionOptions options;
      options.precision = precision;
      options.causal = true;
      std::vector<float> value = finite;
      std::fill_n(value.begin() + 10 * 16, 16, std::nanf(""));
      std::vector<float> output(shape.OutputElements());
      ASSERT_TRUE(engine
                      ->Attend(shape, options, query, key, value,
                               AttentionOutputs(absl::MakeSpan(output)))
                      .ok());
      for (int64_t h = 0; h < 4; ++h) {
        for (int64_t i = 0; i < 20; ++i) {
          for (int64_t c = 0; c < 16; ++c) {
            const float out = output[(h * 20 + i) * 16 + c];
            ASSERT_EQ(std::isnan(out), i >= 10) << h << " " << i << " " << c;
          }
        }
      }
    }
  }
}

// Runs the engine and the reference on the same random inputs and options.
struct OptionRun {
  std::vector<float> output, weights, lse;
  ::attnserve::testing::ReferenceResult expected;
};

OptionRun RunWithOptions(
    const AttentionShape& shape, AttentionOptions options,
    ::attnserve::testing::ReferenceOptions reference_options) {
  const std::vector<float> query = RandomValues(shape.QueryElements(), 21);
  const std::vector<float> key = RandomValues(shape.KeyElements(), 22);
  const std::vector<float> value = RandomValues(shape.ValueElements(), 23);
  OptionRun run;
  run.output.assign(shape.OutputElements(),
                    std::numeric_limits<float>::quiet_NaN());
  run.weights.assign(shape.WeightsElements(),
                     std::numeric_limits<float>::quiet_NaN());
  run.lse.assign(shape.LseElements(), std::numeric_limits<float>::quiet_NaN());
  options.weights = AttentionWeightsMode::kPerHead;
  options.return_lse = true;
  const absl::Status status = MakeEngine()->Attend(
      shape, options, query, key, value,
      AttentionOutputs(absl::MakeSpan(run.output), absl::MakeSpan(run.weights),
                       absl::MakeSpan(run.lse)));
  EXPECT_TRUE(status.ok()) << status;
  run.expected = ReferenceAttention(
      ReferenceShape{shape.batch, shape.heads, shape.kv_heads, shape.query_len,
                     shape.key_len, shape.key_dim, shape.value_dim},
      query, key, value, reference_options);
  return run;
}

void ExpectRunMatches(const OptionRun& run) {
  const auto near = [](const std::vector<float>& actual,
                       const std::vector<double>& expected, const char* what) {
    ASSERT_EQ(actual.size(), expected.size()) << what;
    for (size_t i = 0; i < actual.size(); ++i) {
      if (std::isinf(expected[i])) {
        ASSERT_EQ(actual[i], expected[i]) << what << " at " << i;
      } else {
        ASSERT_NEAR(actual[i], expected[i], 1e-5 + 1e-5 * std::abs(expected[i]))
            << what << " at " << i;
      }
    }
  };
  near(run.output, run.expected.output, "output");
  near(run.weights, run.expected.weights, "weights");
  near(run.lse, run.expected.lse, "lse");
}

TEST(AttentionOptionsTest,
     CausalTopLeftAndBottomRightDifferWhenQueriesAreFewer) {
  const AttentionShape shape = SdpaShape(1, 2, 2, 3, 7, 8, 8);
  for (const bool bottom_right : {false, true}) {
    SCOPED_TRACE(bottom_right ? "BOTTOM_RIGHT" : "TOP_LEFT");
    AttentionOptions options;
    options.causal = true;
    options.causal_alignment = bottom_right ? CausalAlignment::kBottomRight
                                            : CausalAlignment::kTopLeft;
    ::attnserve::testing::ReferenceOptions reference;
    reference.causal = true;
    reference.bottom_right = bottom_right;
    const OptionRun run = RunWithOptions(shape, options, reference);
    ExpectRunMatches(run);
    // Query 0 sees key 0 alone under TOP_LEFT, keys 0..4 under BOTTOM_RIGHT (Lk
    // - Lq = 4).
    if (bottom_right) {
      EXPECT_GT(run.weights[4], 0.0f);
      EXPECT_EQ(run.weights[5], 0.0f);
    } else {
      EXPECT_GT(run.weights[0], 0.0f);
      EXPECT_EQ(run.weights[1], 0.0f);
    }
  }
}

TEST(AttentionOptionsTest, BottomRightAlignsToEachBatchItemsKeyLength) {
  const AttentionShape shape = SdpaShape(2, 1, 1, 2, 6, 4, 4);
  AttentionOptions options;
  options.causal = true;
  options.causal_alignment = CausalAlignment::kBottomRight;
  const int64_t lengths[] = {6, 3};
  options.key_lengths = lengths;
  ::attnserve::testing::ReferenceOptions reference;
  reference.causal = reference.bottom_right = true;
  reference.key_lengths = {6, 3};
  const OptionRun run = RunWithOptions(shape, options, reference);
  ExpectRunMatches(run);
  // Batch 1, query 0: valid length 3, so it sees keys 0..1 (0 + 3 - 2), not
  // 0..4.
  const float* row = &run.weights[(1 * 2 + 0) * 6];
  EXPECT_GT(row[1], 0.0f);
  EXPECT_EQ(row[2], 0.0f);
}

TEST(AttentionOptionsTest,
     RowWithNothingToAttendIsZeroWithNegativeInfinityLse) {
  const AttentionShape shape = SdpaShape(2, 2, 1, 3, 5, 4, 6);
  AttentionOptions options;
  const int64_t lengths[] = {0, 5};
  options.key_lengths = lengths;
  ::attnserve::testing::ReferenceOptions reference;
  reference.key_lengths = {0, 5};
  const OptionRun run = RunWithOptions(shape, options, reference);
  ExpectRunMatches(run);
  for (int64_t i = 0; i < 2 * 3 * 6; ++i) EXPECT_EQ(run.output[i], 0.0f) << i;
  for (int64_t i = 0; i < 2 * 3; ++i) {
    EXPECT_EQ(run.lse[i], -std::numeric_limits<float>::infinity()) << i;
  }
}

TEST(AttentionOptionsTest, BroadcastMasksMatchReference) {
  const AttentionShape shape = SdpaShape(2, 4, 2, 5, 7, 8, 3);
  struct MaskCase {
    const char* name;
    std::array<int64_t, 4> dims;
    bool boolean;
  };
  const MaskCase cases[] = {{"LqLkBool", {1, 1, 5, 7}, true},
                            {"PerBatchKeyBool", {2, 1, 1, 7}, true},
                            {"FullFloat", {2, 4, 5, 7}, false},
                            {"PerHeadFloat", {1, 4, 1, 1}, false}};
  for (const MaskCase& test_case : cases) {
    SCOPED_TRACE(test_case.name);
    const int64_t count = test_case.dims[0] * test_case.dims[1] *
                          test_case.dims[2] * test_case.dims[3];
    std::vector<float> bias = RandomValues(count, 31);
    std::vector<uint8_t> allowed(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) allowed[i] = bias[i] > -0.6f ? 1 : 0;
    AttentionMask mask;
    mask.dims = test_case.dims;
    ::attnserve::testing::ReferenceMask reference_mask;
    reference_mask.shape.assign(test_case.dims.begin(), test_case.dims.end());
    if (test_case.boolean) {
      mask.allowed = allowed.data();
      reference_mask.allowed = allowed;
    } else {
      mask.bias = bias.data();
      reference_mask.bias = bias;
    }
    AttentionOptions options;
    options.mask = mask;
    ::attnserve::testing::ReferenceOptions reference;
    reference.mask = reference_mask;
    ExpectRunMatches(RunWithOptions(shape, options, reference));
  }
}

TEST(AttentionOptionsTest, RejectsKeyLengthsOutOfRange) {
  const AttentionShape shape = SdpaShape(2, 1, 1, 1, 4, 1, 1);
  std::vector<float> query(2), key(8), value(8), output(2);
  const int64_t lengths[] = {4, 5};
  AttentionOptions options;
  options.key_lengths = lengths;
  const absl::Status status = MakeEngine()->Attend(
      shape, options, query, key, value, absl::MakeSpan(output));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              HasSubstr("options.key_lengths[1] is 5, expected 0 to 4"));
}

// A stop check that says stop from its `stop_at`-th poll on, counting polls.
// Thread-safe, as the engine's threads poll it concurrently.
struct CountingStop {
  explicit CountingStop(int64_t stop_at_poll) : stop_at(stop_at_poll) {}

  StopCheck Check() {
    return [this]() -> absl::Status {
      if (polls.fetch_add(1) + 1 >= stop_at) {
        return absl::CancelledError("stopped by the test");
      }
      return absl::OkStatus();
    };
  }

  const int64_t stop_at;
  std::atomic<int64_t> polls{0};
};

// Attend with `stop` in its options; returns its status and output.
absl::Status AttendWithStop(AttentionEngine& engine,
                            const AttentionShape& shape, StopCheck stop,
                            std::vector<float>* output) {
  const std::vector<float> query = RandomValues(shape.QueryElements(), 41);
  const std::vector<float> key = RandomValues(shape.KeyElements(), 42);
  const std::vector<float> value = RandomValues(shape.ValueElements(), 43);
  output->assign(static_cast<size_t>(shape.OutputElements()), 0.0f);
  AttentionOptions options;
  options.stop = std::move(stop);
  return engine.Attend(shape, options, query, key, value,
                       absl::MakeSpan(*output));
}

// The fused kernel polls between tiles and key blocks: a check that says
// stop on its fifth poll ends the call with the check's error; one that never
// does changes nothing in the output.
TEST(StopCheckTest, FusedAttendStopsBetweenTilesAndBlocks) {
  std::unique_ptr<AttentionEngine> engine = MakeEngine();
  const AttentionShape shape = SdpaShape(1, 2, 2, 1024, 2048, 32, 32);
  std::vector<float> plain, polled, stopped;
  ASSERT_TRUE(AttendWithStop(*engine, shape, StopCheck(), &plain).ok());
  CountingStop never(std::numeric_limits<int64_t>::max());
  ASSERT_TRUE(AttendWithStop(*engine, shape, never.Check(), &polled).ok());
  EXPECT_EQ(plain, polled);
  // Every tile's every key block at least: tiles of at most 256 query rows
  // (fused_plan.h's TileRows), blocks of 256 keys.
  EXPECT_GE(never.polls.load(), 2 * (1024 / 256) * (2048 / 256));
  CountingStop fifth(5);
  const absl::Status status =
      AttendWithStop(*engine, shape, fifth.Check(), &stopped);
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_THAT(status.message(), HasSubstr("stopped by the test"));
  // Once stopped, the other threads stop polling the check itself.
  EXPECT_LT(fifth.polls.load(), never.polls.load());
}

// The unfused path polls between its slabs.
TEST(StopCheckTest, UnfusedAttendStopsBetweenSlabs) {
  EngineOptions options;
  options.kernel = AttentionKernel::kUnfused;
  options.max_workspace_bytes = 5 << 10;  // One group of scores per slab.
  std::unique_ptr<AttentionEngine> engine = MakeEngine(options);
  const AttentionShape shape = SdpaShape(2, 2, 2, 32, 32, 8, 8);
  std::vector<float> plain, polled, stopped;
  ASSERT_TRUE(AttendWithStop(*engine, shape, StopCheck(), &plain).ok());
  CountingStop never(std::numeric_limits<int64_t>::max());
  ASSERT_TRUE(AttendWithStop(*engine, shape, never.Check(), &polled).ok());
  EXPECT_EQ(plain, polled);
  EXPECT_EQ(never.polls.load(), 4);  // Four slabs.
  CountingStop second(2);
  EXPECT_EQ(AttendWithStop(*engine, shape, second.Check(), &stopped).code(),
            absl::StatusCode::kCancelled);
  EXPECT_EQ(second.polls.load(), 2);
}

// Where one kv head's group of scores is more than a slab (4M scores, or the
// workspace), slabs take some of its query rows, and the path polls between
// them.
TEST(StopCheckTest, UnfusedAttendStopsBetweenRowsOfOneGroup) {
  EngineOptions options;
  options.kernel = AttentionKernel::kUnfused;
  options.max_workspace_bytes = int64_t{1} << 30;
  std::unique_ptr<AttentionEngine> engine = MakeEngine(options);
  // 8M scores: two slabs of 2048 rows.
  const AttentionShape shape = SdpaShape(1, 1, 1, 4096, 2048, 16, 16);
  std::vector<float> polled, stopped;
  CountingStop never(std::numeric_limits<int64_t>::max());
  ASSERT_TRUE(AttendWithStop(*engine, shape, never.Check(), &polled).ok());
  EXPECT_EQ(never.polls.load(), 2);
  CountingStop second(2);
  EXPECT_EQ(AttendWithStop(*engine, shape, second.Check(), &stopped).code(),
            absl::StatusCode::kCancelled);
  EXPECT_EQ(second.polls.load(), 2);
}

// MultiHeadAttention polls between its projections and its attention.
TEST(StopCheckTest, MultiHeadAttentionStopsBetweenStages) {
  std::unique_ptr<AttentionEngine> engine = MakeEngine();
  MultiHeadShape s;
  s.query_len = s.key_len = 16;
  s.embed_dim = s.kv_embed_dim = 32;
  s.heads = s.kv_heads = 2;
  s.key_dim = s.value_dim = 16;
  const std::vector<float> w_q = RandomValues(32 * 32, 51);
  const std::vector<float> w_k = RandomValues(32 * 32, 52);
  const std::vector<float> w_v = RandomValues(32 * 32, 53);
  const std::vector<float> w_o = RandomValues(32 * 32, 54);
  ProjectionWeights weights;
  weights.w_q = w_q;
  weights.w_k = w_k;
  weights.w_v = w_v;
  weights.w_o = w_o;
  const std::vector<float> input = RandomValues(16 * 32, 55);
  std::vector<float> output(input.size());
  for (const int64_t stop_at : {1, 2, 4, 5}) {
    SCOPED_TRACE(stop_at);
    CountingStop stop(stop_at);
    AttentionOptions options;
    options.stop = stop.Check();
    EXPECT_EQ(engine
                  ->MultiHeadAttention(s, weights, options, input, {},
                                       absl::MakeSpan(output))
                  .code(),
              absl::StatusCode::kCancelled);
    EXPECT_EQ(stop.polls.load(), stop_at);
  }
}

// AttendDecode reads bf16 keys and values where they lie and answers as
// Attend over the same values widened; it refuses what it does not take.
TEST(AttendDecodeTest, EqualsAttendOverTheWidenedValuesAndRefusesTheRest) {
  std::unique_ptr<AttentionEngine> engine = MakeEngine();
  const AttentionShape shape = SdpaShape(2, 4, 2, 1, 77, 32, 16);
  const std::vector<float> query = RandomValues(shape.QueryElements(), 61);
  std::vector<uint16_t> key(static_cast<size_t>(shape.KeyElements()));
  std::vector<uint16_t> value(static_cast<size_t>(shape.ValueElements()));
  std::vector<float> key_f32(key.size()), value_f32(value.size());
  const std::vector<float> k = RandomValues(shape.KeyElements(), 62);
  const std::vector<float> v = RandomValues(shape.ValueElements(), 63);
  for (size_t i = 0; i < key.size(); ++i) {
    key[i] = Float32ToBFloat16(k[i]);
    key_f32[i] = BFloat16ToFloat32(key[i]);
  }
  for (size_t i = 0; i < value.size(); ++i) {
    value[i] = Float32ToBFloat16(v[i]);
    value_f32[i] = BFloat16ToFloat32(value[i]);
  }
  const auto bytes = [](const std::vector<uint16_t>& values) {
    return absl::MakeConstSpan(reinterpret_cast<const char*>(values.data()),
                               values.size() * sizeof(uint16_t));
  };
  AttentionOptions options;
  const int64_t lengths[] = {77, 5};
  options.key_lengths = lengths;
  options.causal = true;
  options.causal_alignment = CausalAlignment::kBottomRight;
  std::vector<float> decoded(shape.OutputElements()), attended(decoded.size());
  ASSERT_TRUE(engine
                  ->AttendDecode(shape, options, query, DataType::kBFloat16,
                                 bytes(key), bytes(value),
                                 absl::MakeSpan(decoded))
                  .ok());
  ASSERT_TRUE(engine
                  ->Attend(shape, options, query, key_f32, value_f32,
                           absl::MakeSpan(attended))
                  .ok());
  for (size_t i = 0; i < decoded.size(); ++i) {
    ASSERT_NEAR(decoded[i], attended[i],
                1e-6 * std::max(1.0f, std::abs(attended[i])))
        << i;
  }
  // Not decode-shaped, and bytes that do not fit.
  const AttentionShape two_rows = SdpaShape(2, 4, 2, 2, 77, 32, 16);
  std::vector<float> more(two_rows.OutputElements());
  EXPECT_EQ(engine
                ->AttendDecode(two_rows, options,
                               RandomValues(two_rows.QueryElements(), 64),
                               DataType::kBFloat16, bytes(key), bytes(value),
                               absl::MakeSpan(more))
                .code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status short_key = engine->AttendDecode(
      shape, options, query, DataType::kBFloat16,
      bytes(key).subspan(0, key.size()), bytes(value), absl::MakeSpan(decoded));
  EXPECT_EQ(short_key.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_key.message(), HasSubstr("expected 19712 and 9856"));
}

// A decode call of a GQA group at f32 precision runs on the paged kernel on
// every CPU: Attend answers bit for bit as AttendDecode over the same f32
// keys and values.
TEST(AttendDecodeTest, GqaDecodeAtF32RunsOnThePagedKernel) {
  std::unique_ptr<AttentionEngine> engine = MakeEngine();
  const AttentionShape shape = SdpaShape(3, 8, 2, 1, 700, 64, 64);
  const std::vector<float> query = RandomValues(shape.QueryElements(), 71);
  const std::vector<float> key = RandomValues(shape.KeyElements(), 72);
  const std::vector<float> value = RandomValues(shape.ValueElements(), 73);
  const auto bytes = [](const std::vector<float>& values) {
    return absl::MakeConstSpan(reinterpret_cast<const char*>(values.data()),
                               values.size() * sizeof(float));
  };
  std::vector<float> decoded(shape.OutputElements()), attended(decoded.size());
  std::vector<float> decoded_lse(shape.batch * shape.heads),
      attended_lse(decoded_lse.size());
  AttentionOptions options;
  options.return_lse = true;
  ASSERT_TRUE(
      engine
          ->AttendDecode(
              shape, options, query, DataType::kFloat32, bytes(key),
              bytes(value),
              {absl::MakeSpan(decoded), {}, absl::MakeSpan(decoded_lse)})
          .ok());
  const absl::Status attend = engine->Attend(
      shape, options, query, key, value,
      {absl::MakeSpan(attended), {}, absl::MakeSpan(attended_lse)});
  ASSERT_TRUE(attend.ok()) << attend;
  EXPECT_EQ(decoded, attended);
  EXPECT_EQ(decoded_lse, attended_lse);
}

TEST(AttentionEngineTest, CreateRejectsNegativeThreads) {
  EngineOptions options;
  options.num_threads = -1;
  EXPECT_EQ(AttentionEngine::Create(options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Scaled scores far past any model's (scale up to 1e18 on inputs in [-1, 1):
// scores up to about 3e18) are a one-hot softmax: every path answers the value
// row of the row's largest score, and a finite lse. The AVX-512 fused kernel
// had answered inf and NaN from about 1e9 on: its exponent's FMA against a
// rounded shift gave the max 2^x past f32's range.
TEST(AttentionEngineTest, HugeScoresGiveTheLargestScoresValueRow) {
  struct Path {
    const char* name;
    EngineOptions engine;
  };
  EngineOptions portable, avx2;
  portable.portable_kernels = true;
  avx2.avx2_kernels = true;
  const Path paths[] = {
      {"default", {}}, {"portable", portable}, {"avx2", avx2}};
  // One query head per kv head (the fused kernel), and a GQA group of decode
  // rows (the paged kernel at f32).
  const ReferenceShape shapes[] = {{1, 1, 1, 1, 300, 8, 8},
                                   {1, 1, 1, 5, 300, 8, 8},
                                   {1, 2, 2, 70, 300, 8, 8},
                                   {2, 4, 2, 1, 300, 8, 8}};
  for (const float scale : {1e6f, 1e8f, 1e9f, 1e10f, 1e12f, 1e15f, 1e18f}) {
    for (const ReferenceShape& s : shapes) {
      const AttentionShape shape =
          SdpaShape(s.batch, s.heads, s.kv_heads, s.query_len, s.key_len,
                    s.key_dim, s.value_dim);
      const std::vector<float> query = RandomValues(shape.QueryElements(), 1);
      const std::vector<float> key = RandomValues(shape.KeyElements(), 2);
      const std::vector<float> value = RandomValues(shape.ValueElements(), 3);
      for (const Precision precision :
           {Precision::kFloat32, Precision::kBFloat16}) {
        // At BF16 precision the kernels read Q, K and V rounded to bf16, and
        // the largest score is that of the rounded inputs.
        const auto rounded = [precision](std::vector<float> values) {
          if (precision == Precision::kBFloat16) {
            for (float& x : values) x = BFloat16ToFloat32(Float32ToBFloat16(x));
          }
          return values;
        };
        ::attnserve::testing::ReferenceOptions reference_options;
        reference_options.scale = scale;
        const ::attnserve::testing::ReferenceResult expected =
            ReferenceAttention(s, rounded(query), rounded(key), rounded(value),
                               reference_options);
        for (const Path& path : paths) {
          SCOPED_TRACE(::testing::Message()
                       << "scale " << scale << " shape " << shape.DebugString()
                       << " " << path.name << " bf16 "
                       << (precision == Precision::kBFloat16));
          AttentionOptions options;
          options.scale = scale;
          options.precision = precision;
          options.return_lse = true;
          std::vector<float> output(shape.OutputElements());
          std::vector<float> lse(shape.LseElements());
          ASSERT_TRUE(MakeEngine(path.engine)
                          ->Attend(shape, options, query, key, value,
                                   AttentionOutputs(absl::MakeSpan(output), {},
                                                    absl::MakeSpan(lse)))
                          .ok());
          // docs/api.md's tolerances; lse's relative to its magnitude too.
          const bool bf16 = precision == Precision::kBFloat16;
          const double tolerance = bf16 ? 2e-2 : 1e-5;
          for (size_t i = 0; i < output.size(); ++i) {
            ASSERT_NEAR(output[i], expected.output[i],
                        tolerance * (1 + std::abs(expected.output[i])))
                << "output " << i;
          }
          for (size_t i = 0; i < lse.size(); ++i) {
            ASSERT_NEAR(lse[i], expected.lse[i],
                        (bf16 ? 5e-2 : 1e-4) + 1e-6 * std::abs(expected.lse[i]))
                << "lse " << i;
          }
        }
      }
    }
  }
}

// The same when the huge scores come only in a later key block, after a first
// block of small ones: the kernel had raised its shift there by a rounded FMA
// and answered NaN (a review's case: scale 1e9, keys 0-255 near 0, keys from
// 256 on at 1-2 with the largest at 280).
TEST(AttentionEngineTest, HugeScoresInALaterKeyBlockGiveTheLargestsValueRow) {
  EngineOptions portable;
  portable.portable_kernels = true;
  for (const int64_t query_len : {1, 5, 70}) {
    for (const float first : {0.0f, 5e-8f, 8e-8f}) {
      for (const float big : {2.003f, 1.0f, 3.7f, 0.01f}) {
        const ReferenceShape s = {1, 1, 1, query_len, 300, 8, 8};
        const AttentionShape shape = SdpaShape(1, 1, 1, query_len, 300, 8, 8);
        std::vector<float> query(shape.QueryElements(), 0.0f);
        for (int64_t i = 0; i < query_len; ++i) query[i * 8] = 1.0f;
        std::vector<float> key(shape.KeyElements(), 0.0f);
        key[0] = first;
        for (int64_t j = 256; j < 300; ++j) key[j * 8] = big * 0.5f;
        key[280 * 8] = big;
        const std::vector<float> value = RandomValues(shape.ValueElements(), 5);
        ::attnserve::testing::ReferenceOptions reference_options;
        reference_options.scale = 1e9;
        const ::attnserve::testing::ReferenceResult expected =
            ReferenceAttention(s, query, key, value, reference_options);
        for (const bool use_portable : {false, true}) {
          SCOPED_TRACE(::testing::Message()
                       << "Lq " << query_len << " first " << first << " big "
                       << big << " portable " << use_portable);
          AttentionOptions options;
          options.scale = 1e9f;
          options.return_lse = true;
          std::vector<float> output(shape.OutputElements());
          std::vector<float> lse(shape.LseElements());
          ASSERT_TRUE(MakeEngine(use_portable ? portable : EngineOptions{})
                          ->Attend(shape, options, query, key, value,
                                   AttentionOutputs(absl::MakeSpan(output), {},
                                                    absl::MakeSpan(lse)))
                          .ok());
          for (size_t i = 0; i < output.size(); ++i) {
            ASSERT_NEAR(output[i], expected.output[i],
                        1e-5 * (1 + std::abs(expected.output[i])))
                << "output " << i;
          }
          for (size_t i = 0; i < lse.size(); ++i) {
            ASSERT_NEAR(lse[i], expected.lse[i],
                        1e-4 + 1e-6 * std::abs(expected.lse[i]))
                << "lse " << i;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace attnserve
