// attnserve::ShardedSession: one KV-cache session larger than a replica,
// spread over several.
//
// clang-format off
//   ATTNSERVE_ASSIGN_OR_RETURN(attnserve::ShardedSession session,
//       attnserve::ShardedSession::Create(replicas.get(), create,
//                                         /*shard_tokens=*/32768, timeout));
//   ATTNSERVE_RETURN_IF_ERROR(session.Append(layer, key, value, timeout));
//   ATTNSERVE_ASSIGN_OR_RETURN(attnserve::StepOutput out,
//       session.Attend(layer, key, value, query, v1::StepOptions(), timeout));
// clang-format on
//
// Shard s is an ordinary session (attnserve/client/session.h) on one replica,
// holding tokens [s·C, (s+1)·C) of every layer, C = `shard_tokens`. Appends
// go to the shard their positions fall in (a chunk crossing a boundary is
// cut there), and a shard is created, on a replica holding no other shard of
// this session while there is one, when the first token reaches it. A step
// with a query sends the query to every shard holding tokens of its layer at
// once: the last shard appends and attends in one step, the others attend
// with a query-only step. Each answers its output and lse over its own keys,
// merged exactly (double precision):
//
// clang-format off
//   lse = log Σ_s exp(lse_s),   o = Σ_s exp(lse_s − lse) · o_s
// clang-format on
//
// so the answer equals one session's over all the tokens, up to the float
// rounding of the merge (docs/api.md gives the tolerance). Every shard but
// the last is wholly before the query, so its keys are all visible; that
// holds for one query row only, so a query of Tq > 1 rows is taken while the
// layer lies in one shard, and refused (INVALID_ARGUMENT) once it spans more.
//
// Each shard keeps Session's retry rules (expected lengths, recovery of lost
// answers); a shard whose replica is gone fails the step ABORTED
// (IsReplicaGone), and with it the tokens it held: a sharded session is not
// rebuilt, and every later step on a layer with tokens in that shard (or
// whose append would reach it), and on a layer whose shards no longer hold
// what length() says (a shard rebuilt empty by hand), is refused
// FAILED_PRECONDITION. A step whose tensors do not have the session's shapes
// is refused before any shard is sent a piece. After any other failure,
// length() is what the shards hold and the error says what stands: the
// step's first N tokens (send the rest, not the whole step again), or its
// whole append with the query unanswered (send the query again alone). With
// every replica to spare down, draining or hung past half the time left, a
// new shard goes on a replica holding one. Windows, sinks, ALiBi and RoPE are
// refused at Create (a shard's positions start at 0). Not thread-safe; the
// Replicas must outlive it.
#ifndef ATTNSERVE_CLIENT_SHARDED_SESSION_H_
#define ATTNSERVE_CLIENT_SHARDED_SESSION_H_

#include <cstdint>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnserve/client/replicas.h"
#include "attnserve/client/session.h"

namespace attnserve {

class ShardedSession {
 public:
  // Creates the first shard (Replicas::CreateSession with `request`, whose
  // session_id must be empty: every shard draws its own). INVALID_ARGUMENT
  // for shard_tokens < 1 or above the request's max_tokens (when set), and
  // for defaults that depend on a key's position (window, sinks, ALiBi,
  // RoPE).
  static absl::StatusOr<ShardedSession> Create(
      Replicas* replicas, const v1::CreateSessionRequest& request,
      int64_t shard_tokens, absl::Duration timeout);

  ShardedSession(ShardedSession&&) = default;
  ShardedSession& operator=(ShardedSession&&) = default;

  // The tokens `layer` holds over all shards.
  int64_t length(int64_t layer) const { return lengths_.at(layer); }
  int64_t num_layers() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t shard_tokens() const { return shard_tokens_; }
  const std::vector<Session>& shards() const { return shards_; }

  // Appends `inputs`' tokens (if any), then, with a query, attends over the
  // layer's whole cache. The output comes in options.output_dtype (else the
  // query's), the lse with options.return_lse.
  absl::StatusOr<StepOutput> Step(StepInputs inputs, absl::Duration timeout);
  absl::Status Append(int64_t layer, v1::Tensor key, v1::Tensor value,
                      absl::Duration timeout);
  absl::StatusOr<StepOutput> Attend(int64_t layer, v1::Tensor key,
                                    v1::Tensor value, v1::Tensor query,
                                    const v1::StepOptions& options,
                                    absl::Duration timeout);

  // Deletes every shard not yet deleted, all at once (a shard whose replica
  // is gone or hangs does not keep the others alive); the first error, named
  // by its shard.
  absl::Status Delete(absl::Duration timeout);

 private:
  ShardedSession(Replicas* replicas, v1::CreateSessionRequest request,
                 int64_t shard_tokens, Session first);

  // INVALID_ARGUMENT unless the step's tensors have the session's shapes.
  absl::Status CheckInputs(const StepInputs& inputs) const;
  // Creates shards until shard `index` exists.
  absl::Status EnsureShard(size_t index, absl::Time deadline);
  // FAILED_PRECONDITION unless every shard holds what length(layer) says
  // (the shards before the last full, the rest empty) and none that the
  // layer's tokens up to `end` lie in was lost with its replica.
  absl::Status CheckShards(int64_t layer, int64_t end) const;
  // `error`, from shard `shard` during a step of `layer` from `start` to
  // `end` tokens, after which length(layer) is what the shards hold; its
  // message says what of the step stands.
  absl::Status Failed(const absl::Status& error, size_t shard, int64_t layer,
                      int64_t start, int64_t end, bool has_query);

  Replicas* replicas_;
  v1::CreateSessionRequest request_;
  int64_t shard_tokens_;
  std::vector<Session> shards_;
  std::vector<int64_t> lengths_;  // Per layer, over all shards.
  std::set<size_t> lost_;  // Shards lost with their replicas (and tokens).
};

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_SHARDED_SESSION_H_
