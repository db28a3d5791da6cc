#include "attnserve/server/sessions/session_store.h"

#include <openssl/rand.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <list>
#include <new>
#include <queue>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnserve/common/refusals.h"

namespace attnserve {
namespace {

// A session's bookkeeping as charged (SessionBookkeepingBytes), measured with
// malloc's overheads: its record with its id, owner, and the
// nodes of the store's map and LRU list; each layer's record; each page
// reference of a layer's table (a shared_ptr).
constexpr int64_t kSessionRecordBytes = 1024;
constexpr int64_t kLayerRecordBytes = 48;
constexpr int64_t kTableEntryBytes = 16;

}  // namespace

int64_t SessionBookkeepingBytes(const SessionConfig& config,
                                int64_t table_entries) {
  return kSessionRecordBytes + config.layers * kLayerRecordBytes +
         static_cast<int64_t>(config.alibi_slopes.size()) *
             static_cast<int64_t>(sizeof(float)) +
         table_entries * kTableEntryBytes;
}

// One page: its bytes (from the arena), charged to the store's budget while
// it lives.
struct SessionStore::Page {
  Page(std::shared_ptr<PageArena> page_arena,
       std::shared_ptr<std::atomic<int64_t>> used,
       std::shared_ptr<std::atomic<int64_t>> count, int64_t footprint)
      : bytes(footprint),
        arena(std::move(page_arena)),
        data(arena->Allocate(bytes)),
        used_bytes(std::move(used)),
        pages(std::move(count)) {
    if (data == nullptr) return;
    used_bytes->fetch_add(bytes);
    pages->fetch_add(1);
  }
  ~Page() {
    if (data == nullptr) return;
    arena->Free(data, bytes);
    used_bytes->fetch_sub(bytes);
    pages->fetch_sub(1);
    if (lingering != nullptr) lingering->fetch_sub(bytes);
  }
  Page(const Page&) = delete;
  Page& operator=(const Page&) = delete;

  const int64_t bytes;  // PageArena::Footprint of the layout's page.
  const std::shared_ptr<PageArena> arena;
  char* const data;  // Null if the arena could not map memory.
  // Session tables holding the page (guarded by the store's mutex); views
  // hold references without counting here.
  int tables = 0;
  // Set (under the store's mutex) when the last table lets go of it while a
  // step's view still reads it: its owner's Account::lingering, which counts
  // it until it goes.
  std::shared_ptr<std::atomic<int64_t>> lingering;
  const std::shared_ptr<std::atomic<int64_t>> used_bytes;
  const std::shared_ptr<std::atomic<int64_t>> pages;
};

struct SessionStore::Session {
  struct Layer {
    std::vector<std::shared_ptr<Page>> pages;
    int64_t length = 0;
    // Keys before it in a held page are zeros: that page replaced one that
    // evict_outside_window freed (HeldFrom).
    int64_t lost_end = 0;
  };

  std::string id;
  std::string owner;
  Account* account = nullptr;  // The owner's; null once removed.
  SessionConfig config;
  PageLayout layout;
  std::vector<Layer> layers;
  absl::Time created;
  absl::Time last_used;
  std::string forked_from;
  int64_t bookkeeping_bytes = 0;  // Charged: SessionBookkeepingBytes.
  int pins = 0;          // Steps in flight on it: not evicted meanwhile.
  bool removed = false;  // Gone from the tables (deleted while pinned).
  std::string removed_reason;
  std::list<Session*>::iterator lru;  // In its account's.
};

struct SessionStore::Account {
  std::list<Session*> lru;  // Its sessions, least recently used first.
  // The pages its sessions' tables hold (each once: forks share pages only
  // with their own owner's sessions) and their bookkeeping.
  int64_t bytes = 0;
  int64_t bookkeeping = 0;  // Of bytes.
  // Its pages no table holds any more but a step's view still reads (a last
  // page replaced by its copy for the next step of the same call, pages
  // truncated, deleted or outside the window meanwhile): memory the
  // identity's steps keep in use, until the pages go. Until 2026-12-07 no
  // share counted them, and one Step call of many one-token steps on a
  // layer, each copying the last page, evicted other callers' sessions
  // "for holding the most" while its own share looked empty.
  std::shared_ptr<std::atomic<int64_t>> lingering =
      std::make_shared<std::atomic<int64_t>>(0);

  // What counts against the identity's share.
  int64_t held() const { return bytes + lingering->load(); }
};

namespace {

std::string NotFound(const std::string& id, const std::string& why) {
  return absl::StrCat("session ", id, " ", why,
                      "; create a new session and prefill it from your own "
                      "tokens");
}

// What an id nobody may know about gets: the same for an id never made, one
// whose tombstone is gone, and another identity's.
absl::Status UnknownSession(const std::string& id) {
  return absl::NotFoundError(
      NotFound(id,
               "is unknown: never created on this server (or not since it "
               "restarted), or not created by this caller"));
}

}  // namespace

bool IsSessionId(const std::string& id) {
  return id.size() == 32 && std::all_of(id.begin(), id.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

SessionStore::Pin::Pin(SessionStore* store, std::shared_ptr<Session> session)
    : store_(store), session_(std::move(session)) {}

SessionStore::Pin::~Pin() {
  if (session_ == nullptr) return;  // Moved from.
  absl::MutexLock lock(&store_->mutex_);
  --session_->pins;
  // Idle from the step's end: a step computing past the TTL is not followed
  // by the session's expiry.
  session_->last_used = std::max(session_->last_used, absl::Now());
}

void SessionStore::Drop(View& view) {
  absl::MutexLock lock(&mutex_);
  view.data.clear();
  view.pages.clear();
}

const SessionConfig& SessionStore::Pin::config() const {
  return session_->config;
}

const std::string& SessionStore::Pin::id() const { return session_->id; }

int64_t SessionStore::Pin::Length(int64_t layer) const {
  absl::MutexLock lock(&store_->mutex_);
  return session_->removed
             ? 0
             : session_->layers[static_cast<size_t>(layer)].length;
}

namespace {

// `bytes` random bytes from OpenSSL's CSPRNG (seeded from the operating
// system; it fails only if the system has no entropy source, which no server
// should run without) as lowercase hex.
std::string RandomHex(int bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  unsigned char bits[16];
  if (bytes > static_cast<int>(sizeof(bits)) || RAND_bytes(bits, bytes) != 1) {
    std::abort();
  }
  std::string hex(static_cast<size_t>(2 * bytes), '0');
  for (int i = 0; i < bytes; ++i) {
    hex[static_cast<size_t>(2 * i)] = kHex[bits[i] >> 4];
    hex[static_cast<size_t>(2 * i + 1)] = kHex[bits[i] & 15];
  }
  return hex;
}

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') {
    return "localhost";
  }
  return name;
}

}  // namespace

SessionStore::SessionStore(const SessionOptions& options,
                           ServerMetrics* metrics)
    : options_(options),
      metrics_(metrics),
      replica_{options.replica_name.empty() ? HostName() : options.replica_name,
               RandomHex(8)},
      arena_(std::make_shared<PageArena>()),
      used_bytes_(std::make_shared<std::atomic<int64_t>>(0)),
      pages_(std::make_shared<std::atomic<int64_t>>(0)) {
  absl::MutexLock lock(&mutex_);
  RecordTotals();
}

SessionStore::~SessionStore() { Clear(); }

PageLayout PageLayoutOf(const SessionConfig& config,
                        const SessionOptions& options) {
  PageLayout layout;
  // A session that may hold fewer tokens than a page has pages of that many:
  // the rest of a page would never be written.
  layout.page_tokens = config.max_tokens > 0
                           ? std::min(options.page_tokens, config.max_tokens)
                           : options.page_tokens;
  layout.kv_heads = config.kv_heads;
  layout.key_dim = config.key_dim;
  layout.value_dim = config.value_dim;
  layout.dtype = config.dtype;
  // Keys by dimension where the paged kernel reads them faster (AVX-512).
  layout.keys_transposed =
      options.keys_transposed.value_or(PreferredKeysTransposed());
  return layout;
}

std::string SessionStore::NewId() {
  for (;;) {
    std::string id = RandomHex(16);
    if (!sessions_.contains(id) && !tombstones_.contains(id)) return id;
  }
}

absl::StatusOr<std::shared_ptr<SessionStore::Session>> SessionStore::Find(
    const std::string& owner, const std::string& id) {
  MaybeExpire(absl::Now());
  const auto it = sessions_.find(id);
  if (it != sessions_.end() && it->second->owner == owner) return it->second;
  const auto tombstone = tombstones_.find(id);
  if (tombstone != tombstones_.end() && tombstone->second.owner == owner) {
    return absl::NotFoundError(NotFound(id, tombstone->second.reason));
  }
  return UnknownSession(id);
}

void SessionStore::Touch(Session* session, absl::Time now) {
  session->last_used = now;
  std::list<Session*>& lru = session->account->lru;
  lru.splice(lru.end(), lru, session->lru);
}

SessionStore::Account* SessionStore::AccountOf(const std::string& owner) {
  std::unique_ptr<Account>& account = accounts_[owner];
  if (account == nullptr) {
    account = std::make_unique<Account>();
    // Pages of sessions it had before may still be read by steps.
    if (auto left = lingering_without_account_.extract(owner)) {
      account->lingering = std::move(left.mapped());
    }
  }
  return account.get();
}

void SessionStore::ChargeBookkeeping(Session* session, int64_t bytes) {
  session->bookkeeping_bytes += bytes;
  session->account->bytes += bytes;
  session->account->bookkeeping += bytes;
  bookkeeping_bytes_ += bytes;
}

namespace {

// How an eviction is told to the owner of a session evicted for another
// identity's work.
constexpr char kHeldTheMost[] =
    "; another caller needed the room, and yours held the most";

}  // namespace

// Sessions chosen to be evicted together, and what their going frees. Every
// victim is chosen before any goes, so that work refused for want of room
// evicts none.
struct SessionStore::EvictionPlan {
  // Adds `session`, counting a page once every table holding it is a
  // victim's, and only if no step's view holds it too (a step on a session
  // deleted meanwhile, or on a fork sharing it): only then is it freed, off
  // the budget and off its owner's share (a page a view holds stays its
  // owner's, Account::lingering); `reason` tells its owner why it went.
  void Add(Session* session, std::string reason) {
    victims.emplace_back(session, std::move(reason));
    chosen.insert(session);
    ++chosen_by[session->account];
    int64_t released = session->bookkeeping_bytes;
    for (const Session::Layer& layer : session->layers) {
      for (const std::shared_ptr<Page>& page : layer.pages) {
        if (page == nullptr || ++tables[page.get()] != page->tables) continue;
        // Views are made under the store's mutex, held here: the count
        // only falls meanwhile, which frees more than counted.
        if (page.use_count() == page->tables) released += page->bytes;
      }
    }
    freed_by[session->account] += released;
    freed += released;
  }
  // Whether `session` may be chosen: no step is using it, it is not `keep`
  // (the session the work is for), and it is not chosen already.
  bool MayGo(const Session* session, const Session* keep) const {
    return session->pins == 0 && session != keep && !chosen.contains(session);
  }
  int64_t FreedBy(const Account* account) const {
    const auto found = freed_by.find(account);
    return found == freed_by.end() ? 0 : found->second;
  }
  // The sessions `account` (null: none) holds once the victims are gone.
  int64_t Left(const Account* account) const {
    if (account == nullptr) return 0;
    const auto found = chosen_by.find(account);
    return static_cast<int64_t>(account->lru.size()) -
           (found == chosen_by.end() ? 0 : found->second);
  }

  std::vector<std::pair<Session*, std::string>> victims;
  absl::flat_hash_set<const Session*> chosen;
  absl::flat_hash_map<const Account*, int64_t> chosen_by;
  absl::flat_hash_map<const Page*, int> tables;
  // Off each account's share (its tables' pages), and off the budget.
  absl::flat_hash_map<const Account*, int64_t> freed_by;
  int64_t freed = 0;
};

int64_t SessionStore::LingeringOf(const std::string& owner,
                                  const Account* account) const {
  if (account != nullptr) return account->lingering->load();
  const auto found = lingering_without_account_.find(owner);
  return found == lingering_without_account_.end() ? 0 : found->second->load();
}

SessionStore::Account* SessionStore::FindAccount(const std::string& owner) {
  const auto found = accounts_.find(owner);
  return found == accounts_.end() ? nullptr : found->second.get();
}

absl::Status SessionStore::PlanRoomForSession(const std::string& owner,
                                              const Session* keep,
                                              EvictionPlan* plan) {
  const bool evict = options_.eviction == EvictionPolicy::kLru;
  // An account's least recently used session that may go.
  const auto idle = [keep, plan](const Account& account) -> Session* {
    for (Session* session : account.lru) {
      if (plan->MayGo(session, keep)) return session;
    }
    return nullptr;
  };
  Account* const account = FindAccount(owner);
  const auto refused = [&](absl::string_view limit, int64_t value,
                           absl::string_view in_use) {
    // A caller holding none is told so: deleting is not its remedy.
    const size_t holds = account == nullptr ? 0 : account->lru.size();
    return absl::ResourceExhaustedError(absl::StrCat(
        limit, " ", value, " sessions",
        evict ? absl::StrCat(in_use, keep == nullptr
                                         ? ""
                                         : " (the session forked included)")
              : " and kv_eviction is none",
        holds > 0 ? "; delete sessions you no longer need"
                  : "; this caller holds none: retry after a backoff (others' "
                    "sessions end when deleted or idle past their ttl) or on "
                    "another replica"));
  };
  const int64_t cap = options_.max_sessions_per_identity;
  while (cap > 0 && plan->Left(account) >= cap) {
    Session* victim = evict ? idle(*account) : nullptr;
    if (victim == nullptr) {
      return refused("this caller holds max_sessions_per_identity", cap,
                     ", all in use by steps");
    }
    plan->Add(victim,
              absl::StrCat("was evicted (its caller's least recently used) to "
                           "make room for a new session of its caller under "
                           "max_sessions_per_identity ",
                           cap));
  }
  while (static_cast<int64_t>(sessions_.size() - plan->victims.size()) >=
         options_.max_sessions) {
    // The identity that would hold the most sessions (the caller counted
    // with the new one; ties go to the caller) gives up its least recently
    // used idle one; another's only while it holds at least as many as the
    // caller would.
    const int64_t would_hold = plan->Left(account) + 1;
    Session* victim = nullptr;
    int64_t most = -1;
    for (const auto& [name, holder] : accounts_) {
      const bool own = holder.get() == account;
      const int64_t holds = plan->Left(holder.get()) + (own ? 1 : 0);
      if (holds < would_hold) continue;
      Session* candidate = evict ? idle(*holder) : nullptr;
      if (candidate == nullptr) continue;
      if (holds > most || (holds == most && own)) {
        most = holds;
        victim = candidate;
      }
    }
    if (victim == nullptr) {
      return refused("the server holds max_sessions", options_.max_sessions,
                     ", and this caller's are all in use by steps, as are "
                     "those of every caller holding as many as it would");
    }
    plan->Add(victim,
              absl::StrCat("was evicted (least recently used) to make room "
                           "for a new session under max_sessions ",
                           options_.max_sessions,
                           victim->owner == owner ? "" : kHeldTheMost));
  }
  return absl::OkStatus();
}

absl::Status SessionStore::PlanRoom(int64_t bytes, absl::string_view what,
                                    const std::string& owner,
                                    const Session* keep, EvictionPlan* plan) {
  const int64_t budget = options_.kv_cache_bytes;
  const int64_t cap = options_.kv_cache_bytes_per_identity;
  if (bytes > budget) {
    return Permanent(absl::ResourceExhaustedError(
        absl::StrCat(what, " needs ", bytes,
                     " bytes, more than the whole KV cache budget "
                     "(kv_cache_bytes) of ",
                     budget, " bytes")));
  }
  if (cap > 0 && bytes > cap) {
    return Permanent(absl::ResourceExhaustedError(
        absl::StrCat(what, " needs ", bytes,
                     " bytes, more than one caller may hold "
                     "(kv_cache_bytes_per_identity ",
                     cap, " bytes)")));
  }
  Account* const account = FindAccount(owner);
  // Without an account (no session now), what its steps still read.
  const int64_t lingering = LingeringOf(owner, account);
  const auto holds = [&] {
    return account == nullptr ? lingering
                              : account->held() - plan->FreedBy(account);
  };
  const auto would_hold = [&] { return holds() + bytes; };
  const int64_t used = used_bytes_->load() + bookkeeping_bytes_;
  const auto over_cap = [&] { return cap > 0 && would_hold() > cap; };
  const auto over_budget = [&] { return used - plan->freed + bytes > budget; };
  if (!over_cap() && !over_budget()) return absl::OkStatus();
  const std::string read_by_steps =
      lingering == 0
          ? ""
          : absl::StrCat(", ", lingering,
                         " of them pages no session holds any more but that "
                         "steps in flight still read");
  const std::string cap_full = absl::StrCat(
      "this caller's share of the KV cache (kv_cache_bytes_per_identity ", cap,
      " bytes) is full (", holds(), " bytes held", read_by_steps, "; ", what,
      " needs ", bytes, " more)");
  // Only the caller's own holding: the budget's total would tell one caller
  // what the others hold (a review found it did, to the byte).
  const std::string budget_full =
      absl::StrCat("the KV cache budget (kv_cache_bytes) of ", budget,
                   " bytes is full (this caller holds ", holds(), " bytes",
                   read_by_steps, "; ", what, " needs ", bytes, " more)");
  if (options_.eviction == EvictionPolicy::kNone) {
    return absl::ResourceExhaustedError(
        absl::StrCat(over_cap() ? cap_full : budget_full,
                     "; kv_eviction is none: delete or truncate sessions"));
  }
  // First the caller's own least recently used, past its share.
  if (over_cap()) {
    for (Session* candidate : account->lru) {
      if (!over_cap()) break;
      if (!plan->MayGo(candidate, keep)) continue;
      plan->Add(candidate,
                absl::StrCat("was evicted (its caller's least recently used) "
                             "to make room in its caller's share of the KV "
                             "cache (kv_cache_bytes_per_identity ",
                             cap, " bytes)"));
    }
    if (over_cap()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          cap_full,
          ", and evicting every session of this caller's that may go would "
          "not make room (the rest is this session's, shared with it, or in "
          "use by steps); nothing was evicted"));
    }
  }
  // Then, past the budget, the least recently used of the identity that
  // would hold the most (the caller counted with what it asks for; ties go
  // to the caller), again after each victim; another caller's only while it
  // holds at least as much as the caller would.
  struct Holder {
    int64_t holds;
    bool asking;
    const Account* account;
    std::list<Session*>::const_iterator next;
    bool operator<(const Holder& other) const {
      return holds != other.holds ? holds < other.holds : asking < other.asking;
    }
  };
  std::priority_queue<Holder> holders;
  if (over_budget()) {
    for (const auto& [name, holder] : accounts_) {
      const bool asking = holder.get() == account;
      holders.push(
          {asking ? would_hold() : holder->held() - plan->FreedBy(holder.get()),
           asking, holder.get(), holder->lru.begin()});
    }
  }
  while (over_budget() && !holders.empty()) {
    Holder holder = holders.top();
    if (!holder.asking && holder.holds < would_hold()) break;
    holders.pop();
    const auto end = holder.account->lru.end();
    while (holder.next != end && !plan->MayGo(*holder.next, keep)) {
      ++holder.next;
    }
    if (holder.next == end) continue;  // Nothing more of its may go.
    Session* victim = *holder.next++;
    plan->Add(victim,
              absl::StrCat("was evicted (least recently used) to make room "
                           "in the KV cache budget of ",
                           budget, " bytes",
                           victim->owner == owner ? "" : kHeldTheMost));
    holder.holds = holder.asking
                       ? would_hold()
                       : holder.account->held() - plan->FreedBy(holder.account);
    holders.push(holder);
  }
  if (over_budget()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        budget_full,
        ", and evicting every session that may go for this caller would "
        "not make room (the rest is this session's, shared with it, or in "
        "use by steps, or another caller's holding less than this caller "
        "would); nothing was evicted"));
  }
  return absl::OkStatus();
}

void SessionStore::Evict(const EvictionPlan& plan) {
  for (const auto& [victim, reason] : plan.victims) {
    Remove(sessions_.at(victim->id), reason, SessionRemoval::kEvicted);
  }
}

std::shared_ptr<SessionStore::Page> SessionStore::NewPage(
    const PageLayout& layout) {
  auto page = std::make_shared<Page>(arena_, used_bytes_, pages_,
                                     PageArena::Footprint(layout.PageBytes()));
  if (page->data == nullptr) return nullptr;
  return page;
}

void SessionStore::Hold(Account* account, const std::shared_ptr<Page>& page) {
  if (page == nullptr) return;  // Evicted.
  const int tables = ++page->tables;
  if (tables == 1) account->bytes += page->bytes;
  if (tables == 2) shared_bytes_ += page->bytes;
}

void SessionStore::Release(Account* account, std::shared_ptr<Page>* page) {
  if (*page == nullptr) return;  // Evicted.
  const int tables = (*page)->tables--;
  if (tables == 1) {
    account->bytes -= (*page)->bytes;
    // A step's view reads it still: its owner's until it goes. Views are
    // made under the store's mutex, so the count can only fall meanwhile;
    // the page's destructor, wherever the last view drops it, takes it off.
    if (page->use_count() > 1) {
      (*page)->lingering = account->lingering;
      account->lingering->fetch_add((*page)->bytes);
    }
  }
  if (tables == 2) shared_bytes_ -= (*page)->bytes;
  page->reset();
}

namespace {

// A layer's lost_end once it holds `length` keys: kept (clipped) while the
// page where it falls is still the layer's; 0 once that page is gone, so
// that it never lands in an earlier page, whose keys are all held.
int64_t LostEndAt(int64_t lost_end, int64_t length, int64_t page_tokens) {
  const int64_t lost_page = lost_end / page_tokens * page_tokens;
  return length > lost_page ? std::min(lost_end, length) : 0;
}

}  // namespace

int64_t WindowStart(const SessionConfig& config, int64_t position) {
  return config.window_left < 0
             ? 0
             : std::max<int64_t>(0, position - config.window_left);
}

std::optional<FreedKeys> FreedKeysSeen(
    const SessionConfig& config, int64_t page_tokens, int64_t length,
    int64_t position, absl::FunctionRef<int64_t(size_t)> held_from) {
  const int64_t sinks = std::min(config.num_sink_tokens, length);
  const int64_t first = WindowStart(config, position);
  for (int64_t p = 0; p * page_tokens < length; ++p) {
    const int64_t begin = p * page_tokens;
    const int64_t end = std::min(begin + page_tokens, length);
    // Keys [begin, freed_end) of the page are freed.
    const int64_t freed_end =
        std::clamp(held_from(static_cast<size_t>(p)), begin, end);
    if (freed_end > begin && (begin < sinks || freed_end > first)) {
      return FreedKeys{begin, freed_end - 1};
    }
  }
  return std::nullopt;
}

int64_t HeldFrom(bool page_held, int64_t page_tokens, int64_t lost_end,
                 size_t p) {
  const int64_t begin = static_cast<int64_t>(p) * page_tokens;
  if (!page_held) return begin + page_tokens;
  return lost_end > begin && lost_end - begin < page_tokens ? lost_end : begin;
}

absl::Status SessionStore::CheckHeld(const Session& session, size_t layer_index,
                                     int64_t position, int64_t length,
                                     absl::string_view what) const {
  const Session::Layer& layer = session.layers[layer_index];
  const int64_t page_tokens = session.layout.page_tokens;
  const std::optional<FreedKeys> freed =
      FreedKeysSeen(session.config, page_tokens, length, position,
                    [&layer, page_tokens](size_t p) {
                      return HeldFrom(layer.pages[p] != nullptr, page_tokens,
                                      layer.lost_end, p);
                    });
  if (!freed) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      what, " sees the keys from ", WindowStart(session.config, position),
      " on (window_left ", session.config.window_left, ") and the ",
      std::min(session.config.num_sink_tokens, length), " sinks, and session ",
      session.id, " freed keys ", freed->first, " to ", freed->last,
      " (evict_outside_window keeps the sinks and the last window_left + 1 "
      "keys of each layer)"));
}

void SessionStore::EvictOutsideWindow(Session* session, size_t layer_index) {
  Session::Layer* layer = &session->layers[layer_index];
  const SessionConfig& config = session->config;
  if (!config.evict_outside_window) return;
  const int64_t page_tokens = session->layout.page_tokens;
  // The last token (at position length − 1) saw the sinks and the keys from
  // length − 1 − window_left on, and the next sees fewer; a page wholly
  // between them goes. Keeping what the last token saw lets a client that
  // lost a decode step's answer ask for it again.
  const int64_t sinks = config.num_sink_tokens;
  const int64_t first =
      WindowStart(config, std::max<int64_t>(0, layer->length - 1));
  // Pages from the first after the sinks' to the last wholly before `first`
  // (counted by division: a page index times page_tokens may overflow with
  // sinks near 2^63).
  for (int64_t p = sinks / page_tokens + (sinks % page_tokens != 0 ? 1 : 0);
       p < first / page_tokens; ++p) {
    Release(session->account, &layer->pages[static_cast<size_t>(p)]);
  }
}

void SessionStore::Remove(const std::shared_ptr<Session>& removed,
                          const std::string& reason,
                          SessionRemoval metric_reason) {
  // A copy: `removed` may be the map's own reference, erased below.
  const std::shared_ptr<Session> session = removed;
  Account* account = session->account;
  for (Session::Layer& layer : session->layers) {
    for (std::shared_ptr<Page>& page : layer.pages) Release(account, &page);
    layer.pages.clear();
    layer.length = 0;
  }
  ChargeBookkeeping(session.get(), -session->bookkeeping_bytes);
  account->lru.erase(session->lru);
  session->account = nullptr;
  if (account->lru.empty()) {
    if (account->lingering->load() > 0) {
      lingering_without_account_[session->owner] = account->lingering;
    }
    accounts_.erase(session->owner);
  }
  session->removed = true;
  session->removed_reason = reason;
  if (options_.max_tombstones > 0) {
    while (static_cast<int64_t>(tombstone_order_.size()) >=
           options_.max_tombstones) {
      tombstones_.erase(tombstone_order_.front());
      tombstone_order_.pop_front();
    }
    tombstones_[session->id] = {session->owner, reason};
    tombstone_order_.push_back(session->id);
  }
  if (metrics_ != nullptr) metrics_->SessionRemoved(metric_reason);
  sessions_.erase(std::string(session->id));
}

void SessionStore::MaybeExpire(absl::Time now) {
  if (now - last_expiry_ < absl::Seconds(1)) return;
  last_expiry_ = now;
  std::vector<std::shared_ptr<Session>> expired;
  for (const auto& [id, session] : sessions_) {
    if (session->pins == 0 && now - session->last_used > session->config.ttl) {
      expired.push_back(session);
    }
  }
  for (const std::shared_ptr<Session>& session : expired) {
    Remove(session,
           absl::StrCat("expired after ",
                        absl::ToInt64Seconds(session->config.ttl),
                        " s without a step, fork or truncation (its TTL)"),
           SessionRemoval::kExpired);
  }
  if (!expired.empty()) RecordTotals();
}

void SessionStore::ExpireIdle(absl::Time now) {
  absl::MutexLock lock(&mutex_);
  last_expiry_ = absl::InfinitePast();
  MaybeExpire(now);
  // Identities whose steps have dropped their last view since.
  for (auto it = lingering_without_account_.begin();
       it != lingering_without_account_.end();) {
    if (it->second->load() == 0) {
      lingering_without_account_.erase(it++);
    } else {
      ++it;
    }
  }
  RecordTotals();
}

SessionDescription SessionStore::Describe(const Session& session) const {
  SessionDescription d;
  d.id = session.id;
  d.config = session.config;
  d.created = session.created;
  d.last_used = session.last_used;
  d.forked_from = session.forked_from;
  for (const Session::Layer& layer : session.layers) {
    d.lengths.push_back(layer.length);
    for (const std::shared_ptr<Page>& page : layer.pages) {
      if (page == nullptr) continue;  // Evicted.
      d.bytes += page->bytes;
      if (page->tables > 1) d.shared_bytes += page->bytes;
    }
  }
  return d;
}

void SessionStore::RecordTotals() {
  if (metrics_ == nullptr) return;
  metrics_->SetKvCache(static_cast<int64_t>(sessions_.size()), pages_->load(),
                       used_bytes_->load(), shared_bytes_,
                       options_.kv_cache_bytes);
}

absl::Status SessionStore::CheckCreating() const {
  if (creating_.load()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "replica ", replica_.name,
      " is draining: it serves the sessions it holds but takes no new ones; "
      "create the session on another replica"));
}

absl::StatusOr<SessionDescription> SessionStore::Create(
    const std::string& owner, const SessionConfig& config,
    const std::string& id) {
  if (absl::Status creating = CheckCreating(); !creating.ok()) return creating;
  absl::MutexLock lock(&mutex_);
  const absl::Time now = absl::Now();
  MaybeExpire(now);
  if (!id.empty() && (sessions_.contains(id) || tombstones_.contains(id))) {
    return absl::AlreadyExistsError(absl::StrCat(
        "session_id ", id, " is taken on replica ", replica_.name,
        ": a session of that id exists or was recently removed; choose "
        "another random id"));
  }
  const int64_t bookkeeping = SessionBookkeepingBytes(config, 0);
  EvictionPlan plan;
  absl::Status room = PlanRoomForSession(owner, nullptr, &plan);
  if (room.ok()) {
    room = PlanRoom(bookkeeping, "the session", owner, nullptr, &plan);
  }
  if (!room.ok()) return room;
  Evict(plan);
  auto session = std::make_shared<Session>();
  session->id = id.empty() ? NewId() : id;
  session->owner = owner;
  session->account = AccountOf(owner);
  ChargeBookkeeping(session.get(), bookkeeping);
  session->config = config;
  session->layout = PageLayoutOf(config, options_);
  session->layers.resize(static_cast<size_t>(config.layers));
  session->created = session->last_used = now;
  std::list<Session*>& lru = session->account->lru;
  session->lru = lru.insert(lru.end(), session.get());
  sessions_[session->id] = session;
  RecordTotals();
  return Describe(*session);
}

absl::StatusOr<SessionDescription> SessionStore::Fork(
    const std::string& owner, const std::string& id,
    std::optional<int64_t> length, absl::Duration ttl) {
  if (absl::Status creating = CheckCreating(); !creating.ok()) return creating;
  absl::MutexLock lock(&mutex_);
  absl::StatusOr<std::shared_ptr<Session>> parent = Find(owner, id);
  if (!parent.ok()) return parent.status();
  // Checked before room is made: a refused fork evicts nothing.
  for (size_t l = 0; l < (*parent)->layers.size(); ++l) {
    const Session::Layer& from = (*parent)->layers[l];
    const int64_t kept = std::min(from.length, length.value_or(from.length));
    if (absl::Status held = CheckHeld(
            **parent, l, kept, kept,
            absl::StrCat("a fork of length ", kept, ": its next token"));
        !held.ok()) {
      return held;
    }
  }
  int64_t table_entries = 0;
  for (const Session::Layer& from : (*parent)->layers) {
    const int64_t kept = std::min(from.length, length.value_or(from.length));
    table_entries += (kept + (*parent)->layout.page_tokens - 1) /
                     (*parent)->layout.page_tokens;
  }
  const int64_t bookkeeping =
      SessionBookkeepingBytes((*parent)->config, table_entries);
  // The parent is kept while room is made: it is not the session evicted.
  EvictionPlan plan;
  absl::Status room = PlanRoomForSession(owner, parent->get(), &plan);
  if (room.ok()) {
    room = PlanRoom(bookkeeping, "the fork", owner, parent->get(), &plan);
  }
  if (!room.ok()) return room;
  Evict(plan);
  const absl::Time now = absl::Now();
  Touch(parent->get(), now);
  auto child = std::make_shared<Session>();
  child->id = NewId();
  child->owner = owner;
  child->config = (*parent)->config;
  if (ttl > absl::ZeroDuration()) child->config.ttl = ttl;
  child->layout = (*parent)->layout;
  child->created = child->last_used = now;
  child->forked_from = id;
  // The parent is the owner's, so its account is the child's.
  child->account = (*parent)->account;
  ChargeBookkeeping(child.get(), bookkeeping);
  child->layers.resize((*parent)->layers.size());
  const int64_t page_tokens = child->layout.page_tokens;
  for (size_t l = 0; l < child->layers.size(); ++l) {
    const Session::Layer& from = (*parent)->layers[l];
    Session::Layer& to = child->layers[l];
    to.length = std::min(from.length, length.value_or(from.length));
    to.lost_end = LostEndAt(from.lost_end, to.length, page_tokens);
    const int64_t pages = (to.length + page_tokens - 1) / page_tokens;
    for (int64_t p = 0; p < pages; ++p) {
      to.pages.push_back(from.pages[static_cast<size_t>(p)]);
      Hold(child->account, to.pages.back());
    }
  }
  std::list<Session*>& lru = child->account->lru;
  child->lru = lru.insert(lru.end(), child.get());
  sessions_[child->id] = child;
  RecordTotals();
  return Describe(*child);
}

absl::StatusOr<SessionDescription> SessionStore::Truncate(
    const std::string& owner, const std::string& id, int64_t length) {
  absl::MutexLock lock(&mutex_);
  absl::StatusOr<std::shared_ptr<Session>> session = Find(owner, id);
  if (!session.ok()) return session.status();
  for (size_t l = 0; l < (*session)->layers.size(); ++l) {
    const int64_t kept = std::min((*session)->layers[l].length, length);
    if (absl::Status held = CheckHeld(
            **session, l, kept, kept,
            absl::StrCat("a truncation to ", kept, ": the next token"));
        !held.ok()) {
      return held;
    }
  }
  Touch(session->get(), absl::Now());
  const int64_t page_tokens = (*session)->layout.page_tokens;
  for (Session::Layer& layer : (*session)->layers) {
    layer.length = std::min(layer.length, length);
    layer.lost_end = LostEndAt(layer.lost_end, layer.length, page_tokens);
    const size_t keep =
        static_cast<size_t>((layer.length + page_tokens - 1) / page_tokens);
    while (layer.pages.size() > keep) {
      Release((*session)->account, &layer.pages.back());
      layer.pages.pop_back();
      ChargeBookkeeping(session->get(), -kTableEntryBytes);
    }
  }
  RecordTotals();
  return Describe(**session);
}

absl::StatusOr<SessionDescription> SessionStore::Delete(
    const std::string& owner, const std::string& id) {
  absl::MutexLock lock(&mutex_);
  absl::StatusOr<std::shared_ptr<Session>> session = Find(owner, id);
  if (!session.ok()) return session.status();
  SessionDescription described = Describe(**session);
  Remove(*session, "was deleted", SessionRemoval::kDeleted);
  RecordTotals();
  return described;
}

absl::StatusOr<SessionDescription> SessionStore::Get(const std::string& owner,
                                                     const std::string& id) {
  absl::MutexLock lock(&mutex_);
  absl::StatusOr<std::shared_ptr<Session>> session = Find(owner, id);
  if (!session.ok()) return session.status();
  return Describe(**session);
}

SessionListing SessionStore::List(const std::string& owner) {
  std::vector<SessionDescription> sessions;
  SessionListing listing =
      List(owner, std::nullopt, [&sessions](const SessionDescription& d) {
        sessions.push_back(d);
        return true;
      });
  listing.sessions = std::move(sessions);
  // The distinct pages again, from the tables: the account's count checked
  // (session_store_test).
  absl::MutexLock lock(&mutex_);
  int64_t bytes = 0;
  absl::flat_hash_set<const Page*> pages;
  const Account* const account = FindAccount(owner);
  for (const Session* session :
       account == nullptr ? std::list<Session*>() : account->lru) {
    for (const Session::Layer& layer : session->layers) {
      for (const std::shared_ptr<Page>& page : layer.pages) {
        if (page != nullptr && pages.insert(page.get()).second) {
          bytes += page->bytes;
        }
      }
    }
  }
  listing.bytes = bytes;
  return listing;
}

SessionListing SessionStore::List(
    const std::string& owner, const std::optional<ListingPlace>& after,
    absl::FunctionRef<bool(const SessionDescription&)> take) {
  absl::MutexLock lock(&mutex_);
  MaybeExpire(absl::Now());
  SessionListing listing;
  const Account* const account = FindAccount(owner);
  if (account == nullptr) {
    listing.held_bytes = LingeringOf(owner, nullptr);
    return listing;
  }
  listing.bytes = account->bytes - account->bookkeeping;
  listing.held_bytes = account->held();
  struct Place {
    int64_t created_ns;
    const Session* session;
  };
  std::vector<Place> order;
  order.reserve(account->lru.size());
  for (const Session* session : account->lru) {
    order.push_back({absl::ToUnixNanos(session->created), session});
  }
  const auto before = [](const Place& a, const Place& b) {
    return a.created_ns != b.created_ns ? a.created_ns < b.created_ns
                                        : a.session->id < b.session->id;
  };
  std::sort(order.begin(), order.end(), before);
  auto next = order.begin();
  if (after.has_value()) {
    next = std::upper_bound(order.begin(), order.end(), *after,
                            [](const ListingPlace& place, const Place& p) {
                              return place.created_ns != p.created_ns
                                         ? place.created_ns < p.created_ns
                                         : place.id < p.session->id;
                            });
  }
  for (; next != order.end(); ++next) {
    if (!take(Describe(*next->session))) break;
  }
  return listing;
}

absl::StatusOr<SessionStore::Pin> SessionStore::Acquire(
    const std::string& owner, const std::string& id) {
  absl::MutexLock lock(&mutex_);
  absl::StatusOr<std::shared_ptr<Session>> session = Find(owner, id);
  if (!session.ok()) return session.status();
  ++(*session)->pins;
  Touch(session->get(), absl::Now());
  return Pin(this, *std::move(session));
}

namespace {

// Copies `tokens` rows of `dim` elements from `source` (in `from`) to
// `destination` (in `to`), converting through f32 when the dtypes differ.
void CopyRows(const char* source, DataType from, int64_t rows, int64_t dim,
              char* destination, DataType to) {
  const int64_t count = rows * dim;
  if (from == to) {
    std::memcpy(destination, source,
                static_cast<size_t>(count * DataTypeBytes(to)));
    return;
  }
  float buffer[1024];
  for (int64_t done = 0; done < count; done += 1024) {
    const int64_t n = std::min<int64_t>(1024, count - done);
    ConvertToFloat32(from, source + done * DataTypeBytes(from), n, buffer);
    ConvertFromFloat32(buffer, n, to, destination + done * DataTypeBytes(to));
  }
}

// The same rows written as columns (a page's keys, PageLayout::
// keys_transposed): element d of row i to destination + (d · stride + i)
// elements. Rows are converted as many as fit 16 KiB at a time (at least
// one: dim <= 4,096), then each dimension's run of them written in turn, so
// the writes go out in order.
void CopyRowsAsColumns(const char* source, DataType from, int64_t rows,
                       int64_t dim, int64_t stride, char* destination,
                       DataType to) {
  char converted[16384];
  const int64_t in = DataTypeBytes(from);
  const int64_t row_bytes = dim * DataTypeBytes(to);
  const int64_t batch =
      std::max<int64_t>(1, static_cast<int64_t>(sizeof(converted)) / row_bytes);
  const auto transpose = [&](auto element, int64_t i0, int64_t count) {
    constexpr size_t kBytes = sizeof(element);
    for (int64_t d = 0; d < dim; ++d) {
      char* column = destination + (d * stride + i0) * kBytes;
      const char* row = converted + d * kBytes;
      for (int64_t i = 0; i < count; ++i) {
        std::memcpy(column + i * kBytes, row + i * dim * kBytes, kBytes);
      }
    }
  };
  for (int64_t i0 = 0; i0 < rows; i0 += batch) {
    const int64_t count = std::min(batch, rows - i0);
    CopyRows(source + i0 * dim * in, from, count, dim, converted, to);
    if (DataTypeBytes(to) == 2) {
      transpose(uint16_t{}, i0, count);
    } else {
      transpose(uint32_t{}, i0, count);
    }
  }
}

}  // namespace

absl::StatusOr<SessionStore::View> SessionStore::AppendAndView(
    const Pin& pin, int64_t layer_index, int64_t expected_length,
    const KvAppend& append, int64_t query_rows, int64_t* length) {
  absl::MutexLock lock(&mutex_);
  Session& session = *pin.session_;
  if (session.removed) {
    return absl::NotFoundError(NotFound(session.id, session.removed_reason));
  }
  Session::Layer& layer = session.layers[static_cast<size_t>(layer_index)];
  *length = layer.length;
  if (layer.length != expected_length) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", session.id, " layer ", layer_index, " holds ",
                     layer.length, " tokens, the step expected ",
                     expected_length, "; nothing was appended"));
  }
  const PageLayout& layout = session.layout;
  const int64_t page_tokens = layout.page_tokens;
  const int64_t tokens = append.tokens;
  if (query_rows > 0 && session.config.evict_outside_window) {
    // Before anything changes. This append frees keys only once the view is
    // taken, and only keys its last row does not see; the keys before it
    // that are freed now stay freed, and the ones it brings are held.
    const int64_t held = layer.length;
    const int64_t after = held + tokens;
    const int64_t position = after - query_rows;  // The first row's.
    const std::optional<FreedKeys> freed = FreedKeysSeen(
        session.config, page_tokens, after, position,
        [&layer, page_tokens, held](size_t p) {
          if (p >= layer.pages.size())
            return static_cast<int64_t>(p) * page_tokens;
          if (layer.pages[p] == nullptr) {
            return std::min(static_cast<int64_t>(p + 1) * page_tokens, held);
          }
          return HeldFrom(true, page_tokens, layer.lost_end, p);
        });
    if (freed) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the step's first query row (position ", position,
          ") sees the keys from ", WindowStart(session.config, position),
          " on (window_left ", session.config.window_left, ") and the ",
          std::min(session.config.num_sink_tokens, after),
          " sinks, and the session freed keys ", freed->first, " to ",
          freed->last,
          " (evict_outside_window keeps the sinks and the last window_left + "
          "1 keys); nothing was appended or computed"));
    }
  }
  if (tokens > 0) {
    if (layer.length + tokens > session.config.max_tokens) {
      return Permanent(absl::ResourceExhaustedError(
          absl::StrCat("session ", session.id, " layer ", layer_index,
                       " holds ", layer.length, " tokens; appending ", tokens,
                       " would pass its max_tokens ", session.config.max_tokens,
                       "; nothing was appended")));
    }
    // A partly filled last page is written in place only if this table alone
    // holds it and no step reads it; else it is copied first. One that
    // evict_outside_window freed (a truncate or fork came back into it) is
    // replaced by a zeroed page: its earlier tokens are outside the next
    // token's window (CheckHeld saw to it), so no later token reads them.
    const bool partial = layer.length % page_tokens != 0;
    const bool copy_last = partial && (layer.pages.back() == nullptr ||
                                       layer.pages.back().use_count() > 1);
    const int64_t new_pages =
        (layer.length + tokens + page_tokens - 1) / page_tokens -
        static_cast<int64_t>(layer.pages.size());
    const int64_t bytes = (new_pages + (copy_last ? 1 : 0)) *
                              PageArena::Footprint(layout.PageBytes()) +
                          new_pages * kTableEntryBytes;
    EvictionPlan plan;
    if (absl::Status room =
            PlanRoom(bytes, "the step", session.owner, &session, &plan);
        !room.ok()) {
      return room;
    }
    Evict(plan);
    // Every page first, so that a failed mapping leaves the layer as it was.
    std::vector<std::shared_ptr<Page>> fresh;
    for (int64_t p = 0; p < new_pages + (copy_last ? 1 : 0); ++p) {
      fresh.push_back(NewPage(layout));
      if (fresh.back() == nullptr) {
        return absl::ResourceExhaustedError(
            absl::StrCat("the system has no memory to map for KV-cache pages "
                         "(under the budget, kv_cache_bytes ",
                         options_.kv_cache_bytes, "); nothing was appended"));
      }
    }
    auto next = fresh.begin();
    if (copy_last) {
      std::shared_ptr<Page> copy = *next++;
      if (layer.pages.back() == nullptr) {
        std::memset(copy->data, 0, static_cast<size_t>(layout.PageBytes()));
        layer.lost_end = layer.length;  // Its keys before the append.
      } else {
        std::memcpy(copy->data, layer.pages.back()->data,
                    static_cast<size_t>(layout.PageBytes()));
      }
      Release(session.account, &layer.pages.back());
      layer.pages.back() = std::move(copy);
      Hold(session.account, layer.pages.back());
    }
    for (; next != fresh.end(); ++next) {
      layer.pages.push_back(std::move(*next));
      Hold(session.account, layer.pages.back());
      ChargeBookkeeping(&session, kTableEntryBytes);
    }
    const int64_t element = DataTypeBytes(layout.dtype);
    const int64_t key_in = DataTypeBytes(append.key_dtype);
    const int64_t value_in = DataTypeBytes(append.value_dtype);
    // Runs of tokens that stay in one page, for each kv head.
    for (int64_t t = 0; t < tokens;) {
      const int64_t at = layer.length + t;
      const int64_t offset = at % page_tokens;
      const int64_t run = std::min(tokens - t, page_tokens - offset);
      char* page = layer.pages[static_cast<size_t>(at / page_tokens)]->data;
      for (int64_t h = 0; h < layout.kv_heads; ++h) {
        const char* key =
            append.key + (h * tokens + t) * layout.key_dim * key_in;
        if (layout.keys_transposed) {  // The head's keys [Dk, page_tokens].
          CopyRowsAsColumns(
              key, append.key_dtype, run, layout.key_dim, page_tokens,
              page + layout.KeysAt(h) + offset * element, layout.dtype);
        } else {
          CopyRows(key, append.key_dtype, run, layout.key_dim,
                   page + layout.KeysAt(h) + offset * layout.key_dim * element,
                   layout.dtype);
        }
        CopyRows(
            append.value + (h * tokens + t) * layout.value_dim * value_in,
            append.value_dtype, run, layout.value_dim,
            page + layout.ValuesAt(h) + offset * layout.value_dim * element,
            layout.dtype);
      }
      t += run;
    }
    layer.length += tokens;
    *length = layer.length;
    if (metrics_ != nullptr) metrics_->TokensAppended(tokens);
  }
  Touch(&session, absl::Now());
  View view;
  view.layout = layout;
  view.length = layer.length;
  view.lost_end = layer.lost_end;
  for (const std::shared_ptr<Page>& page : layer.pages) {
    view.pages.push_back(page);
    view.data.push_back(page == nullptr ? nullptr : page->data);
  }
  // The view holds what this step reads; the table lets go of what no later
  // step will.
  EvictOutsideWindow(&session, static_cast<size_t>(layer_index));
  RecordTotals();
  return view;
}

void SessionStore::Clear() {
  absl::MutexLock lock(&mutex_);
  std::vector<std::shared_ptr<Session>> all;
  for (const auto& [id, session] : sessions_) all.push_back(session);
  for (const std::shared_ptr<Session>& session : all) {
    Remove(session, "was dropped when the server shut down",
           SessionRemoval::kDrained);
  }
  RecordTotals();
}

SessionTotals SessionStore::Totals() {
  absl::MutexLock lock(&mutex_);
  return {static_cast<int64_t>(sessions_.size()), pages_->load(),
          used_bytes_->load(), shared_bytes_, options_.kv_cache_bytes};
}

}  // namespace attnserve
