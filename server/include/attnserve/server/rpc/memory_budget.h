// MemoryBudget: the bytes that requests in flight may hold at once
// (--max_inflight_bytes), and the plan that fits the server's budgets into the
// memory it is given.
//
// A call holds a share of the budget from its arrival (a fixed cost for its
// stream), through its message and the memory its compute will allocate, to
// the moment gRPC reports its answer sent; a call that would take the budget
// past its limit is refused at once with RESOURCE_EXHAUSTED instead of letting
// the process grow until the kernel kills it with every call in it.
//
//   MemoryBudget budget(int64_t{2} << 30);
//   absl::StatusOr<MemoryBudget::Hold> hold =
//       budget.Take(message_bytes, call.peer());
//   if (!hold.ok()) return hold.status();  // RESOURCE_EXHAUSTED, with figures
//   ATTNSERVE_RETURN_IF_ERROR(hold->Grow(compute_bytes));
//   ...  // the hold gives its bytes back when destroyed (or Reset)
#ifndef ATTNSERVE_SERVER_RPC_MEMORY_BUDGET_H_
#define ATTNSERVE_SERVER_RPC_MEMORY_BUDGET_H_

#include <cstdint>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace attnserve {

// Thread-safe; must outlive its holds.
//
// Fairness: each hold belongs to a connection (its peer, as gRPC names it:
// "ipv4:10.0.0.7:51234") and to the client address the connection comes from
// (PeerAddress: "ipv4:10.0.0.7"). One connection may hold at most half the
// limit, and a connection, or the connections of one address together, holding
// more than a sixteenth of it may not take the budget past seven eighths: the
// last eighth stays for clients that hold little, so that one client (or a
// few) filling the budget with large or stuck calls, on one connection or on
// hundreds, leaves the others served. Clients behind one proxy or NAT share an
// address, and so share that rule.
class MemoryBudget {
 public:
  // Bytes taken from the budget; given back when the hold is destroyed, reset
  // or assigned over. Movable, not copyable; not thread-safe itself.
  class Hold {
   public:
    Hold() = default;
    Hold(Hold&& other) noexcept;
    Hold& operator=(Hold&& other) noexcept;
    ~Hold() { Reset(); }

    // Takes `bytes` more from the budget for the same connection; on
    // RESOURCE_EXHAUSTED the hold keeps what it had.
    absl::Status Grow(int64_t bytes);
    // Gives everything back.
    void Reset();
    int64_t bytes() const { return bytes_; }

   private:
    friend class MemoryBudget;
    Hold(MemoryBudget* budget, std::string connection, std::string address,
         int64_t bytes)
        : budget_(budget),
          connection_(std::move(connection)),
          address_(std::move(address)),
          bytes_(bytes) {}

    MemoryBudget* budget_ = nullptr;
    std::string connection_;
    std::string address_;  // PeerAddress(connection_), taken once.
    int64_t bytes_ = 0;
  };

  // `limit_bytes` > 0.
  explicit MemoryBudget(int64_t limit_bytes) : limit_(limit_bytes) {}
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  // Takes `bytes` (>= 0) for `connection`, or RESOURCE_EXHAUSTED naming the
  // limit, what is held and what was asked, if the budget cannot give them
  // now.
  absl::StatusOr<Hold> Take(int64_t bytes, const std::string& connection);
  // Takes `bytes` even past the limit: for what must not be refused (a health
  // check), so that what it holds is still counted.
  Hold TakeAlways(int64_t bytes, const std::string& connection);

  int64_t limit() const { return limit_; }
  int64_t held() const ABSL_LOCKS_EXCLUDED(mutex_);
  // What `connection` holds now.
  int64_t held_by(const std::string& connection) const
      ABSL_LOCKS_EXCLUDED(mutex_);
  // What the connections from `address` (a PeerAddress) hold now.
  int64_t held_from(const std::string& address) const
      ABSL_LOCKS_EXCLUDED(mutex_);
  // Calls refused so far.
  int64_t refused() const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  // Adds `bytes` to what is held unless the rules above refuse them.
  absl::Status Reserve(int64_t bytes, const std::string& connection,
                       const std::string& address) ABSL_LOCKS_EXCLUDED(mutex_);
  void Release(int64_t bytes, const std::string& connection,
               const std::string& address) ABSL_LOCKS_EXCLUDED(mutex_);

  const int64_t limit_;
  mutable absl::Mutex mutex_;
  int64_t held_ ABSL_GUARDED_BY(mutex_) = 0;
  // What each connection holding anything holds.
  absl::flat_hash_map<std::string, int64_t> connections_
      ABSL_GUARDED_BY(mutex_);
  // What the connections of each address holding anything hold.
  absl::flat_hash_map<std::string, int64_t> addresses_ ABSL_GUARDED_BY(mutex_);
  int64_t refused_ ABSL_GUARDED_BY(mutex_) = 0;
};

// The client address of a gRPC peer: "ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7",
// "ipv6:[::1]:51234" -> "ipv6:[::1]"; a peer of another form is its own
// address.
std::string PeerAddress(const std::string& peer);

// What a stream costs the budget while it is open, whatever its messages:
// gRPC's own state for a call and its HTTP/2 stream, measured at 15-16 KiB for
// an idle Health.Watch or AttendStream call (gRPC 1.51, 2026-12-01); rounded
// up.
inline constexpr int64_t kBytesPerCall = int64_t{16} << 10;

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_MEMORY_BUDGET_H_
