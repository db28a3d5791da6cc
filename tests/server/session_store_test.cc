// SessionStore's per-identity accounting: what counts against a caller's
// share (HeldBytes) stays equal to its sessions' distinct pages and their
// bookkeeping through random creations, appends, forks, truncations,
// windows that free pages, deletions and evictions; and no caller passes its
// caps.
#include "attnserve/server/sessions/session_store.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "attnserve/server/sessions/session_requests.h"
#include "attnserve/v1/attention.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

constexpr int64_t kPageTokens = 8;

// What SessionStore charges a session besides its pages: its record, each
// layer's, and a table entry for each page a layer's length spans (a freed
// page keeps its entry).
int64_t Bookkeeping(const SessionDescription& session) {
  int64_t bytes = 1024 + 48 * session.config.layers +
                  4 * static_cast<int64_t>(session.config.alibi_slopes.size());
  for (const int64_t length : session.lengths) {
    bytes += 16 * ((length + kPageTokens - 1) / kPageTokens);
  }
  return bytes;
}

struct Budgets {
  const char* name;
  EvictionPolicy eviction;
  int64_t kv_cache_bytes;
  int64_t max_sessions;
  int64_t max_sessions_per_identity;
  int64_t kv_cache_bytes_per_identity;
};

class SessionStoreAccountingTest : public ::testing::TestWithParam<Budgets> {};

TEST_P(SessionStoreAccountingTest, HeldBytesFollowEveryOperation) {
  const Budgets& run = GetParam();
  SessionOptions options;
  options.kv_cache_bytes = run.kv_cache_bytes;
  options.eviction = run.eviction;
  options.page_tokens = kPageTokens;
  options.max_sessions = run.max_sessions;
  options.max_sessions_per_identity = run.max_sessions_per_identity;
  options.kv_cache_bytes_per_identity = run.kv_cache_bytes_per_identity;
  SessionStore store(options, nullptr);
  const std::vector<std::string> owners = {"alice", "bob", "carol"};
  std::mt19937_64 random(2026);
  const auto pick = [&random](int64_t n) {
    return static_cast<int64_t>(random() % static_cast<uint64_t>(n));
  };
  std::vector<float> values(2 * 64 * 4, 0.5f);
  int failures = 0;
  for (int op = 0; op < 3000; ++op) {
    // The flooder, alice, acts half the time.
    const std::string& owner =
        owners[static_cast<size_t>(pick(2) == 0 ? 0 : 1 + pick(2))];
    const SessionListing listing = store.List(owner);
    const std::vector<SessionDescription>& mine = listing.sessions;
    const int kind = static_cast<int>(pick(mine.empty() ? 1 : 6));
    absl::Status status;
    if (kind == 0) {
      SessionConfig config;
      config.layers = 1 + pick(2);
      config.heads = 2;
      config.kv_heads = 2;
      config.key_dim = 4;
      config.value_dim = 4;
      config.max_tokens = 1000;
      if (pick(3) == 0) {
        config.window_left = 12;
        config.num_sink_tokens = 2;
        config.evict_outside_window = true;
      }
      status = store.Create(owner, config).status();
    } else {
      const SessionDescription& session =
          mine[static_cast<size_t>(pick(static_cast<int64_t>(mine.size())))];
      const int64_t length = session.lengths[0];
      if (kind == 1) {
        status =
            store
                .Fork(owner, session.id, pick(length + 1), absl::ZeroDuration())
                .status();
      } else if (kind == 2) {
        status = store.Truncate(owner, session.id, pick(length + 1)).status();
      } else if (kind == 3 && pick(4) == 0) {
        status = store.Delete(owner, session.id).status();
      } else {
        absl::StatusOr<SessionStore::Pin> pin =
            store.Acquire(owner, session.id);
        ASSERT_TRUE(pin.ok()) << pin.status();
        const int64_t layer = pick(session.config.layers);
        KvAppend append;
        append.tokens = 1 + pick(40);
        append.key = reinterpret_cast<const char*>(values.data());
        append.value = append.key;
        int64_t now = 0;
        status = store
                     .AppendAndView(*pin, layer,
                                    session.lengths[static_cast<size_t>(layer)],
                                    append, pick(3), &now)
                     .status();
      }
    }
    if (!status.ok()) ++failures;
    // Every owner's account against what its sessions hold.
    int64_t pages = 0;
    for (const std::string& who : owners) {
      const SessionListing held = store.List(who);
      // A page's totals come from the account, not from the tables.
      const SessionListing paged = store.List(
          who, std::nullopt, [](const SessionDescription&) { return false; });
      ASSERT_EQ(paged.bytes, held.bytes) << "op " << op << " " << who;
      ASSERT_EQ(paged.held_bytes, held.held_bytes) << "op " << op << " " << who;
      int64_t expected = held.bytes;
      for (const SessionDescription& session : held.sessions) {
        expected += Bookkeeping(session);
      }
      ASSERT_EQ(held.held_bytes, expected) << "op " << op << " " << who;
      pages += held.bytes;
      if (run.kv_cache_bytes_per_identity > 0) {
        ASSERT_LE(expected, run.kv_cache_bytes_per_identity) << who;
      }
      if (run.max_sessions_per_identity > 0) {
        ASSERT_LE(static_cast<int64_t>(held.sessions.size()),
                  run.max_sessions_per_identity)
            << who;
      }
    }
    const SessionTotals totals = store.Totals();
    ASSERT_EQ(totals.used_bytes, pages) << "op " << op;
    ASSERT_LE(totals.sessions, run.max_sessions);
  }
  // Refused work: windows' freed keys, and past tight budgets.
  RecordProperty("refused", failures);
}

INSTANTIATE_TEST_SUITE_P(
    Budgets, SessionStoreAccountingTest,
    ::testing::Values(
        Budgets{"Loose", EvictionPolicy::kLru, int64_t{1} << 30, 4096, 0, 0},
        Budgets{"Tight", EvictionPolicy::kLru, 48 * 4096, 24, 0, 0},
        Budgets{"Shares", EvictionPolicy::kLru, 48 * 4096, 24, 8, 20 * 4096},
        Budgets{"SharesWithoutEviction", EvictionPolicy::kNone, 48 * 4096, 24,
                8, 20 * 4096}),
    [](const ::testing::TestParamInfo<Budgets>& param) {
      return std::string(param.param.name);
    });

// A session of one layer, H and Hkv 1, Dk and Dv 4, f32: 8 tokens a page.
SessionConfig Small() {
  SessionConfig config;
  config.key_dim = 4;
  config.value_dim = 4;
  config.max_tokens = 1000;
  return config;
}

// Appends `tokens` tokens to layer 0 of `owner`'s session `id`.
absl::Status Append(SessionStore& store, const std::string& owner,
                    const std::string& id, int64_t tokens) {
  absl::StatusOr<SessionStore::Pin> pin = store.Acquire(owner, id);
  if (!pin.ok()) return pin.status();
  const std::vector<float> values(static_cast<size_t>(4 * tokens), 0.25f);
  KvAppend append;
  append.tokens = tokens;
  append.key = reinterpret_cast<const char*>(values.data());
  append.value = append.key;
  int64_t length = 0;
  return store.AppendAndView(*pin, 0, pin->Length(0), append, 0, &length)
      .status();
}

// A caller whose own sessions are all in use by steps is refused, rather
// than evicting a caller that holds less than it would; one that holds less
// takes its room from the largest holder.
TEST(SessionStoreFairnessTest, NoCallerIsEvictedForOneThatWouldHoldMore) {
  SessionOptions options;
  options.page_tokens = kPageTokens;
  // 12 pages and the bookkeeping of three sessions of up to 12 pages.
  options.kv_cache_bytes = 12 * 4096 + 3 * (1024 + 48 + 12 * 16);
  options.max_sessions = 3;
  SessionStore store(options, nullptr);
  std::vector<std::string> alices;
  for (int i = 0; i < 2; ++i) {
    alices.push_back(store.Create("alice", Small())->id);
    ASSERT_TRUE(Append(store, "alice", alices.back(), 32).ok());  // 4 pages.
  }
  const std::string bobs = store.Create("bob", Small())->id;
  ASSERT_TRUE(Append(store, "bob", bobs, 16).ok());  // 2 pages.
  {
    // Alice's sessions in use by steps: 4 more pages would evict bob's,
    // who holds less than she would. Refused; nothing goes.
    absl::StatusOr<SessionStore::Pin> first = store.Acquire("alice", alices[0]);
    absl::StatusOr<SessionStore::Pin> second =
        store.Acquire("alice", alices[1]);
    ASSERT_TRUE(first.ok() && second.ok());
    const std::vector<float> values(4 * 32, 0.25f);
    KvAppend append;
    append.tokens = 32;
    append.key = reinterpret_cast<const char*>(values.data());
    append.value = append.key;
    int64_t length = 0;
    const absl::Status status =
        store.AppendAndView(*first, 0, 32, append, 0, &length).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
    EXPECT_THAT(std::string(status.message()),
                ::testing::HasSubstr("another caller's holding less than "
                                     "this caller would"));
    // It says what she holds, never the total, which would tell her bob's.
    const int64_t hers = store.List("alice").held_bytes;
    const int64_t all = hers + store.List("bob").held_bytes;
    EXPECT_THAT(std::string(status.message()),
                ::testing::HasSubstr(
                    absl::StrCat("(this caller holds ", hers, " bytes;")));
    EXPECT_THAT(std::string(status.message()),
                ::testing::Not(::testing::HasSubstr(absl::StrCat(all))));
    // Another session of hers would take bob's place under max_sessions.
    const absl::Status created = store.Create("alice", Small()).status();
    EXPECT_EQ(created.code(), absl::StatusCode::kResourceExhausted) << created;
    EXPECT_THAT(std::string(created.message()),
                ::testing::HasSubstr("as are those of every caller holding "
                                     "as many as it would"));
    EXPECT_TRUE(store.Get("bob", bobs).ok());
  }
  // Bob, holding less, takes 4 pages from alice, the largest holder: her
  // least recently used idle session goes.
  ASSERT_TRUE(Append(store, "bob", bobs, 32).ok());
  EXPECT_TRUE(store.Get("bob", bobs).ok());
  const absl::Status evicted = store.Get("alice", alices[0]).status();
  EXPECT_EQ(evicted.code(), absl::StatusCode::kNotFound) << evicted;
  EXPECT_THAT(std::string(evicted.message()),
              ::testing::HasSubstr("another caller needed the room"));
  EXPECT_TRUE(store.Get("alice", alices[1]).ok());
}

// Pages a step's view still reads stay in memory whatever their tables:
// evicting the fork that shares them with a session deleted under that step
// frees nothing, so it does not make room, and the pages held never pass the
// budget.
TEST(SessionStoreFairnessTest, PagesAStepStillReadsAreNotCountedAsFreed) {
  SessionOptions options;
  options.page_tokens = kPageTokens;
  // 8 pages and the bookkeeping of three sessions of up to 8 pages.
  const int64_t budget = 8 * 4096 + 3 * (1024 + 48 + 8 * 16);
  options.kv_cache_bytes = budget;
  options.max_sessions = 3;
  SessionStore store(options, nullptr);
  const std::string parent = store.Create("alice", Small())->id;
  ASSERT_TRUE(Append(store, "alice", parent, 32).ok());  // 4 pages.
  const absl::StatusOr<SessionDescription> fork =
      store.Fork("alice", parent, std::nullopt, absl::ZeroDuration());
  ASSERT_TRUE(fork.ok()) << fork.status();
  const std::string other = store.Create("alice", Small())->id;
  {
    // A step on the parent reads its 4 pages; the parent is deleted under it.
    absl::StatusOr<SessionStore::Pin> pin = store.Acquire("alice", parent);
    ASSERT_TRUE(pin.ok()) << pin.status();
    KvAppend none;
    int64_t length = 0;
    const absl::StatusOr<SessionStore::View> view =
        store.AppendAndView(*pin, 0, 32, none, 0, &length);
    ASSERT_TRUE(view.ok()) << view.status();
    ASSERT_TRUE(store.Delete("alice", parent).ok());
    // 6 pages more would need the fork's 4, which the step still reads.
    const absl::Status status = Append(store, "alice", other, 48);
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
    EXPECT_TRUE(store.Get("alice", fork->id).ok());
    EXPECT_LE(store.Totals().used_bytes, budget);
  }
  // Once the step is done, evicting the fork frees them.
  ASSERT_TRUE(Append(store, "alice", other, 48).ok());
  EXPECT_EQ(store.Get("alice", fork->id).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Totals().used_bytes, 6 * 4096);
}

// With sinks and window_left 0, an append into a page eviction freed (after
// a truncation back into it) starts a fresh page whose first keys are zeros:
// only that page's keys before the append are lost, not the sinks' page, so
// truncations, forks and queries that see the sinks go on. A step whose query
// reaches the lost keys is refused before its append, which does not stand.
TEST(SessionStoreWindowTest, AnAppendIntoAFreedPageLosesOnlyThatPagesKeys) {
  SessionOptions options;
  options.page_tokens = kPageTokens;
  options.kv_cache_bytes = 1 << 24;
  SessionStore store(options, nullptr);
  SessionConfig config = Small();
  config.window_left = 0;
  config.num_sink_tokens = 2;
  config.evict_outside_window = true;
  const std::string id = store.Create("alice", config)->id;
  ASSERT_TRUE(Append(store, "alice", id, 40).ok());  // Frees pages 1 to 3.
  const absl::StatusOr<SessionDescription> truncated =
      store.Truncate("alice", id, 20);
  ASSERT_TRUE(truncated.ok()) << truncated.status();
  ASSERT_TRUE(Append(store, "alice", id, 1).ok());  // Keys 16 to 19 lost.
  const absl::StatusOr<SessionDescription> again =
      store.Truncate("alice", id, 21);
  EXPECT_TRUE(again.ok()) << again.status();
  const absl::StatusOr<SessionDescription> fork =
      store.Fork("alice", id, 21, absl::ZeroDuration());
  EXPECT_TRUE(fork.ok()) << fork.status();
  absl::StatusOr<SessionStore::Pin> pin = store.Acquire("alice", id);
  ASSERT_TRUE(pin.ok()) << pin.status();
  const std::vector<float> values(4, 0.25f);
  KvAppend one;
  one.tokens = 1;
  one.key = reinterpret_cast<const char*>(values.data());
  one.value = one.key;
  int64_t length = 0;
  // One token and two rows (positions 20 and 21): they see the sinks and
  // themselves.
  absl::StatusOr<SessionStore::View> view =
      store.AppendAndView(*pin, 0, 21, one, 2, &length);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(length, 22);
  // One more and six rows: the first, at 17, sees a lost key.
  view = store.AppendAndView(*pin, 0, 22, one, 6, &length);
  EXPECT_EQ(view.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(view.status().message()),
              ::testing::HasSubstr("freed keys 16 to 19 (evict_outside_window "
                                   "keeps the sinks and the last window_left "
                                   "+ 1 keys); nothing was appended or "
                                   "computed"));
  EXPECT_EQ(length, 22);
  // Truncated (and forked) back into the sinks' page, before the replaced
  // page: its lost keys go with it, and the sinks' page's keys stay held.
  const absl::StatusOr<SessionDescription> forked =
      store.Fork("alice", id, 5, absl::ZeroDuration());
  ASSERT_TRUE(forked.ok()) << forked.status();
  ASSERT_TRUE(store.Truncate("alice", id, 5).ok());
  for (const std::string& session : {id, forked->id}) {
    absl::StatusOr<SessionStore::Pin> held = store.Acquire("alice", session);
    ASSERT_TRUE(held.ok()) << held.status();
    view = store.AppendAndView(*held, 0, 5, one, 1, &length);
    EXPECT_TRUE(view.ok()) << view.status();
    EXPECT_TRUE(store.Truncate("alice", session, 4).ok());
  }
}

// A session is idle from its last step's end: one step that computed longer
// than the TTL does not leave it to expire at the next look.
TEST(SessionStoreWindowTest, TheTtlCountsFromTheEndOfTheLastStep) {
  SessionOptions options;
  options.page_tokens = kPageTokens;
  options.kv_cache_bytes = 1 << 24;
  SessionStore store(options, nullptr);
  SessionConfig config = Small();
  config.ttl = absl::Milliseconds(300);
  const std::string id = store.Create("alice", config)->id;
  {
    absl::StatusOr<SessionStore::Pin> pin = store.Acquire("alice", id);
    ASSERT_TRUE(pin.ok()) << pin.status();
    absl::SleepFor(absl::Milliseconds(400));  // The step computes.
    store.ExpireIdle(absl::Now());
    EXPECT_TRUE(store.Get("alice", id).ok());  // Pinned: kept.
  }
  store.ExpireIdle(absl::Now() + absl::Milliseconds(200));
  EXPECT_TRUE(store.Get("alice", id).ok());
  store.ExpireIdle(absl::Now() + absl::Milliseconds(400));
  EXPECT_EQ(store.Get("alice", id).status().code(),
            absl::StatusCode::kNotFound);
}

// Work refused for want of room evicts nothing, though making room for its
// session count alone would have.
TEST(SessionStoreFairnessTest, RefusedWorkEvictsNothing) {
  SessionOptions options;
  options.page_tokens = kPageTokens;
  options.kv_cache_bytes = 1 << 20;
  options.max_sessions = 2;
  options.kv_cache_bytes_per_identity = 8192;
  options.max_sessions_per_identity = 1;
  SessionStore store(options, nullptr);
  const std::string bobs = store.Create("bob", Small())->id;
  const std::string alices = store.Create("alice", Small())->id;
  // 256 layers' bookkeeping (13,312 bytes) pass alice's share: refused, and
  // neither her session (her count's victim) nor bob's goes.
  SessionConfig deep = Small();
  deep.layers = 256;
  absl::Status status = store.Create("alice", deep).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(std::string(status.message()),
              ::testing::HasSubstr("the session needs 13312 bytes, more than "
                                   "one caller may hold"));
  EXPECT_TRUE(store.Get("alice", alices).ok());
  EXPECT_TRUE(store.Get("bob", bobs).ok());
  // A fork of her only session cannot evict it to make room for itself.
  status =
      store.Fork("alice", alices, std::nullopt, absl::ZeroDuration()).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(std::string(status.message()),
              ::testing::HasSubstr("max_sessions_per_identity 1 sessions, all "
                                   "in use by steps (the session forked "
                                   "included)"));
  EXPECT_TRUE(store.Get("alice", alices).ok());
  EXPECT_EQ(store.Totals().sessions, 2);
}

// One call's steps on one layer each copy its last page (the step before
// still reads it), and the page replaced stays until the call is computed:
// those pages count against the caller's share until they go. Until
// 2026-12-07 they counted against no share, so such a call, its caller's
// share looking nearly empty, evicted every session of a caller holding far
// less than it did (an audit, 2026-12-07).
TEST(SessionStoreFairnessTest, PagesOnlyAStepReadsCountAgainstItsCaller) {
  SessionOptions options;
  options.page_tokens = kPageTokens;
  const int64_t record = 1024 + 48;
  // 64 pages and room for bookkeeping; a caller may hold 16 pages.
  options.kv_cache_bytes = 64 * 4096 + 8 * (record + 64 * 16);
  options.kv_cache_bytes_per_identity = 16 * 4096 + 4 * (record + 64 * 16);
  options.max_sessions = 8;
  SessionStore store(options, nullptr);
  std::vector<std::string> bobs;
  for (int i = 0; i < 3; ++i) {
    bobs.push_back(store.Create("bob", Small())->id);
    ASSERT_TRUE(Append(store, "bob", bobs.back(), 32).ok());  // 4 pages.
  }
  const std::string alices = store.Create("alice", Small())->id;
  ASSERT_TRUE(Append(store, "alice", alices, 4).ok());  // Half a page.
  const int64_t alone = store.List("alice").held_bytes;

  const std::vector<float> values(4, 0.25f);
  KvAppend token;
  token.tokens = 1;
  token.key = reinterpret_cast<const char*>(values.data());
  token.value = token.key;
  {
    absl::StatusOr<SessionStore::Pin> pin = store.Acquire("alice", alices);
    ASSERT_TRUE(pin.ok()) << pin.status();
    // One call: a step of one token at a time, each view kept.
    std::vector<SessionStore::View> views;
    absl::Status refused;
    for (int step = 0; step < 64 && refused.ok(); ++step) {
      int64_t length = 0;
      absl::StatusOr<SessionStore::View> view =
          store.AppendAndView(*pin, 0, pin->Length(0), token, 1, &length);
      if (view.ok()) {
        views.push_back(*std::move(view));
      } else {
        refused = view.status();
      }
    }
    EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
    EXPECT_THAT(std::string(refused.message()),
                ::testing::HasSubstr("kv_cache_bytes_per_identity"));
    EXPECT_THAT(std::string(refused.message()),
                ::testing::HasSubstr("steps in flight still read"));
    EXPECT_LE(store.List("alice").held_bytes,
              options.kv_cache_bytes_per_identity);
    EXPECT_GT(store.List("alice").held_bytes, alone + 8 * 4096);
    for (const std::string& id : bobs) {
      EXPECT_TRUE(store.Get("bob", id).ok()) << "bob's " << id << " went";
    }
    // Her session deleted and another made under the same steps: the pages
    // they read are still hers.
    const int64_t read = store.List("alice").held_bytes - alone;
    ASSERT_TRUE(store.Delete("alice", alices).ok());
    EXPECT_GE(store.List("alice").held_bytes, read);  // Without a session too.
    const absl::StatusOr<SessionDescription> next =
        store.Create("alice", Small());
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_GE(store.List("alice").held_bytes, read);
    for (SessionStore::View& view : views) store.Drop(view);
  }
  // Once the steps are done, they are freed, and off her share.
  store.ExpireIdle(absl::Now());
  EXPECT_LT(store.List("alice").held_bytes, 4096);
  EXPECT_EQ(store.Totals().used_bytes, 12 * 4096);
}

// A session that may hold fewer tokens than a page has pages of that many:
// with --kv_page_tokens=4096 a 16-token session held a 2 MiB page for 8 KiB
// of keys and values (an audit, 2026-12-07).
TEST(SessionStorePagesTest, ASessionShorterThanAPageHasPagesOfItsLength) {
  SessionOptions options;
  options.page_tokens = 4096;
  options.kv_cache_bytes = int64_t{1} << 30;
  SessionStore store(options, nullptr);
  SessionConfig config = Small();
  config.key_dim = 64;
  config.value_dim = 64;
  const std::vector<float> values(64 * 16, 0.5f);
  for (const auto& [max_tokens, bytes] :
       {std::pair<int64_t, int64_t>{16, 16 * 128 * 4},
        std::pair<int64_t, int64_t>{5000, 4096 * 128 * 4}}) {
    SCOPED_TRACE(max_tokens);
    config.max_tokens = max_tokens;
    EXPECT_EQ(PageLayoutOf(config, options).page_tokens,
              std::min<int64_t>(max_tokens, 4096));
    absl::StatusOr<SessionDescription> session = store.Create("alice", config);
    ASSERT_TRUE(session.ok()) << session.status();
    absl::StatusOr<SessionStore::Pin> pin = store.Acquire("alice", session->id);
    ASSERT_TRUE(pin.ok()) << pin.status();
    KvAppend append;
    append.tokens = 16;
    append.key = reinterpret_cast<const char*>(values.data());
    append.value = append.key;
    int64_t length = 0;
    ASSERT_TRUE(store.AppendAndView(*pin, 0, 0, append, 0, &length).ok());
    const absl::StatusOr<SessionDescription> held =
        store.Get("alice", session->id);
    ASSERT_TRUE(held.ok()) << held.status();
    EXPECT_EQ(held->lengths[0], 16);
    EXPECT_EQ(held->bytes, bytes);
  }
}

// A session whose first page fits a caller's share but not with the
// session's bookkeeping could never take a token: CreateSession refuses it.
TEST(SessionStoreFairnessTest, CreateRefusesASessionThatCouldNeverTakeAToken) {
  SessionOptions options;
  options.page_tokens = 16;
  options.kv_cache_bytes = 1 << 20;
  v1::CreateSessionRequest request;
  request.set_num_layers(1);
  request.set_num_heads(1);
  request.set_key_dim(32);  // 16 x (32 + 32) x 4 bytes: one 4 KiB page.
  request.set_dtype(v1::FLOAT32);
  options.kv_cache_bytes_per_identity = 4096 + 1024 + 48 + 16;
  EXPECT_TRUE(ValidateCreateSession(request, options).ok());
  options.kv_cache_bytes_per_identity -= 1;
  const absl::Status refused = ValidateCreateSession(request, options).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(std::string(refused.message()),
              ::testing::HasSubstr("takes 4096 bytes, 5184 with the session's "
                                   "bookkeeping, over one caller's share"));
  options.kv_cache_bytes_per_identity = 0;
  options.kv_cache_bytes = 5183;
  EXPECT_THAT(
      std::string(ValidateCreateSession(request, options).status().message()),
      ::testing::HasSubstr("over the KV cache budget"));
}

}  // namespace
}  // namespace attnserve
