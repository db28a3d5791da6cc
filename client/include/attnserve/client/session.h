// attnserve::Session: a KV-cache session on the server, seen from the client.
//
// clang-format off
//   v1::CreateSessionRequest create;
//   create.set_num_layers(32); create.set_num_heads(32);
//   create.set_num_kv_heads(8); create.set_key_dim(128);
//   create.set_dtype(v1::BFLOAT16);  // required
//   ATTNSERVE_ASSIGN_OR_RETURN(Session session,
//                              Session::Create(client.get(), create, timeout));
//   // Prefill: append the prompt's keys and values, layer by layer.
//   ATTNSERVE_RETURN_IF_ERROR(session.Append(layer, key, value, timeout));
//   // Decode: append one token and attend with its query.
//   ATTNSERVE_ASSIGN_OR_RETURN(StepOutput out,
//       session.Attend(layer, key, value, query, v1::StepOptions(), timeout));
//   // A model server's decode batch: one call for many sessions' steps.
//   ATTNSERVE_ASSIGN_OR_RETURN(auto outputs, StepMany({{&a, step}, {&b, step}},
//                                                     timeout));
// clang-format on
//
// The server holds the keys and values; the client keeps each layer's length,
// so that every step carries the `expected_length` it must meet. That is what
// makes steps safe to retry:
//
// - Every attempt of a step (Client::Step's retries on UNAVAILABLE and
//   RESOURCE_EXHAUSTED, and a caller's own retry after a failed call) sends
//   the same expected_length E. The server appends only if the layer holds
//   exactly E tokens, so a step is never appended twice.
// - A retried step whose first attempt landed (its answer lost) comes back
//   FAILED_PRECONDITION. When the step may have landed before (the call was
//   sent more than once, or an earlier call that appended to that layer
//   failed without an answer), the library asks the server for the session's
//   lengths (GetSession) rather than reading the message: if the layer holds
//   E + T (T the step's tokens) and the step was sent more than once, or the
//   lost call sent the very same key and value, the step had landed, and the
//   library records the new length and, if the step had a query, re-sends the
//   query alone with expected_length E + T. The server attends over the same E
//   + T tokens with the same bottom-right alignment, so the output and lse are
//   those the lost answer held; StepOutput::recovered says it happened. If the
//   layer holds E, the refusal had another cause and is returned as is. If the
//   lost call's own steps end where the layer ends (a step of other keys and
//   values, or this one a query alone), they landed, not this one:
//   FAILED_PRECONDITION saying so, and the server's length is recorded (send
//   the step again if it follows them); until 2026-12-07 another step of the
//   same T was taken for the lost one, its query answered over the lost
//   step's keys as recovered. Any other length means someone else changed the
//   session: FAILED_PRECONDITION naming both lengths, and nothing is recorded
//   (Sync() accepts the server's lengths).
// - Several steps of one layer in one StepMany call run in order (each
//   expects the previous one's end); after a lost answer they landed as a
//   prefix, found the same way. Only the last landed step's output can be
//   recomputed (the cache has moved past the others): an earlier one with a
//   query gets DATA_LOSS, its tokens kept.
// - After a call fails without an answer (DEADLINE_EXCEEDED, UNAVAILABLE past
//   the retries, ...), retry the same step with the same tensors: the rule
//   above finds out whether it had landed. To give up on it instead, call
//   Sync() before the next step, which takes the server's lengths as they are.
//
// After a lost call, send the same steps again or Sync() first: a call
// that changes them can be half taken. A lost [S1] that landed, then
// [S1', S2] of other keys for S1': S1' is refused (the lost S1 explains the
// layer), but S2 expects S1's end and is appended after S1's keys.
//
// This assumes one writer per session: the recovery cannot tell this
// client's lost step from another writer's step of the same size. Not
// thread-safe; a Session may move between threads. Destroying a Session does
// not delete the server's session (it expires after its TTL): call Delete().
#ifndef ATTNSERVE_CLIENT_SESSION_H_
#define ATTNSERVE_CLIENT_SESSION_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attnserve/client/client.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// What one step of one session does: append `key` and `value` to `layer`
// (both or neither), then, with a query, attend over the whole cache.
struct StepInputs {
  int64_t layer = 0;
  std::optional<v1::Tensor> key;    // [Hkv, T, Dk], T >= 1
  std::optional<v1::Tensor> value;  // [Hkv, T, Dv]
  // [H, Tq, Dk]; absent: append only (a prefill chunk). Row i sees the
  // cache's keys j <= i + L - Tq, L the length after the append.
  std::optional<v1::Tensor> query;
  v1::StepOptions options;
};

// What a step gave back.
struct StepOutput {
  std::optional<v1::Tensor> output;  // [H, Tq, Dv], when the step had a query
  std::optional<v1::Tensor> lse;     // [H, Tq] FLOAT32, with return_lse
  int64_t length = 0;                // the layer's tokens after the step
  // The step had landed on an earlier attempt whose answer was lost; its
  // output (if any) was recomputed by a query-only step.
  bool recovered = false;
};

class Session;
class Replicas;

// Restores a rebuilt session's tokens: `session` is new (on another replica,
// every layer empty) and must hold `lengths[l]` tokens of layer l when the
// hook returns OK, the same tokens the lost session held (the caller's own
// prefill, through session.Append). Its calls may take at most `timeout`.
// `session` is not the Session being rebuilt, which becomes it only after the
// hook: a hook steps its argument, not a Session it captured.
using RebuildHook = std::function<absl::Status(
    Session& session, const std::vector<int64_t>& lengths,
    absl::Duration timeout)>;

// The inputs of a step that appends `key` and `value` to `layer`, and, with a
// query, attends with it under `options`.
StepInputs AppendInputs(int64_t layer, v1::Tensor key, v1::Tensor value);
StepInputs AttendInputs(int64_t layer, v1::Tensor key, v1::Tensor value,
                        v1::Tensor query, const v1::StepOptions& options);

// One step in a batched call: `session`'s step `inputs`.
struct SessionStepInputs {
  Session* session = nullptr;
  StepInputs inputs;
};

// Per step, in order: its output, or its own error (the others stand).
using StepManyResults = std::vector<absl::StatusOr<StepOutput>>;

class Session {
 public:
  // Creates a session on the server (Client::CreateSession: retried only with
  // RetryPolicy::retry_session_creation). `client` must outlive the Session.
  static absl::StatusOr<Session> Create(Client* client,
                                        const v1::CreateSessionRequest& request,
                                        absl::Duration timeout);

  // Takes over an existing session by id (GetSession), its lengths as the
  // server has them: for a process that did not create it, such as attnctl.
  static absl::StatusOr<Session> Attach(Client* client,
                                        absl::string_view session_id,
                                        absl::Duration timeout);

  // Sets up a Session for `info` without a call (as Create would after the
  // call); for callers that made the call themselves, and for tests.
  static Session FromInfo(Client* client, const v1::SessionInfo& info);

  Session(Session&&) = default;
  Session& operator=(Session&&) = default;
  // One server session, one tracker of its lengths: no copies.
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& id() const { return info_.session_id(); }
  // The replica that holds it, as the server said (empty if it did not).
  const v1::ReplicaIdentity& replica() const { return replica_; }
  // The address it is pinned to, when Replicas placed it; empty otherwise.
  const std::string& address() const { return address_; }
  // What the server said of the session at the last call that returned it
  // (Create, Attach, Fork, Truncate, Sync); its lengths may be behind.
  const v1::SessionInfo& info() const { return info_; }
  int64_t num_layers() const { return static_cast<int64_t>(lengths_.size()); }
  // The tokens `layer` (0 to num_layers() − 1; std::out_of_range otherwise)
  // holds as far as this client knows: the expected_length of its next step.
  int64_t length(int64_t layer) const { return lengths_.at(layer); }
  const std::vector<int64_t>& lengths() const { return lengths_; }
  // Whether a call appending to `layer` failed without an answer since its
  // length was last known (see the header comment).
  bool uncertain(int64_t layer) const { return !unanswered_.at(layer).empty(); }
  bool deleted() const { return deleted_; }

  // One step; its StepResult's error as the status if it failed.
  absl::StatusOr<StepOutput> Step(StepInputs inputs, absl::Duration timeout);
  // Appends `key` [Hkv, T, Dk] and `value` [Hkv, T, Dv] to `layer`.
  absl::Status Append(int64_t layer, v1::Tensor key, v1::Tensor value,
                      absl::Duration timeout);
  // Appends, then attends with `query` [H, Tq, Dk].
  absl::StatusOr<StepOutput> Attend(int64_t layer, v1::Tensor key,
                                    v1::Tensor value, v1::Tensor query,
                                    const v1::StepOptions& options,
                                    absl::Duration timeout);

  // A new session sharing this one's first `length` tokens of every layer
  // (all of them when absent), with `ttl_seconds` (0: this one's). Retried
  // only with RetryPolicy::retry_session_creation.
  absl::StatusOr<Session> Fork(std::optional<int64_t> length,
                               absl::Duration timeout,
                               int64_t ttl_seconds = 0) const;
  // Every layer keeps its first `length` tokens.
  absl::Status Truncate(int64_t length, absl::Duration timeout);
  // Deletes the server's session. NOT_FOUND counts as done after an attempt
  // whose answer was lost (a retry of this call, or an earlier Delete that
  // failed), and so does a pinned session's replica that restarted (its
  // sessions went with the process); a Session once deleted refuses steps
  // with FAILED_PRECONDITION.
  absl::Status Delete(absl::Duration timeout);
  // Takes the server's lengths as they are (GetSession), clearing every
  // layer's uncertainty.
  absl::Status Sync(absl::Duration timeout);

  // For a session Replicas placed: when its replica is gone, Step (and
  // Append, Attend) rebuild it on the next replica with `hook` and send the
  // step again, once per call. Without a hook, such calls fail ABORTED
  // (IsReplicaGone) and Rebuild() is the caller's to call.
  void SetRebuild(RebuildHook hook) { rebuild_ = std::move(hook); }
  // Creates the session anew (same shape and options, a new id) on the next
  // replica in rendezvous order, other than its own (its own if no other
  // takes it: one that restarted is there, empty), and runs the rebuild
  // hook, if any, on it (a Session of its own, not this one) to restore the
  // lengths this client knew; this Session becomes it once it holds them.
  // If the hook fails or leaves other lengths (FAILED_PRECONDITION), the new
  // session is deleted and this one stays the lost one, to rebuild again.
  // Without a hook the layers stay empty. FAILED_PRECONDITION for a session
  // Replicas did not place. A lost session on a replica that was only
  // unreachable keeps its pages there until its TTL.
  absl::Status Rebuild(absl::Duration timeout);

  // The SessionStep this session would send for `inputs` with
  // `expected_length`; no call. Exposed for StepMany and for tests.
  v1::SessionStep BuildStep(const StepInputs& inputs,
                            int64_t expected_length) const;

 private:
  friend absl::StatusOr<StepManyResults> StepMany(
      std::vector<SessionStepInputs> steps, absl::Duration timeout);

  friend class Replicas;

  Session(Client* client, const v1::SessionInfo& info);
  // A Session for `info` as a server answered it, or INTERNAL naming what in
  // it no session can have (a num_layers of 2^40 would abort the client), or
  // an id other than `expected_id` (when not empty).
  static absl::StatusOr<Session> FromServer(Client* client,
                                            const v1::SessionInfo& info,
                                            absl::string_view expected_id);
  // Takes `info` as the server's word: lengths and metadata.
  void Adopt(const v1::SessionInfo& info);
  // `status`, from a call to this session's replica, as the replica-gone
  // error when it says the replica is: `restarted` (the caller's reading of
  // it: a restarted replica's refusal of the incarnation the call carried);
  // a draining replica's UNAVAILABLE; or UNAVAILABLE past the retries and no
  // answer to a GetSession that waits up to a second (at most half of what
  // is left until `deadline`; InfiniteFuture: a second) for the replica to be
  // reached. Only for a pinned session; otherwise (and for other errors, and
  // a replica that answers, which the message then says) `status` as is.
  absl::Status ReplicaGoneOr(
      absl::Status status, bool restarted = false,
      absl::Time deadline = absl::InfiniteFuture()) const;
  // Whether `status`, a ForkSession's or TruncateSession's that carried the
  // incarnation, is a restarted replica's refusal of it. Those answer
  // FAILED_PRECONDITION for evicted tokens too: a GetSession carrying the
  // incarnation, which fails so for nothing else, tells them apart.
  bool RefusedForIncarnation(const absl::Status& status,
                             absl::Time deadline) const;

  Client* client_ = nullptr;
  v1::SessionInfo info_;
  v1::ReplicaIdentity replica_;
  // Set by Replicas: where the session is pinned, and who placed it.
  std::string address_;
  Replicas* replicas_ = nullptr;
  RebuildHook rebuild_;
  bool rebuilding_ = false;  // The hook runs: its calls do not rebuild.
  // A Delete call failed without an answer: it may have deleted the session,
  // so a later one's NOT_FOUND counts as done.
  bool delete_sent_ = false;
  std::vector<int64_t> lengths_;
  // An appending step whose call failed without an answer since its layer's
  // length was last known: any may have landed.
  struct Unanswered {
    int64_t expected;
    int64_t tokens;
    size_t digest;  // Of its key and value (StepDigest in session.cc).
  };
  std::vector<std::vector<Unanswered>> unanswered_;  // Per layer.
  bool deleted_ = false;
};

// Sends the steps of many sessions (all on one Client) in one Step call, in
// order; a session may appear more than once (each of its steps then expects
// the previous one's end). Returns the call's error if it failed as a whole
// (every layer it appended to is then uncertain), else one entry per step.
// Checks locally, before any call (INVALID_ARGUMENT, FAILED_PRECONDITION for
// a deleted Session): every session non-null and on the same Client, layers
// in range, key and value both or neither, rank 3 with one token count
// T >= 1.
absl::StatusOr<StepManyResults> StepMany(std::vector<SessionStepInputs> steps,
                                         absl::Duration timeout);

// The number of tokens `inputs` appends: key.shape[1], 0 without a key.
// INVALID_ARGUMENT when key and value do not come together as [Hkv, T, D]
// with the same T >= 1.
absl::StatusOr<int64_t> AppendedTokens(const StepInputs& inputs);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_SESSION_H_
