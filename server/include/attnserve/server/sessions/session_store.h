// SessionStore: the KV-cache sessions the server holds, in pages under one
// byte budget.
//
// A session is one sequence's keys and values for `layers` layers. Each layer
// keeps a page table: pages of `page_tokens` tokens (keys [Hkv, Dk,
// page_tokens], each head's transposed, where the CPU's paged kernel reads
// them faster so, else [Hkv, page_tokens, Dk]; then values [Hkv, page_tokens,
// Dv]; in the session's dtype: attnserve/core/paged_attention.h). A fork
// shares its parent's pages by reference; a page is written only while one
// table holds it and no step is reading it, so a shared or read page is copied
// first (copy on write). Every page is charged to the budget from its
// allocation to its release (in whole 4 KiB pages: PageArena::Footprint), so
// the pages held never exceed it: past it the store evicts sessions no step
// is using (EvictionPolicy::kLru), or refuses (kNone). Sessions idle past
// their TTL expire.
//
// A session belongs to the identity that created it (CallGate::Identity in
// rpc/call_gate.h); any other identity gets NOT_FOUND for it, with the very
// message an unknown id gets. The owner learns why a session is gone
// (expired, evicted, deleted) for the last `max_tombstones` removals.
//
// Identities share the store fairly. Each may be capped
// (kv_cache_bytes_per_identity, max_sessions_per_identity): past its cap an
// identity's own least recently used sessions go (kLru), or its new work is
// refused (kNone). Past the store's budget or max_sessions, the sessions that
// go are the least recently used of the identity that would hold the most
// (the one asking counted with what it asks for), and another identity's
// only while it holds at least as much as the one asking would: one caller's
// flood evicts its own sessions, never those of a caller holding less, and
// with one identity this is plain LRU. Forks stay with their owner, so every
// page belongs to one identity.
//
// Thread-safe: one mutex guards the tables; the compute reads pages outside
// it through the references a view holds.
#ifndef ATTNSERVE_SERVER_SESSIONS_SESSION_STORE_H_
#define ATTNSERVE_SERVER_SESSIONS_SESSION_STORE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnserve/common/dtype.h"
#include "attnserve/core/paged_attention.h"
#include "attnserve/core/rotary.h"
#include "attnserve/server/metrics/metrics.h"
#include "attnserve/server/sessions/page_arena.h"

namespace attnserve {

enum class EvictionPolicy {
  kLru,   // Past the budget, evict the least recently used idle sessions.
  kNone,  // Past the budget, refuse with RESOURCE_EXHAUSTED.
};

// The store's budget and limits (flags: docs/api.md, "Sessions").
struct SessionOptions {
  // The most bytes of pages held at once. 0: derived by the memory plan.
  int64_t kv_cache_bytes = 0;
  EvictionPolicy eviction = EvictionPolicy::kLru;
  int64_t page_tokens = 64;
  int64_t max_sessions = 4096;
  // The most sessions, and bytes of kv_cache_bytes, one identity may hold;
  // 0: no cap but the store's.
  int64_t max_sessions_per_identity = 0;
  int64_t kv_cache_bytes_per_identity = 0;
  // Caps each session's max_tokens (the most tokens a layer may hold).
  int64_t max_session_tokens = 131072;
  int64_t max_session_layers = 256;
  // Caps each session's TTL; also its default.
  absl::Duration session_ttl = absl::Minutes(10);
  int64_t max_steps_per_call = 1024;
  // The most bytes one page may take (page_tokens × Hkv × (Dk + Dv) × dtype).
  int64_t max_page_bytes = int64_t{16} << 20;
  // Removed sessions whose reason the owner can still learn.
  int64_t max_tombstones = 65536;
  // The name CreateSession reports as the replica's; empty: the host name.
  std::string replica_name;
  // PageLayout::keys_transposed of every page; nullopt: the layout this
  // CPU's paged kernel reads fastest (PreferredKeysTransposed). Set only by
  // tests, to run either layout on any CPU.
  std::optional<bool> keys_transposed;
};

// Which process holds the sessions (v1::ReplicaIdentity).
struct ReplicaIdentity {
  std::string name;
  std::string incarnation;  // 16 lowercase hex digits, drawn per store
};

// What a session is made with (validated by the caller against the limits).
struct SessionConfig {
  int64_t layers = 1;
  int64_t heads = 1;     // H
  int64_t kv_heads = 1;  // Hkv
  int64_t key_dim = 1;
  int64_t value_dim = 1;
  DataType dtype = DataType::kFloat32;
  int64_t max_tokens = 1;
  absl::Duration ttl = absl::Minutes(10);
  std::optional<float> scale;  // Steps' default; nullopt: 1 / sqrt(Dk).
  // The attention variant of every step (v1::SessionDefaults).
  int64_t window_left = -1;  // −1: unbounded
  int64_t num_sink_tokens = 0;
  std::vector<float> alibi_slopes;  // Empty or H.
  std::optional<float> softcap;
  // After each step, free the pages wholly between the sinks and the last
  // window_left tokens (needs window_left >= 0).
  bool evict_outside_window = false;
  // RoPE of the keys appended and the queries asked (v1::SessionDefaults).
  std::optional<RotaryEmbedding> rope;
};

// Keys [first, last] of a layer, freed by evict_outside_window.
struct FreedKeys {
  int64_t first = 0;
  int64_t last = 0;
};

// The first run of freed keys among a layer's `length` keys (in pages of
// `page_tokens`; `held_from(p)` is the first key of page p still held: its
// first if all are, its end or past it if none is) that queries at
// `position` and after see in a session of `config`: its sinks and the keys
// from position − window_left on. nullopt when they see none.
std::optional<FreedKeys> FreedKeysSeen(
    const SessionConfig& config, int64_t page_tokens, int64_t length,
    int64_t position, absl::FunctionRef<int64_t(size_t)> held_from);

// The first key of page `p` (of a layer in pages of `page_tokens`) held, for
// FreedKeysSeen: a freed (null) page holds none; in the held page where
// `lost_end` falls, the keys before it were freed before the page replaced a
// freed one (an append after a truncate or fork into it), and are zeros, not
// keys. Every other held page holds all its keys.
int64_t HeldFrom(bool page_held, int64_t page_tokens, int64_t lost_end,
                 size_t p);

// The first key a query at `position` sees beyond its sinks.
int64_t WindowStart(const SessionConfig& config, int64_t position);

// What a session of `config` holds besides its pages, with `table_entries`
// page references in its layers' tables: its record, each layer's, each ALiBi
// slope, each reference (a fork copies its parent's). Charged to the KV cache
// budget, so that forks of a long session, or many empty sessions of many
// layers, cannot hold memory the budget does not see.
int64_t SessionBookkeepingBytes(const SessionConfig& config,
                                int64_t table_entries);

// How the pages of a session of `config` are laid out in a store of
// `options`: pages of options.page_tokens tokens, or of config.max_tokens
// where that is fewer.
PageLayout PageLayoutOf(const SessionConfig& config,
                        const SessionOptions& options);

// A session as GetSession and ListSessions report it.
struct SessionDescription {
  std::string id;
  SessionConfig config;
  std::vector<int64_t> lengths;  // Per layer.
  int64_t bytes = 0;             // Of the pages its tables hold.
  int64_t shared_bytes = 0;      // Of those, held by other sessions too.
  absl::Time created;
  absl::Time last_used;
  std::string forked_from;
};

// An owner's sessions, oldest first (then by id), and the bytes of the
// distinct pages they reference (a page forks share counts once), read
// together with what counts against the owner's share
// (kv_cache_bytes_per_identity): those pages, the sessions' bookkeeping, and
// pages of the owner's that no session holds any more but steps in flight
// still read.
struct SessionListing {
  std::vector<SessionDescription> sessions;
  int64_t bytes = 0;
  int64_t held_bytes = 0;
};

// A place in a listing's order: a session's creation time (ns since the
// epoch) and id.
struct ListingPlace {
  int64_t created_ns = 0;
  std::string id;
};

// Tokens to append to one layer: key [Hkv, T, Dk] and value [Hkv, T, Dv],
// packed, little-endian, in their own dtypes.
struct KvAppend {
  int64_t tokens = 0;  // T
  const char* key = nullptr;
  DataType key_dtype = DataType::kFloat32;
  const char* value = nullptr;
  DataType value_dtype = DataType::kFloat32;
};

// The store's totals, for the metrics.
struct SessionTotals {
  int64_t sessions = 0;
  int64_t pages = 0;
  int64_t used_bytes = 0;    // Pages allocated (read by steps included).
  int64_t shared_bytes = 0;  // Pages held by more than one session.
  int64_t budget_bytes = 0;
};

class SessionStore {
 public:
  struct Session;
  struct Page;
  struct Account;
  struct EvictionPlan;

  // A session pinned for a call's step: looked up and owner-checked, and not
  // evicted or expired until the pin is dropped (deleting it still works).
  class Pin {
   public:
    Pin(SessionStore* store, std::shared_ptr<Session> session);
    Pin(Pin&& other) noexcept = default;
    Pin& operator=(Pin&&) = delete;
    ~Pin();

    const SessionConfig& config() const;
    const std::string& id() const;
    // The tokens `layer` (0 to config().layers − 1) holds now; 0 once the
    // session is gone.
    int64_t Length(int64_t layer) const;

   private:
    friend class SessionStore;
    SessionStore* store_;
    std::shared_ptr<Session> session_;
  };

  // One layer's cache as a step's compute reads it: its pages, held until
  // the view is dropped, so that nothing writes or frees them meanwhile.
  struct View {
    PageLayout layout;
    int64_t length = 0;
    std::vector<std::shared_ptr<const Page>> pages;
    std::vector<const char*> data;  // pages[i]'s bytes (null: freed)
    int64_t lost_end = 0;           // As the layer's (HeldFrom).
  };

  // `metrics` may be null (tests).
  SessionStore(const SessionOptions& options, ServerMetrics* metrics);
  ~SessionStore();

  SessionStore(const SessionStore&) = delete;
  SessionStore& operator=(const SessionStore&) = delete;

  const SessionOptions& options() const { return options_; }

  // A new session owned by `owner`, with the id `id` (already of the form of
  // one; empty: a fresh one is drawn). RESOURCE_EXHAUSTED at max_sessions
  // when no idle session may be evicted; ALREADY_EXISTS when `id` is held or
  // was recently removed; UNAVAILABLE once StopCreating was called.
  absl::StatusOr<SessionDescription> Create(const std::string& owner,
                                            const SessionConfig& config,
                                            const std::string& id = "");

  // A new session sharing the first `length` tokens (nullopt: all) of each of
  // `id`'s layers. `ttl` zero: the parent's.
  absl::StatusOr<SessionDescription> Fork(const std::string& owner,
                                          const std::string& id,
                                          std::optional<int64_t> length,
                                          absl::Duration ttl);
  // Drops every layer's tokens past `length`.
  absl::StatusOr<SessionDescription> Truncate(const std::string& owner,
                                              const std::string& id,
                                              int64_t length);
  absl::StatusOr<SessionDescription> Delete(const std::string& owner,
                                            const std::string& id);
  absl::StatusOr<SessionDescription> Get(const std::string& owner,
                                         const std::string& id);
  // `owner`'s sessions and what they hold.
  SessionListing List(const std::string& owner);
  // What `owner`'s sessions hold (`sessions` left empty), and its sessions in
  // the listing's order from the first after `after` (nullopt: the first),
  // each described to `take`, under the store's lock, until it returns false.
  // Only those described are copied: a page of a long listing costs its
  // page, not the listing (until 2026-12-07 every call described every
  // session of every caller's, under the lock).
  SessionListing List(const std::string& owner,
                      const std::optional<ListingPlace>& after,
                      absl::FunctionRef<bool(const SessionDescription&)> take);

  // Pins `owner`'s session `id` for a step; NOT_FOUND as for Get.
  absl::StatusOr<Pin> Acquire(const std::string& owner, const std::string& id);

  // Drops `view`'s pages under the store's lock. An append writes into a
  // page in place once its table alone holds it, which it learns from the
  // page's use count: a relaxed read that orders nothing, so a step that read
  // the page drops its view here, and the lock puts the append after the
  // step's reads.
  void Drop(View& view);

  // Checks that `layer` holds `expected_length` tokens (FAILED_PRECONDITION
  // naming both lengths otherwise), appends `append` if it has tokens (its
  // shapes checked against the session by the caller), and returns the view
  // of the layer with them. Nothing is appended on any error:
  // RESOURCE_EXHAUSTED past the session's max_tokens or the budget;
  // FAILED_PRECONDITION if the first of `query_rows` query rows after the
  // append (0: a step without a query) would see keys evict_outside_window
  // freed; NOT_FOUND if the session was deleted meanwhile. `*length` gets the
  // tokens the layer holds when the call returns (on any error but
  // NOT_FOUND).
  absl::StatusOr<View> AppendAndView(const Pin& pin, int64_t layer,
                                     int64_t expected_length,
                                     const KvAppend& append, int64_t query_rows,
                                     int64_t* length);

  // Expires the idle sessions past their TTL (also done on each call, at most
  // once a second).
  void ExpireIdle(absl::Time now);

  // Drops every session (the server is shutting down).
  void Clear();

  // From now on Create and Fork answer UNAVAILABLE (the server is draining:
  // steps on the sessions it holds are still served, new sessions go to
  // another replica).
  void StopCreating() { creating_.store(false); }

  // This store's replica: its name and the incarnation drawn when the store
  // was made (sessions live and die with it).
  const ReplicaIdentity& replica() const { return replica_; }

  SessionTotals Totals();

 private:
  friend class Pin;
  struct Tombstone {
    std::string owner;
    std::string reason;
  };

  // The session `id` if `owner` owns it, else NOT_FOUND with the reason the
  // owner may know. Expires sessions first.
  absl::StatusOr<std::shared_ptr<Session>> Find(const std::string& owner,
                                                const std::string& id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // `owner`'s account, made if it has none.
  Account* AccountOf(const std::string& owner)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // `owner`'s account; null if it holds no session.
  Account* FindAccount(const std::string& owner)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // The bytes of `owner`'s pages that no session holds but steps still read:
  // its `account`'s (FindAccount), or, without one, those its last sessions
  // left behind.
  int64_t LingeringOf(const std::string& owner, const Account* account) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Adds to `plan` the idle sessions (other than `keep` and those chosen
  // already) that must go for one more session of `owner`'s: under
  // max_sessions_per_identity its own least recently used, under
  // max_sessions that of the identity holding the most sessions (kLru; see
  // the top of this file); RESOURCE_EXHAUSTED if none may go.
  absl::Status PlanRoomForSession(const std::string& owner, const Session* keep,
                                  EvictionPlan* plan)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Adds to `plan` the idle sessions (other than `keep`) that must go, on
  // top of those chosen already, for `bytes` more of `owner`'s (`what`
  // needs them: "the step") under kv_cache_bytes_per_identity and the
  // budget; RESOURCE_EXHAUSTED naming the limit if they would not make room.
  absl::Status PlanRoom(int64_t bytes, absl::string_view what,
                        const std::string& owner, const Session* keep,
                        EvictionPlan* plan)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Removes `plan`'s victims, telling each owner why.
  void Evict(const EvictionPlan& plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Adds `bytes` (negative: frees) to `session`'s bookkeeping, its account's
  // and the store's.
  void ChargeBookkeeping(Session* session, int64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // A page of `layout` from the arena; null if it could not map memory.
  std::shared_ptr<Page> NewPage(const PageLayout& layout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Adds a page to / drops it from a table of `account`'s session, keeping
  // the shared bytes and the account's.
  void Hold(Account* account, const std::shared_ptr<Page>& page)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void Release(Account* account, std::shared_ptr<Page>* page)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Removes a session from the tables (its pages go once no view holds
  // them), leaving a tombstone with `reason` for its owner.
  void Remove(const std::shared_ptr<Session>& session,
              const std::string& reason, SessionRemoval metric_reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // OK if every key a query at `position` sees among the first `length` of
  // layer `layer` is held; FAILED_PRECONDITION naming `what` and the freed
  // keys if evict_outside_window freed one.
  absl::Status CheckHeld(const Session& session, size_t layer, int64_t position,
                         int64_t length, absl::string_view what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Frees the pages of layer `layer` that no later query sees, if the session
  // evicts outside its window.
  void EvictOutsideWindow(Session* session, size_t layer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void Touch(Session* session, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void MaybeExpire(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  SessionDescription Describe(const Session& session) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // A fresh, unused 128-bit id as 32 lowercase hex digits.
  std::string NewId() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void RecordTotals() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  // UNAVAILABLE once StopCreating was called.
  absl::Status CheckCreating() const;

  const SessionOptions options_;
  ServerMetrics* const metrics_;
  const ReplicaIdentity replica_;
  std::atomic<bool> creating_{true};
  // Where pages' memory comes from (each page holds it too).
  std::shared_ptr<PageArena> arena_;
  // Bytes and count of the pages alive, changed by pages' destructors too.
  std::shared_ptr<std::atomic<int64_t>> used_bytes_;
  std::shared_ptr<std::atomic<int64_t>> pages_;

  absl::Mutex mutex_;
  absl::flat_hash_map<std::string, std::shared_ptr<Session>> sessions_
      ABSL_GUARDED_BY(mutex_);
  // Each identity's sessions and what they hold, while it holds any.
  absl::flat_hash_map<std::string, std::unique_ptr<Account>> accounts_
      ABSL_GUARDED_BY(mutex_);
  // Account::lingering of identities that hold no session now while steps
  // still read pages of theirs: taken back by their next account, dropped
  // by ExpireIdle once no view holds them.
  absl::flat_hash_map<std::string, std::shared_ptr<std::atomic<int64_t>>>
      lingering_without_account_ ABSL_GUARDED_BY(mutex_);
  absl::flat_hash_map<std::string, Tombstone> tombstones_
      ABSL_GUARDED_BY(mutex_);
  std::deque<std::string> tombstone_order_ ABSL_GUARDED_BY(mutex_);
  int64_t shared_bytes_ ABSL_GUARDED_BY(mutex_) = 0;
  // The sessions' bookkeeping (their records and page tables, not their
  // pages), charged to the budget beside the pages.
  int64_t bookkeeping_bytes_ ABSL_GUARDED_BY(mutex_) = 0;
  absl::Time last_expiry_ ABSL_GUARDED_BY(mutex_) = absl::InfinitePast();
};

// Whether `id` has the form of a session id: 32 lowercase hex digits.
bool IsSessionId(const std::string& id);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_SESSIONS_SESSION_STORE_H_
