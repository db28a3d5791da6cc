// The FLOP counts behind every reported rate, against the score pairs a
// causal mask leaves counted one by one.
#include "attnserve/common/flops.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

// The (query, key) pairs query rows 0..Lq−1 see when row i sees keys up to
// i + offset, counted one at a time.
double PairsCounted(int64_t query_len, int64_t key_len, int64_t offset) {
  int64_t pairs = 0;
  for (int64_t i = 0; i < query_len; ++i) {
    for (int64_t j = 0; j < key_len; ++j) {
      if (j <= i + offset) ++pairs;
    }
  }
  return static_cast<double>(pairs);
}

TEST(FlopsTest, WithoutCausalEveryPairCounts) {
  EXPECT_EQ(AttentionFlops({2, 3, 5, 7, 8, 4}, /*causal=*/false),
            2.0 * 2 * 3 * 5 * 7 * (8 + 4));
}

TEST(FlopsTest, CausalCountsThePairsTheMaskLeaves) {
  for (int64_t query_len : {1, 2, 3, 7, 16, 33}) {
    for (int64_t key_len : {1, 2, 5, 16, 40}) {
      for (const bool bottom_right : {false, true}) {
        SCOPED_TRACE(testing::Message()
                     << "Lq " << query_len << ", Lk " << key_len
                     << (bottom_right ? ", bottom right" : ", top left"));
        const double pairs = PairsCounted(
            query_len, key_len, bottom_right ? key_len - query_len : 0);
        const AttentionDims dims{
            2, 3, static_cast<double>(query_len), static_cast<double>(key_len),
            8, 4};
        EXPECT_DOUBLE_EQ(AttentionFlops(dims, /*causal=*/true, bottom_right),
                         2.0 * 2 * 3 * pairs * (8 + 4));
      }
    }
  }
}

// A decode step's one query at the bottom right sees every key: the same
// count as the whole row; at the top left it sees one key.
TEST(FlopsTest, ADecodeRowAtTheBottomRightSeesEveryKey) {
  const AttentionDims decode{1, 32, 1, 4096, 128, 128};
  EXPECT_EQ(AttentionFlops(decode, true, /*bottom_right=*/true),
            AttentionFlops(decode, false));
  EXPECT_EQ(AttentionFlops(decode, true, /*bottom_right=*/false),
            AttentionFlops(decode, false) / 4096);
}

TEST(FlopsTest, MultiHeadAddsFourProjections) {
  // B 1, H 2, Lq 3, Lk 5, Dk = Dv = 4; E 8, Ekv 6, Hkv 1.
  const AttentionDims dims{1, 2, 3, 5, 4, 4};
  const double projections =
      2.0 * (3 * 8 * 2 * 4 + 5 * 6 * 1 * (4 + 4) + 3 * 2 * 4 * 8);
  EXPECT_EQ(MultiHeadFlops(dims, {8, 6, 1}, false),
            projections + AttentionFlops(dims, false));
  EXPECT_EQ(MultiHeadFlops(dims, {8, 6, 1}, true, true),
            projections + AttentionFlops(dims, true, true));
}

}  // namespace
}  // namespace attnserve
