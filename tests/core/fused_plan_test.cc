// core/internal/fused_plan.h: how the fused kernel cuts a call into tiles,
// and the workspace check that must cover whichever cut the call runs.
#include "internal/fused_plan.h"

#include <algorithm>
#include <cstdint>
#include <optional>

#include "attnserve/core/attention_types.h"
#include "core/sdpa_shape.h"
#include "gtest/gtest.h"
#include "internal/fused_attention.h"

namespace attnserve::internal::fused {
namespace {

using ::attnserve::testing::SdpaShape;

AttentionOptions Causal() {
  AttentionOptions options;
  options.causal = true;
  return options;
}

TEST(FusedPlanTest, TilesTakeTheirRowsFromEveryHeadOfAGroup) {
  const AttentionShape gqa = SdpaShape(1, 32, 8, 2048, 2048, 128);
  const Geometry g = MakeGeometry(gqa, AttentionOptions{}, 2);
  EXPECT_EQ(g.group, 4);
  EXPECT_EQ(g.rows, TileRows());
  EXPECT_EQ(g.q_block, TileRows() / 4);
  EXPECT_EQ(g.tiles, 8 * (2048 / g.q_block));
  EXPECT_EQ(g.splits, 1);
}

TEST(FusedPlanTest, CausalAndWindowedTilesKeepTheirRowsInBands) {
  const AttentionShape mha = SdpaShape(1, 16, 16, 2048, 2048, 64);
  const Geometry plain = MakeGeometry(mha, AttentionOptions{}, 2);
  EXPECT_EQ(plain.q_block, TileRows());
  EXPECT_FALSE(plain.Banded());
  // Causal tiles are as tall, their diagonal blocks run in bands of 64.
  const Geometry causal = MakeGeometry(mha, Causal(), 2);
  EXPECT_EQ(causal.q_block, TileRows());
  EXPECT_EQ(causal.band, std::min<int64_t>(kStaggeredQueries, TileRows()));
  EXPECT_EQ(causal.Banded(), TileRows() > kStaggeredQueries);
  EXPECT_EQ(causal.LastBand(causal.q_block), causal.band);
  EXPECT_EQ(causal.LastBand(kStaggeredQueries + 3), 3);
  // So are windowed tiles, causal or not: their rows start apart too.
  for (const bool causal_window : {true, false}) {
    AttentionOptions window = causal_window ? Causal() : AttentionOptions{};
    window.window_left = 128;
    const Geometry windowed = MakeGeometry(mha, window, 2);
    EXPECT_EQ(windowed.q_block, TileRows());
    EXPECT_EQ(windowed.band, causal.band);
    EXPECT_TRUE(windowed.staggered);
  }
  EXPECT_TRUE(causal.staggered);
  EXPECT_FALSE(plain.staggered);
  // A group of four keeps its rows, 64 queries of each of its heads: one
  // band. A group of two takes twice the queries in two bands.
  const Geometry four =
      MakeGeometry(SdpaShape(1, 32, 8, 2048, 2048, 128), Causal(), 2);
  EXPECT_EQ(four.q_block, TileRows() / 4);
  EXPECT_EQ(four.rows, TileRows());
  EXPECT_EQ(four.Banded(), TileRows() / 4 > kStaggeredQueries);
  EXPECT_TRUE(four.staggered);
  const Geometry two =
      MakeGeometry(SdpaShape(1, 16, 8, 2048, 2048, 128), Causal(), 2);
  EXPECT_EQ(two.q_block, TileRows() / 2);
  EXPECT_EQ(two.band, std::min<int64_t>(kStaggeredQueries, TileRows() / 2));
}

TEST(FusedPlanTest, ShortCallsOnManyThreadsTakeSmallerTilesFirst) {
  // (1, 8, 8, 128, 128, 64): one key block, nothing to split.
  const AttentionShape shape = SdpaShape(1, 8, 8, 128, 128, 64);
  const Geometry one = MakeGeometry(shape, AttentionOptions{}, 1);
  EXPECT_EQ(one.q_block, std::min<int64_t>(TileRows(), 128));
  const Geometry many = MakeGeometry(shape, AttentionOptions{}, 16);
  EXPECT_EQ(many.rows, kMinTileRows);
  EXPECT_EQ(many.tiles, 16);
  EXPECT_EQ(many.splits, 1);
  // Never below kMinTileRows: a group of 8 keeps 8 queries a head.
  const AttentionShape grouped = SdpaShape(1, 16, 2, 128, 128, 64);
  const Geometry g = MakeGeometry(grouped, AttentionOptions{}, 64);
  EXPECT_EQ(g.rows, kMinTileRows);
  EXPECT_EQ(g.q_block, kMinTileRows / 8);
  // Decode tiles stay one query a head.
  EXPECT_EQ(
      MakeGeometry(SdpaShape(1, 32, 8, 1, 4096, 128), AttentionOptions{}, 16)
          .q_block,
      1);
}

TEST(FusedPlanTest, WorkspaceCoversTheLargerTilesOfOneThread) {
  // 300 queries of one head: one thread keeps whole tiles (two of them), a
  // team of two cuts them to 64 rows, and a call too small to share runs on
  // one thread, so the check must cover that thread's larger buffers.
  const AttentionShape shape = SdpaShape(1, 1, 1, 300, 300, 64);
  const Geometry one = MakeGeometry(shape, AttentionOptions{}, 1);
  const Geometry two = MakeGeometry(shape, AttentionOptions{}, 2);
  EXPECT_EQ(two.rows, kMinTileRows);
  EXPECT_EQ(one.rows, std::min<int64_t>(TileRows(), 300));
  const std::optional<int64_t> checked =
      FusedWorkspaceBytes(shape, AttentionOptions{}, 2,
                          /*key_value_packed=*/true);
  ASSERT_TRUE(checked.has_value());
  EXPECT_GE(
      *checked,
      MakeThreadLayout(shape, one, ScratchpadAllowance(shape, one)).total);
  EXPECT_GE(
      *checked,
      2 * MakeThreadLayout(shape, two, ScratchpadAllowance(shape, two)).total);
}

}  // namespace
}  // namespace attnserve::internal::fused
