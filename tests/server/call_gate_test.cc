#include "attnserve/server/rpc/call_gate.h"

#include <vector>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

TEST(CallGateTest, HoldsRefusalsOnlyBetweenHoldAndRelease) {
  CallGate gate({});
  std::vector<int> answered;
  EXPECT_FALSE(gate.HoldRefusal([&] { answered.push_back(0); }).has_value());
  gate.HoldRefusals();
  const std::optional<CallGate::Ticket> first =
      gate.HoldRefusal([&] { answered.push_back(1); });
  const std::optional<CallGate::Ticket> cancelled =
      gate.HoldRefusal([&] { answered.push_back(2); });
  ASSERT_TRUE(first.has_value() && cancelled.has_value());
  // A cancelled call is taken back (its handler answers it itself).
  EXPECT_TRUE(gate.Unhold(*cancelled));
  EXPECT_FALSE(gate.Unhold(*cancelled));
  EXPECT_TRUE(answered.empty());
  EXPECT_EQ(gate.ReleaseHeld(), 1);
  EXPECT_EQ(answered, std::vector<int>{1});
  // Released: Unhold fails (the release answered it), and refusals are
  // answered at once again.
  EXPECT_FALSE(gate.Unhold(*first));
  EXPECT_FALSE(gate.HoldRefusal([] {}).has_value());
}

}  // namespace
}  // namespace attnserve
