#include "attnserve/server/rpc/memory_budget.h"

#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/common/refusals.h"
#include "attnserve/server/process/memory_plan.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(MemoryBudgetTest, HoldsGiveTheirBytesBackWhenTheyGo) {
  MemoryBudget budget(64 * kMiB);
  {
    absl::StatusOr<MemoryBudget::Hold> hold = budget.Take(kMiB, "a");
    ASSERT_TRUE(hold.ok()) << hold.status();
    ASSERT_TRUE(hold->Grow(2 * kMiB).ok());
    EXPECT_EQ(hold->bytes(), 3 * kMiB);
    EXPECT_EQ(budget.held(), 3 * kMiB);
    EXPECT_EQ(budget.held_by("a"), 3 * kMiB);
    MemoryBudget::Hold moved = *std::move(hold);
    EXPECT_EQ(budget.held(), 3 * kMiB);
    moved = MemoryBudget::Hold();
    EXPECT_EQ(budget.held(), 0);
    EXPECT_EQ(budget.held_by("a"), 0);
    MemoryBudget::Hold always = budget.TakeAlways(kMiB, "b");
    EXPECT_EQ(budget.held(), kMiB);
  }
  EXPECT_EQ(budget.held(), 0);
  EXPECT_EQ(budget.refused(), 0);
}

TEST(MemoryBudgetTest, OneConnectionMayHoldHalf) {
  MemoryBudget budget(64 * kMiB);
  absl::StatusOr<MemoryBudget::Hold> first = budget.Take(30 * kMiB, "a");
  ASSERT_TRUE(first.ok());
  const absl::StatusOr<MemoryBudget::Hold> more = budget.Take(3 * kMiB, "a");
  ASSERT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(
      more.status().message(),
      AllOf(HasSubstr("this connection's calls in flight hold 31457280"),
            HasSubstr("max_inflight_bytes")));
  // A failed Grow keeps what the hold had.
  EXPECT_FALSE(first->Grow(3 * kMiB).ok());
  EXPECT_EQ(first->bytes(), 30 * kMiB);
  EXPECT_TRUE(budget.Take(30 * kMiB, "b").ok());
  const absl::StatusOr<MemoryBudget::Hold> huge = budget.Take(33 * kMiB, "c");
  EXPECT_THAT(
      huge.status().message(),
      HasSubstr("more than the 33554432 bytes one connection may hold"));
  EXPECT_EQ(budget.refused(), 3);
  // Only a call over half the budget meets the same refusal whatever the
  // others hold: it alone tells clients not to retry.
  EXPECT_TRUE(IsPermanent(huge.status()));
  EXPECT_FALSE(IsPermanent(more.status()));
}

TEST(MemoryBudgetTest, TheLastEighthIsKeptForConnectionsHoldingLittle) {
  MemoryBudget budget(64 * kMiB);
  absl::StatusOr<MemoryBudget::Hold> a = budget.Take(28 * kMiB, "a");
  absl::StatusOr<MemoryBudget::Hold> b = budget.Take(28 * kMiB, "b");
  ASSERT_TRUE(a.ok() && b.ok());
  // "a" holds much: it may not take the budget past 56 MiB.
  const absl::StatusOr<MemoryBudget::Hold> heavy = budget.Take(kMiB, "a");
  ASSERT_EQ(heavy.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(heavy.status().message(),
              AllOf(HasSubstr("this connection holds 29360128"),
                    HasSubstr("kept for clients holding little")));
  // A connection holding nothing may.
  absl::StatusOr<MemoryBudget::Hold> light = budget.Take(3 * kMiB, "c");
  ASSERT_TRUE(light.ok()) << light.status();
  absl::StatusOr<MemoryBudget::Hold> last = budget.Take(5 * kMiB, "d");
  ASSERT_TRUE(last.ok());
  const absl::StatusOr<MemoryBudget::Hold> full = budget.Take(kMiB, "e");
  EXPECT_THAT(full.status().message(),
              AllOf(HasSubstr("calls in flight hold 67108864 of the 67108864"),
                    HasSubstr("retry after a backoff")));
  EXPECT_FALSE(IsPermanent(full.status()));
  EXPECT_FALSE(IsPermanent(heavy.status()));
}

TEST(MemoryBudgetTest, ManyConnectionsFromOneAddressShareTheLastEighthRule) {
  MemoryBudget budget(64 * kMiB);
  // 400 connections from one address, each holding little: together they
  // hold much, so they may not take the budget past 56 MiB.
  std::vector<MemoryBudget::Hold> holds;
  int refused = 0;
  for (int port = 10000; port < 10400; ++port) {
    const std::string peer = absl::StrCat("ipv4:10.0.0.7:", port);
    for (int stream = 0; stream < 16; ++stream) {
      absl::StatusOr<MemoryBudget::Hold> hold =
          budget.Take(kBytesPerCall, peer);
      if (hold.ok()) {
        holds.push_back(*std::move(hold));
      } else {
        ++refused;
        EXPECT_THAT(hold.status().message(),
                    AllOf(HasSubstr("the connections from ipv4:10.0.0.7 "
                                    "(this client's and any other's at "
                                    "that address) hold"),
                          HasSubstr("kept for clients holding little")));
      }
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_EQ(budget.held_from("ipv4:10.0.0.7"), 56 * kMiB);
  EXPECT_EQ(budget.held(), 56 * kMiB);
  // Another address is served from the last eighth, up to the whole limit.
  absl::StatusOr<MemoryBudget::Hold> other =
      budget.Take(4 * kMiB, "ipv4:10.0.0.8:5000");
  ASSERT_TRUE(other.ok()) << other.status();
  absl::StatusOr<MemoryBudget::Hold> other_v6 =
      budget.Take(4 * kMiB, "ipv6:[::1]:5000");
  ASSERT_TRUE(other_v6.ok()) << other_v6.status();
  EXPECT_EQ(budget.held(), 64 * kMiB);
  holds.clear();
  EXPECT_EQ(budget.held_from("ipv4:10.0.0.7"), 0);
  EXPECT_EQ(budget.held_from("ipv6:[::1]"), 4 * kMiB);
}

TEST(MemoryBudgetTest, PeerAddressDropsThePortOnly) {
  EXPECT_EQ(PeerAddress("ipv4:10.0.0.7:51234"), "ipv4:10.0.0.7");
  EXPECT_EQ(PeerAddress("ipv6:[fe80::1%eth0]:51234"), "ipv6:[fe80::1%eth0]");
  EXPECT_EQ(PeerAddress("ipv6:%5B::1%5D:80"), "ipv6:%5B::1%5D");
  EXPECT_EQ(PeerAddress("unix:/run/attnserve.sock"),
            "unix:/run/attnserve.sock");
  EXPECT_EQ(PeerAddress("unknown"), "unknown");
  EXPECT_EQ(PeerAddress("ipv4:"), "ipv4:");
  EXPECT_EQ(PeerAddress("ipv4:10.0.0.7:"), "ipv4:10.0.0.7:");
  EXPECT_EQ(PeerAddress("a"), "a");
}

class MemoryLimitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = std::filesystem::path(::testing::TempDir()) /
            ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
  }
  void Write(const std::string& relative, const std::string& text) {
    const std::filesystem::path path = root_ / relative;
    std::filesystem::create_directories(path.parent_path());
    std::ofstream(path) << text;
  }
  MemoryLimit Read() {
    return ReadMemoryLimit((root_ / "cgroup").string(),
                           (root_ / "self_cgroup").string());
  }
  std::filesystem::path root_;
};

TEST_F(MemoryLimitTest, WithoutACgroupLimitPhysicalMemory) {
  Write("self_cgroup", "0::/pod/container\n");
  Write("cgroup/pod/container/memory.max", "max\n");
  const MemoryLimit limit = Read();
  EXPECT_EQ(limit.source, "physical memory");
  EXPECT_GT(limit.bytes, 64 * kMiB);
}

TEST_F(MemoryLimitTest, TheTightestOfTheCgroupAndItsAncestors) {
  Write("self_cgroup", "0::/pod/container\n");
  Write("cgroup/pod/container/memory.max", "3221225472\n");
  Write("cgroup/pod/memory.max", "2147483648\n");
  MemoryLimit limit = Read();
  EXPECT_EQ(limit.bytes, 2147483648);
  EXPECT_THAT(limit.source, HasSubstr("cgroup/pod/memory.max"));
}

TEST_F(MemoryLimitTest, CgroupV1AndTheContainersOwnRoot) {
  Write("self_cgroup", "4:memory:/kubepods/abc\n0::/\n");
  Write("cgroup/memory/kubepods/abc/memory.limit_in_bytes", "1073741824\n");
  EXPECT_EQ(Read().bytes, 1073741824);
  // v1 writes a huge number for "no limit".
  Write("cgroup/memory/kubepods/abc/memory.limit_in_bytes",
        "9223372036854771712\n");
  Write("cgroup/memory.max", "536870912\n");
  EXPECT_EQ(Read().bytes, 536870912);
}

// PlanMemory with these budgets asked for.
absl::StatusOr<MemoryPlan> Plan(int64_t weights, int64_t kv_cache, int64_t pool,
                                int64_t inflight, const MemoryLimit& limit) {
  MemoryOptions requested;
  requested.max_weights_bytes = weights;
  requested.kv_cache_bytes = kv_cache;
  requested.buffer_pool_bytes = pool;
  requested.max_inflight_bytes = inflight;
  return PlanMemory(requested, limit);
}

TEST(PlanMemoryTest, DerivesWhatIsLeftAtZero) {
  const MemoryLimit limit{int64_t{8} << 30, "cgroup x"};
  const absl::StatusOr<MemoryPlan> plan = Plan(0, 0, 256 * kMiB, 0, limit);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // A quarter of 8 GiB - 256 MiB (the process) - 256 MiB (the pool).
  EXPECT_EQ(plan->max_weights_bytes, 1920 * kMiB);
  EXPECT_EQ(plan->kv_cache_bytes, 1920 * kMiB);
  // A thirty-second of 8 GiB - 256 MiB: 248 MiB, 7936 connections of 32 KiB.
  EXPECT_EQ(plan->max_connections, 7936);
  // (8 GiB - 1920 MiB - 1920 MiB - 256 MiB - 256 MiB - 248 MiB) * 3/4
  EXPECT_EQ(plan->max_inflight_bytes, 2694 * kMiB);
  EXPECT_EQ(plan->transport_bytes, 2694 * kMiB / 4);
  const absl::StatusOr<MemoryPlan> big =
      Plan(0, 0, 0, 0, {int64_t{64} << 30, "physical memory"});
  EXPECT_EQ(big->max_weights_bytes, int64_t{4} << 30);  // at most 4 GiB
  EXPECT_EQ(big->kv_cache_bytes, (int64_t{64} << 30) / 4 - 64 * kMiB);
  EXPECT_EQ(big->buffer_pool_bytes, 0);
}

// The pool, left to derive, is an eighth of what the limit leaves after the
// process, at most 256 MiB; the weights and KV cache a quarter of what the
// pool leaves of that. A small container starts with small budgets (until
// 2026-12-06 a fixed 256 MiB pool and budgets of a quarter of the whole
// limit refused every limit up to 1 GiB, an audit found).
TEST(PlanMemoryTest, DerivesEveryBudgetForSmallLimitsToo) {
  const absl::StatusOr<MemoryPlan> small =
      Plan(0, 0, kDerivedBufferPool, 0, {512 * kMiB, "cgroup x"});
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->buffer_pool_bytes, 32 * kMiB);
  EXPECT_EQ(small->max_weights_bytes, 56 * kMiB);
  EXPECT_EQ(small->kv_cache_bytes, 56 * kMiB);
  EXPECT_EQ(small->max_connections, 256);
  EXPECT_EQ(small->max_inflight_bytes, 78 * kMiB);
  for (const int64_t mib : {384, 768, 1024, 1100, 2048}) {
    SCOPED_TRACE(mib);
    const absl::StatusOr<MemoryPlan> plan =
        Plan(0, 0, kDerivedBufferPool, 0, {mib * kMiB, "cgroup x"});
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_LE(plan->max_weights_bytes + plan->kv_cache_bytes +
                  plan->buffer_pool_bytes + plan->max_inflight_bytes +
                  plan->max_connections * kConnectionBytes +
                  kProcessOverheadBytes,
              mib * kMiB);
    EXPECT_GE(plan->max_connections, kLeastDerivedConnections);
    EXPECT_GT(plan->max_inflight_bytes, plan->kv_cache_bytes);
  }
  const absl::StatusOr<MemoryPlan> large =
      Plan(0, 0, kDerivedBufferPool, 0, {int64_t{8} << 30, "cgroup x"});
  EXPECT_EQ(large->buffer_pool_bytes, 256 * kMiB);  // at most 256 MiB
  // 320 MiB leaves 19.5 MiB in flight, too little to serve: refused, as 256
  // MiB, which leaves nothing once the process has its share.
  const absl::StatusOr<MemoryPlan> tight =
      Plan(0, 0, kDerivedBufferPool, 0, {320 * kMiB, "cgroup x"});
  EXPECT_EQ(tight.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(tight.status().message(),
              AllOf(HasSubstr("max_inflight_bytes (derived: 20447232)"),
                    HasSubstr("at least 32 MiB for calls in flight")));
  // Set by a flag, less is taken.
  EXPECT_TRUE(
      Plan(0, 0, kDerivedBufferPool, 16 * kMiB, {320 * kMiB, "cgroup x"}).ok());
  const absl::StatusOr<MemoryPlan> none =
      Plan(0, 0, kDerivedBufferPool, 0, {256 * kMiB, "cgroup x"});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(none.status().message(), HasSubstr("(derived: none left)"));
  // -1 is the only negative pool.
  const absl::StatusOr<MemoryPlan> negative =
      Plan(0, 0, -2, 0, {int64_t{8} << 30, "cgroup x"});
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(negative.status().message(),
              HasSubstr("buffer_pool_bytes is -2, expected >= 0, or -1"));
}

// Connections are planned at 32 KiB each: a thirty-second of what the limit
// leaves after the process, or, with every other budget set, what those leave
// (so that budgets which fit before connections were planned still fit), at
// least 64; or as many as --max_connections says, which must fit too.
TEST(PlanMemoryTest, PlansTheConnections) {
  const MemoryLimit limit{int64_t{3} << 30, "cgroup x"};
  // All set, 64 MiB left: 2048 connections rather than 2816 MiB / 32.
  absl::StatusOr<MemoryPlan> plan =
      Plan(512 * kMiB, 64 * kMiB, 128 * kMiB, 2048 * kMiB, limit);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->max_connections, 2048);
  // 1 MiB left: 32 connections, fewer than the least where that does not fit.
  plan = Plan(512 * kMiB, 64 * kMiB, 191 * kMiB, 2048 * kMiB, limit);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->max_connections, 32);
  // Nothing left: one connection, which does not fit.
  plan = Plan(512 * kMiB, 64 * kMiB, 192 * kMiB, 2048 * kMiB, limit);
  ASSERT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(plan.status().message(),
              HasSubstr("max_connections 1 of 32768 bytes"));
  // The in-flight budget derived, set budgets leaving 80 MiB: connections take
  // an eighth of it (10 MiB), the calls in flight three quarters of the rest.
  plan = Plan(1024 * kMiB, 1584 * kMiB, 128 * kMiB, 0, limit);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->max_connections, 320);
  EXPECT_EQ(plan->max_inflight_bytes, 70 * kMiB / 4 * 3);
  // Budgets near 2^63 leave nothing, and nothing overflows on the way.
  plan = Plan(std::numeric_limits<int64_t>::max(),
              std::numeric_limits<int64_t>::max(), 0, 0, limit);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  MemoryOptions requested;
  requested.max_connections = 100;
  plan = PlanMemory(requested, limit);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->max_connections, 100);
  requested.max_connections = int64_t{1} << 20;  // 32 GiB of connections
  plan = PlanMemory(requested, limit);
  ASSERT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(plan.status().message(),
              HasSubstr("max_connections 1048576 of 32768 bytes"));
  requested.max_connections = -1;
  EXPECT_THAT(PlanMemory(requested, limit).status().message(),
              HasSubstr("max_connections is -1, expected >= 0"));
}

TEST(PlanMemoryTest, RefusesBudgetsThatDoNotFit) {
  const MemoryLimit limit{int64_t{3} << 30, "cgroup /sys/fs/cgroup/memory.max"};
  EXPECT_TRUE(Plan(512 * kMiB, 64 * kMiB, 128 * kMiB, 2048 * kMiB, limit).ok());
  const absl::StatusOr<MemoryPlan> over =
      Plan(int64_t{1} << 30, 64 * kMiB, 128 * kMiB, 2048 * kMiB, limit);
  ASSERT_EQ(over.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(over.status().message(),
              AllOf(HasSubstr("max_weights_bytes 1073741824"),
                    HasSubstr("kv_cache_bytes 67108864"),
                    HasSubstr("max_inflight_bytes 2147483648"),
                    HasSubstr("3221225472 bytes of cgroup /sys/fs/cgroup")));
  // Weights alone past the limit leave nothing to derive.
  EXPECT_THAT(Plan(int64_t{3} << 30, 0, 0, 0, limit).status().message(),
              HasSubstr("(derived: none left)"));
  EXPECT_EQ(Plan(-1, 0, 0, 0, limit).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Plan(0, -1, 0, 0, limit).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnserve
