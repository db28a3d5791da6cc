// attnserve::Replicas: the replicas behind one target, one channel each, and
// KV-cache sessions placed on them and pinned there.
//
// clang-format off
//   ATTNSERVE_ASSIGN_OR_RETURN(std::unique_ptr<attnserve::Replicas> replicas,
//       attnserve::Replicas::Connect("dns:///attnserve-headless.prod.svc:50051"));
//   ATTNSERVE_ASSIGN_OR_RETURN(attnserve::Session session,
//                              replicas->CreateSession(create, timeout));
//   session.SetRebuild([&](attnserve::Session& fresh,
//                          const std::vector<int64_t>& lengths,
//                          absl::Duration timeout) {
//     return Prefill(fresh, lengths, timeout);  // the caller's own prefill
//   });
//   ... session.Attend(...) ...  // steps go to the session's replica only
// clang-format on
//
// A session lives in one server process's memory. A Client over a target of
// many addresses balances each call over them, so a session's steps would
// reach replicas that do not hold it. Replicas resolves the target to its
// addresses ("ipv4:a:p,b:p", "ipv6:...", "dns:///host:port" or "host:port",
// which it resolves itself, as a headless Service's name gives every pod)
// and keeps one Client per address. New sessions are spread by rendezvous
// (highest random weight) hashing: the library draws the session's id, ranks
// the addresses by a hash of (address, id), and creates the session on the
// first that takes it (a draining or unreachable one answers UNAVAILABLE, and
// the next is asked). Adding or removing a replica moves only the sessions
// whose first choice it is. The Session is pinned to its replica's address
// and knows the replica's identity (name and incarnation): its steps carry
// the incarnation, so a replica that restarted refuses them instead of
// answering NOT_FOUND.
//
// When a session's replica is gone (unreachable through the retries and then
// unanswering a GetSession that waits a moment for it to be reached; draining;
// or restarted: another incarnation answers at its address), a step fails with
// ABORTED, saying so, and IsReplicaGone() is true of the status. With a
// rebuild hook (Session::SetRebuild), the library instead creates the session
// again on the next replica in rendezvous order, calls the hook to restore
// its tokens (the caller's own prefill: the server keeps no copy elsewhere),
// and sends the step again.
//
// Thread-safe. Sessions keep a pointer to their Replicas and its Clients: it
// must outlive them.
#ifndef ATTNSERVE_CLIENT_REPLICAS_H_
#define ATTNSERVE_CLIENT_REPLICAS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnserve/client/client.h"
#include "attnserve/client/session.h"

namespace attnserve {

// The payload (the replica's address) of the status a pinned session's call
// returns when its replica is gone.
inline constexpr absl::string_view kReplicaGonePayload =
    "attnserve.dev/replica-gone";
// How that status's message ends: what to do with the session. A
// ShardedSession's shard leaves it out (a sharded session is not rebuilt).
inline constexpr absl::string_view kRebuildAdvice =
    "; create the session again elsewhere (Session::Rebuild, or a rebuild "
    "hook)";

// Whether `status` says a session's replica is gone (its sessions with it):
// the ABORTED status a pinned Session's calls return then.
bool IsReplicaGone(const absl::Status& status);

// The rendezvous weight of `address` for `key`: FNV-1a (64 bits) of
// address + "/" + key, then SplitMix64's finaliser. Stable across processes
// and languages, so that every client ranks replicas alike.
uint64_t RendezvousWeight(absl::string_view address, absl::string_view key);

// 32 lowercase hex digits from the operating system's random source: a
// session id for CreateSessionRequest.session_id.
std::string RandomSessionId();

class Replicas {
 public:
  // Resolves `target` and makes a Client for each address, with `options`
  // (load balancing aside: each Client has one address). INVALID_ARGUMENT for
  // a malformed target, UNAVAILABLE if it resolves to no address.
  static absl::StatusOr<std::unique_ptr<Replicas>> Connect(
      absl::string_view target, const ClientOptions& options = {});

  // Resolves the target again: new addresses get Clients; addresses that
  // left stop getting new sessions (their Clients stay, for the sessions
  // pinned to them). DEADLINE_EXCEEDED, with nothing changed, if the name's
  // resolution has not answered by `deadline`.
  absl::Status Refresh(absl::Time deadline = absl::InfiniteFuture());

  // The addresses the target resolved to at the last resolution, sorted.
  std::vector<std::string> addresses() const;

  // The Client of `address` (one of addresses(), or one that left); null for
  // an unknown one.
  Client* client(absl::string_view address) const;

  // addresses() by descending RendezvousWeight for `key`.
  std::vector<std::string> Rank(absl::string_view key) const;

  // Creates a session on the first replica in rendezvous order for its id
  // (`request.session_id`, drawn by RandomSessionId() when empty) that takes
  // it, skipping `avoid` and the replicas that answer UNAVAILABLE (draining
  // or unreachable: the target is resolved again before giving up),
  // CANCELLED (shutting down), RESOURCE_EXHAUSTED (full: its session caps or
  // KV cache; not a refusal of the request itself, which the server marks
  // and every replica would make) or nothing within their share of `timeout`
  // (an equal part of what is left for each replica left to ask, at least
  // 2 s, so that a hung one does not take it all). Any other error is
  // returned as is; RESOURCE_EXHAUSTED if every replica asked was full, else
  // UNAVAILABLE, naming each refusal. The Session is pinned to that replica.
  absl::StatusOr<Session> CreateSession(
      v1::CreateSessionRequest request, absl::Duration timeout,
      const std::set<std::string>& avoid = {});

  // Takes over the session `session_id` that lives at `address` (as another
  // process recorded it), pinned there.
  absl::StatusOr<Session> AttachSession(absl::string_view address,
                                        absl::string_view session_id,
                                        absl::Duration timeout);

  const std::string& target() const { return target_; }

 private:
  Replicas(std::string target, ClientOptions options)
      : target_(std::move(target)), options_(std::move(options)) {}

  // The target's addresses now ("host:port" / "[v6]:port"), sorted, as
  // resolved by `deadline`.
  absl::StatusOr<std::vector<std::string>> Resolve(
      absl::Time deadline = absl::InfiniteFuture()) const;

  const std::string target_;
  const ClientOptions options_;
  mutable absl::Mutex mutex_;
  std::vector<std::string> addresses_ ABSL_GUARDED_BY(mutex_);
  // Every address's Client, also of addresses that left.
  std::map<std::string, std::unique_ptr<Client>, std::less<>> clients_
      ABSL_GUARDED_BY(mutex_);
};

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_REPLICAS_H_
