#include "attnserve/core/attention_engine.h"

#include <cmath>
#include <limits>
#include <memory>
#include <ostream>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"

namespace attnserve {
namespace {

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

AttentionShape Shape(int64_t b, int64_t h, int64_t hkv, int64_t lq, int64_t lk,
                     int64_t dk, int64_t dv) {
  AttentionShape shape;
  shape.batch = b;
  shape.heads = h;
  shape.kv_heads = hkv;
  shape.query_len = lq;
  shape.key_len = lk;
  shape.key_dim = dk;
  shape.value_dim = dv;
  return shape;
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
        ShapeCase{"AllOnes", Shape(1, 1, 1, 1, 1, 1, 1), std::nullopt},
        ShapeCase{"SingleKey", Shape(2, 3, 3, 5, 1, 8, 8), std::nullopt},
        ShapeCase{"SingleQuery", Shape(1, 2, 2, 1, 129, 16, 16), std::nullopt},
        ShapeCase{"OddSizes", Shape(3, 3, 3, 17, 17, 3, 3), std::nullopt},
        ShapeCase{"QueryLongerThanKeys", Shape(1, 2, 2, 129, 17, 32, 32),
                  std::nullopt},
        ShapeCase{"KeysLongerThanQuery", Shape(2, 1, 1, 3, 129, 17, 17),
                  std::nullopt},
        ShapeCase{"ValueDimDiffers", Shape(1, 4, 4, 17, 33, 64, 3),
                  std::nullopt},
        ShapeCase{"KeyDimDiffers", Shape(2, 2, 2, 9, 9, 1, 129), std::nullopt},
        ShapeCase{"Typical", Shape(2, 8, 8, 128, 128, 64, 64), std::nullopt},
        ShapeCase{"GroupedQuery", Shape(2, 6, 2, 17, 33, 16, 8), std::nullopt},
        ShapeCase{"MultiQuery", Shape(1, 4, 1, 3, 129, 32, 17), std::nullopt},
        ShapeCase{"CustomScale", Shape(1, 2, 2, 17, 17, 16, 16), 0.5f},
        ShapeCase{"LargeScale", Shape(1, 1, 1, 9, 65, 16, 16), 8.0f}),
    [](const ::testing::TestParamInfo<ShapeCase>& param) {
      return param.param.name;
    });

TEST(AttentionEngineTest, SplitsWorkIntoSlabsThatFitTheWorkspace) {
  // 4 groups of 32x32 scores need 16 KiB; a 5 KiB limit fits one group (4 KiB)
  // per slab.
  const AttentionShape shape = Shape(2, 2, 2, 32, 32, 8, 8);
  EngineOptions options;
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
  const AttentionShape shape = Shape(1, 1, 1, 64, 64, 1, 1);
  EngineOptions options;
  options.max_workspace_bytes = 64 * 64 * 4 - 1;
  std::vector<float> query(64), key(64), value(64), output(64);
  const absl::Status status = MakeEngine(options)->Attend(
      shape, {}, query, key, value, absl::MakeSpan(output));
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("16384 bytes"));
  EXPECT_THAT(status.message(), HasSubstr("16383"));
}

TEST(AttentionEngineTest, RejectsSpansThatDoNotMatchTheShape) {
  const AttentionShape shape = Shape(1, 1, 1, 2, 2, 2, 2);
  std::vector<float> query(4), key(3), value(4), output(4);
  const absl::Status status = MakeEngine()->Attend(shape, {}, query, key, value,
                                                   absl::MakeSpan(output));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("key has 3 elements, expected 4"));
}

TEST(AttentionEngineTest, RejectsHeadsNotAMultipleOfKvHeads) {
  const AttentionShape shape = Shape(1, 3, 2, 1, 1, 1, 1);
  std::vector<float> query(3), key(2), value(2), output(3);
  const absl::Status status = MakeEngine()->Attend(shape, {}, query, key, value,
                                                   absl::MakeSpan(output));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("shape.heads is 3"));
}

TEST(AttentionEngineTest, RejectsOverflowingShape) {
  const AttentionShape shape =
      Shape(int64_t{1} << 40, 1, 1, int64_t{1} << 30, 1, 1, 1);
  const absl::Status status =
      MakeEngine()->Attend(shape, {}, {}, {}, {}, absl::Span<float>());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("2^63"));
}

TEST(AttentionEngineTest, RejectsNonFiniteScale) {
  const AttentionShape shape = Shape(1, 1, 1, 1, 1, 1, 1);
  std::vector<float> one(1), output(1);
  AttentionOptions options;
  options.scale = std::numeric_limits<float>::infinity();
  const absl::Status status = MakeEngine()->Attend(shape, options, one, one,
                                                   one, absl::MakeSpan(output));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("options.scale"));
}

TEST(AttentionEngineTest, NonFiniteInputsPropagateWithoutCrashing) {
  const AttentionShape shape = Shape(1, 1, 1, 2, 2, 1, 1);
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

TEST(AttentionEngineTest, CreateRejectsNegativeThreads) {
  EngineOptions options;
  options.num_threads = -1;
  EXPECT_EQ(AttentionEngine::Create(options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnserve
