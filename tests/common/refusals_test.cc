// Permanent marks a refusal the same request would meet again; the mark
// survives copies and rewording, and never turns an OK status into an error.
#include "attnserve/common/refusals.h"

#include "gtest/gtest.h"

namespace attnserve {
namespace {

TEST(RefusalsTest, PermanentMarksAnErrorAndKeepsItsCodeAndMessage) {
  const absl::Status refused =
      Permanent(absl::ResourceExhaustedError("over max_elements"));
  EXPECT_TRUE(IsPermanent(refused));
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.message(), "over max_elements");
  const absl::Status copied = refused;
  EXPECT_TRUE(IsPermanent(copied));
  EXPECT_EQ(copied, refused);
}

TEST(RefusalsTest, OtherStatusesAreNotPermanent) {
  EXPECT_FALSE(IsPermanent(absl::ResourceExhaustedError("the queue is full")));
  EXPECT_FALSE(IsPermanent(absl::OkStatus()));
  // An OK status cannot carry a payload: marking it leaves it OK.
  EXPECT_TRUE(Permanent(absl::OkStatus()).ok());
  EXPECT_FALSE(IsPermanent(Permanent(absl::OkStatus())));
}

TEST(RefusalsTest, RewordingKeepsTheCodeAndTheMark) {
  const absl::Status reworded = Reworded(
      Permanent(absl::ResourceExhaustedError("query has 5120 elements")),
      "input QUERY has 5120 elements");
  EXPECT_TRUE(IsPermanent(reworded));
  EXPECT_EQ(reworded.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(reworded.message(), "input QUERY has 5120 elements");
  EXPECT_FALSE(IsPermanent(
      Reworded(absl::InvalidArgumentError("query.shape"), "QUERY.shape")));
}

}  // namespace
}  // namespace attnserve
