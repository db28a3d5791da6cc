// CallGate: whether a call may enter — the server still takes calls (not
// draining) and the caller holds one of the bearer tokens, if any are
// configured — whether it may change weight sets, and who the caller is
// (Identity), for what it owns. Health checks never pass through it.
//
// At the very end of a drain the gate holds the calls it refuses instead of
// answering them at once: a client answered UNAVAILABLE sends its next call
// right away, and a call that reaches gRPC while it stops taking streams
// (before the client has seen its GOAWAY) is cancelled by gRPC, which a client
// cannot tell from a cancellation of a call that ran. Held calls are answered
// once gRPC has stopped taking streams, so that the clients' next calls meet
// the GOAWAY or the closed listener: UNAVAILABLE, never CANCELLED. (A call a
// client sends at its own pace, in the round trip between the GOAWAY going out
// and the client reading it, is still cancelled by gRPC before it gets here.)
//
//   // In a handler's OnStart:
//   const absl::Status admitted = gate->Admit(context());
//   if (!admitted.ok()) {
//     held_ = gate->HoldRefusal([this, admitted] { Refuse(admitted); });
//     if (!held_) Refuse(admitted);
//   }
//   // In its OnCancel:
//   if (held_ && gate->Unhold(*held_)) Refuse(...);
#ifndef ATTNSERVE_SERVER_RPC_CALL_GATE_H_
#define ATTNSERVE_SERVER_RPC_CALL_GATE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server_context.h"

namespace attnserve {

// Thread-safe.
class CallGate {
 public:
  using Ticket = uint64_t;

  // No `bearer_tokens`: calls need no token. No `admin_tokens`: any admitted
  // caller may change weight sets; else only a holder of one of them, which
  // is admitted to every call too. Each token is an identity of its own.
  explicit CallGate(std::vector<std::string> bearer_tokens,
                    std::vector<std::string> admin_tokens = {})
      : bearer_tokens_(std::move(bearer_tokens)),
        admin_tokens_(std::move(admin_tokens)) {}

  // OK; UNAVAILABLE once Close() was called; UNAUTHENTICATED without one
  // "authorization: Bearer <token>" header (the scheme in any case) for one of
  // the tokens (bearer or admin), when there are bearer tokens: a call with
  // two authorization headers is refused, whatever they hold.
  absl::Status Admit(const grpc::ServerContextBase& context) const;

  // For an admitted call that puts or deletes a weight set: OK without admin
  // tokens or with one; else UNAUTHENTICATED without a token and
  // PERMISSION_DENIED with another.
  absl::Status AdmitWeightChange(const grpc::ServerContextBase& context) const;

  // Who an admitted caller is: with bearer tokens, "token:" and the first 128
  // bits of the SHA-256 of its token (bearer or admin) in hex (the token
  // itself is never kept); else with a verified client certificate (mutual
  // TLS), "x509:" and the first 128 bits of the SHA-256 of its issuer's name
  // and key identifier, its subject's name and its subject alternative names
  // (one subject from two CAs is two identities, and two SPIFFE IDs under one
  // subject are two), whatever admin token it carries; else "" (one namespace
  // for every caller).
  std::string Identity(const grpc::ServerContextBase& context) const;

  // New calls get UNAVAILABLE from now on (the server is draining).
  void Close() { closed_.store(true); }

  // Calls refused because the gate was closed, so far.
  int64_t refused_closed() const { return refused_closed_.load(); }

  // While the gate holds refusals (between HoldRefusals and ReleaseHeld),
  // keeps `answer`, which answers a call the gate refused, until ReleaseHeld
  // runs it, and returns its ticket; otherwise returns nothing, and the caller
  // answers at once.
  std::optional<Ticket> HoldRefusal(std::function<void()> answer) const
      ABSL_LOCKS_EXCLUDED(mutex_);
  // For a held call that was cancelled: true if its answer was still held
  // (then the caller answers it), false if ReleaseHeld has taken it.
  bool Unhold(Ticket ticket) const ABSL_LOCKS_EXCLUDED(mutex_);

  // From now on refusals are held.
  void HoldRefusals() ABSL_LOCKS_EXCLUDED(mutex_);
  // Runs every held answer; refusals are answered at once from now on.
  // Returns how many were held.
  int ReleaseHeld() ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  // The most client certificates whose identity is kept.
  static constexpr size_t kCachedCertificates = 1024;

  const std::vector<std::string> bearer_tokens_;
  const std::vector<std::string> admin_tokens_;
  std::atomic<bool> closed_{false};
  mutable std::atomic<int64_t> refused_closed_{0};
  // The held answers are the gate's working state, not what it admits: the
  // handlers see a const gate.
  mutable absl::Mutex mutex_;
  bool holding_ ABSL_GUARDED_BY(mutex_) = false;
  mutable Ticket next_ ABSL_GUARDED_BY(mutex_) = 0;
  mutable std::map<Ticket, std::function<void()>> held_ ABSL_GUARDED_BY(mutex_);
  // Client certificates' identities, by the hash of their PEM (HashedName).
  mutable absl::Mutex certificates_mutex_;
  mutable absl::flat_hash_map<std::string, std::string> certificate_identities_
      ABSL_GUARDED_BY(certificates_mutex_);
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_CALL_GATE_H_
