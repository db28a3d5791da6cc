#include "attnserve/client/session.h"

#include <algorithm>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <string_view>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnserve/client/replicas.h"
#include "attnserve/common/status_macros.h"
#include "deadline.h"
#include "grpcpp/grpcpp.h"

namespace attnserve {

using internal::Remaining;

namespace {

// A layer of a session, as StepMany groups its steps.
using LayerKey = std::pair<Session*, int64_t>;

absl::Status FromErrorStatus(const v1::ErrorStatus& error) {
  return absl::Status(static_cast<absl::StatusCode>(error.code()),
                      error.message());
}

bool Failed(const v1::StepResult& result) {
  return result.has_error() && result.error().code() != 0;
}

// Fills `step` from `inputs`, moving its tensors (a prefill chunk's keys and
// values may be megabytes).
void FillStep(const std::string& session_id, StepInputs&& inputs,
              int64_t expected_length, v1::SessionStep* step) {
  step->set_session_id(session_id);
  step->set_layer(inputs.layer);
  step->set_expected_length(expected_length);
  if (inputs.key) *step->mutable_key() = std::move(*inputs.key);
  if (inputs.value) *step->mutable_value() = std::move(*inputs.value);
  if (inputs.query) *step->mutable_query() = std::move(*inputs.query);
  *step->mutable_options() = std::move(inputs.options);
}

// The most lost steps a layer remembers (the oldest are forgotten).
constexpr size_t kMostUnanswered = 16;

// How long a pinned session's replica that stopped answering is waited for
// before it is told gone: more than gRPC's reconnect backoff (at most 500 ms,
// client.cc).
constexpr absl::Duration kGoneProbe = absl::Seconds(1);

// What `step` appends, as a hash of its key's and value's dtypes, shapes and
// bytes: a step sent again is told from another of as many tokens.
size_t StepDigest(const v1::SessionStep& step) {
  size_t digest = 0;
  const auto mix = [&digest](size_t part) { digest = digest * 1000003 ^ part; };
  for (const v1::Tensor* tensor : {&step.key(), &step.value()}) {
    mix(static_cast<size_t>(tensor->dtype()));
    for (const int64_t dim : tensor->shape()) mix(static_cast<size_t>(dim));
    mix(std::hash<std::string_view>()(tensor->data()));
  }
  return digest;
}

StepOutput OutputOf(v1::StepResult&& result) {
  StepOutput output;
  if (result.has_output()) output.output = std::move(*result.mutable_output());
  if (result.has_lse()) output.lse = std::move(*result.mutable_lse());
  output.length = result.length();
  return output;
}

// A session as a server described it, checked before the client sizes
// anything by it: a broken server's num_layers of 2^40 or negative heads
// would otherwise abort the client.
absl::Status CheckServerInfo(const v1::SessionInfo& info) {
  constexpr int64_t kMost = int64_t{1} << 16;
  const int64_t dims[] = {info.num_layers(), info.num_heads(),
                          info.num_kv_heads(), info.key_dim(),
                          info.value_dim()};
  const bool sized =
      std::all_of(std::begin(dims), std::end(dims),
                  [](int64_t d) { return d >= 1 && d <= kMost; });
  if (!sized ||
      (info.lengths_size() != 0 && info.lengths_size() != info.num_layers())) {
    return absl::InternalError(absl::StrCat(
        "the server described session ", info.session_id(), " with num_layers ",
        info.num_layers(), ", ", info.lengths_size(), " lengths, heads ",
        info.num_heads(), "/", info.num_kv_heads(), " and dims ",
        info.key_dim(), "/", info.value_dim(),
        ", expected each 1 to 65536 and a length per layer"));
  }
  return absl::OkStatus();
}

// A server's answer about session `id` that describes another one.
absl::Status CheckSameSession(const v1::SessionInfo& info,
                              absl::string_view id) {
  if (info.session_id() == id) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat("the server answered a call on session ", id,
                   " with session ", info.session_id()));
}

}  // namespace

absl::StatusOr<int64_t> AppendedTokens(const StepInputs& inputs) {
  if (!inputs.key && !inputs.value) return 0;
  if (!inputs.key || !inputs.value) {
    return absl::InvalidArgumentError(
        "a step's key and value come together: both or neither");
  }
  const v1::Tensor& key = *inputs.key;
  const v1::Tensor& value = *inputs.value;
  if (key.shape_size() != 3 || value.shape_size() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("a step's key and value are [Hkv, T, D]; got ranks ",
                     key.shape_size(), " and ", value.shape_size()));
  }
  if (key.shape(1) < 1 || key.shape(1) != value.shape(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a step's key and value hold the same T >= 1 tokens; got ",
                     key.shape(1), " and ", value.shape(1)));
  }
  return key.shape(1);
}

Session::Session(Client* client, const v1::SessionInfo& info)
    : client_(client) {
  Adopt(info);
}

void Session::Adopt(const v1::SessionInfo& info) {
  info_ = info;
  lengths_.assign(info.lengths().begin(), info.lengths().end());
  // A server that left lengths out of a new session's info holds none.
  if (lengths_.empty() && info.num_layers() > 0) {
    lengths_.assign(static_cast<size_t>(info.num_layers()), 0);
  }
  unanswered_.assign(lengths_.size(), {});
}

Session Session::FromInfo(Client* client, const v1::SessionInfo& info) {
  return Session(client, info);
}

absl::StatusOr<Session> Session::FromServer(Client* client,
                                            const v1::SessionInfo& info,
                                            absl::string_view expected_id) {
  ATTNSERVE_RETURN_IF_ERROR(CheckServerInfo(info));
  if (!expected_id.empty()) {
    ATTNSERVE_RETURN_IF_ERROR(CheckSameSession(info, expected_id));
  }
  return Session(client, info);
}

absl::StatusOr<Session> Session::Create(Client* client,
                                        const v1::CreateSessionRequest& request,
                                        absl::Duration timeout) {
  if (client == nullptr) return absl::InvalidArgumentError("client is null");
  ATTNSERVE_ASSIGN_OR_RETURN(v1::CreateSessionResponse response,
                             client->CreateSession(request, timeout));
  ATTNSERVE_ASSIGN_OR_RETURN(
      Session session,
      FromServer(client, response.session(), request.session_id()));
  session.replica_ = response.replica();
  return session;
}

absl::StatusOr<Session> Session::Attach(Client* client,
                                        absl::string_view session_id,
                                        absl::Duration timeout) {
  if (client == nullptr) return absl::InvalidArgumentError("client is null");
  ATTNSERVE_ASSIGN_OR_RETURN(v1::GetSessionResponse response,
                             client->GetSession(session_id, timeout));
  ATTNSERVE_ASSIGN_OR_RETURN(
      Session session, FromServer(client, response.session(), session_id));
  session.replica_ = response.replica();
  return session;
}

v1::SessionStep Session::BuildStep(const StepInputs& inputs,
                                   int64_t expected_length) const {
  v1::SessionStep step;
  FillStep(id(), StepInputs(inputs), expected_length, &step);
  return step;
}

absl::StatusOr<StepOutput> Session::Step(StepInputs inputs,
                                         absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  const bool may_rebuild = rebuild_ != nullptr && !rebuilding_;
  // The step again after a rebuild: its tensors, kept only when that may
  // happen (a prefill chunk may be megabytes).
  std::optional<StepInputs> again;
  if (may_rebuild) again = inputs;
  std::vector<SessionStepInputs> steps;
  steps.push_back({this, std::move(inputs)});
  absl::StatusOr<StepManyResults> results = StepMany(std::move(steps), timeout);
  if (results.ok()) return std::move((*results)[0]);
  if (!may_rebuild || !IsReplicaGone(results.status())) {
    return results.status();
  }
  if (absl::Status rebuilt = Rebuild(Remaining(deadline)); !rebuilt.ok()) {
    // Still the replica-gone error (IsReplicaGone), the rebuild's own
    // failure told: the caller may rebuild again.
    absl::Status gone(
        results.status().code(),
        absl::StrCat(results.status().message(),
                     "; rebuilding it failed: ", rebuilt.message()));
    results.status().ForEachPayload(
        [&gone](absl::string_view url, const absl::Cord& payload) {
          gone.SetPayload(url, payload);
        });
    return gone;
  }
  steps.clear();
  steps.push_back({this, *std::move(again)});
  ATTNSERVE_ASSIGN_OR_RETURN(StepManyResults retried,
                             StepMany(std::move(steps), Remaining(deadline)));
  return std::move(retried[0]);
}

absl::Status Session::ReplicaGoneOr(absl::Status status, bool restarted,
                                    absl::Time deadline) const {
  if (status.ok() || replicas_ == nullptr) return status;
  bool unreachable = absl::IsUnavailable(status);
  if (!unreachable && !restarted) return status;
  // A draining replica's own refusal (of a new session or fork; of any call
  // once its grace is over) says it goes, sessions and all: no probe.
  const bool draining = absl::StrContains(status.message(), "is draining") ||
                        absl::StrContains(status.message(), "shutting down");
  if (unreachable && !restarted && !draining) {
    // The retries span a fraction of a second, less than gRPC's reconnect
    // backoff: until 2026-12-07 a blip of 0.6 s told a live session gone (an
    // audit of the Python client, which did the same). A GetSession that
    // waits for the replica to be reached, up to kGoneProbe and at most half
    // of what is left (a rebuild needs the rest), tells a blip from a death.
    const absl::Duration wait = std::min(
        kGoneProbe, (deadline == absl::InfiniteFuture() ? kGoneProbe * 2
                                                        : Remaining(deadline)) /
                        2);
    if (wait <= absl::ZeroDuration()) return status;  // No time to tell.
    std::unique_ptr<grpc::ClientContext> context =
        client_->NewContext(absl::Now() + wait);
    context->set_wait_for_ready(true);
    v1::GetSessionRequest request;
    request.set_session_id(id());
    request.set_replica_incarnation(replica_.incarnation());
    v1::GetSessionResponse response;
    const grpc::Status probed =
        v1::AttentionService::NewStub(client_->channel())
            ->GetSession(context.get(), request, &response);
    if (probed.ok()) {
      return absl::Status(
          status.code(),
          absl::StrCat(status.message(), " (the replica at ", address_,
                       " answered again at once and holds session ", id(),
                       ": send the call again)"));
    }
    // GetSession fails FAILED_PRECONDITION only for the incarnation.
    restarted = probed.error_code() == grpc::StatusCode::FAILED_PRECONDITION;
    unreachable = !restarted;
    if (probed.error_code() != grpc::StatusCode::UNAVAILABLE &&
        probed.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED &&
        !restarted) {
      return status;  // It answered: the replica is there.
    }
  }
  absl::Status gone = absl::AbortedError(absl::StrCat(
      "session ", id(), "'s replica ", replica_.name(), " (incarnation ",
      replica_.incarnation(), ") at ", address_, " is gone, and the session ",
      "with it: ",
      unreachable ? "it is unreachable or draining" : "it restarted", " (",
      status.message(), ")", kRebuildAdvice));
  gone.SetPayload(kReplicaGonePayload, absl::Cord(address_));
  return gone;
}

bool Session::RefusedForIncarnation(const absl::Status& status,
                                    absl::Time deadline) const {
  if (!absl::IsFailedPrecondition(status) || replica_.incarnation().empty() ||
      replicas_ == nullptr) {
    return false;
  }
  v1::GetSessionRequest request;
  request.set_session_id(id());
  request.set_replica_incarnation(replica_.incarnation());
  return absl::IsFailedPrecondition(
      client_->GetSession(request, Remaining(deadline)).status());
}

absl::Status Session::Rebuild(absl::Duration timeout) {
  if (replicas_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", id(),
        " was not placed by Replicas, which alone can rebuild a session on "
        "another replica"));
  }
  const absl::Time deadline = absl::Now() + timeout;
  const std::vector<int64_t> lengths = lengths_;
  v1::CreateSessionRequest request;
  request.set_num_layers(info_.num_layers());
  request.set_num_heads(info_.num_heads());
  request.set_num_kv_heads(info_.num_kv_heads());
  request.set_key_dim(info_.key_dim());
  request.set_value_dim(info_.value_dim());
  request.set_dtype(info_.dtype());
  request.set_max_tokens(info_.max_tokens());
  request.set_ttl_seconds(info_.ttl_seconds());
  *request.mutable_defaults() = info_.defaults();
  absl::StatusOr<Session> created =
      replicas_->CreateSession(request, Remaining(deadline), {address_});
  if (absl::IsUnavailable(created.status()) &&
      Remaining(deadline) > absl::ZeroDuration()) {
    // No other replica took it: its own, which may have restarted (another
    // incarnation at the address, there and empty). Until 2026-12-07 it was
    // never asked, and a single replica's sessions could not be rebuilt.
    std::set<std::string> others;
    for (const std::string& address : replicas_->addresses()) {
      if (address != address_) others.insert(address);
    }
    absl::StatusOr<Session> own =
        replicas_->CreateSession(request, Remaining(deadline), others);
    if (own.ok()) created = std::move(own);
  }
  ATTNSERVE_ASSIGN_OR_RETURN(Session fresh, std::move(created));
  if (rebuild_ != nullptr) {
    // The hook restores the new session as a Session of its own: this one
    // becomes it only once every layer holds what the lost one held, so that
    // a failed restore leaves no step on a session missing tokens (it would
    // attend over them without a word).
    // (A hook that steps this Session, not its argument, must not rebuild
    // again; `fresh` has no hook.)
    rebuilding_ = true;
    absl::Status restored = rebuild_(fresh, lengths, Remaining(deadline));
    rebuilding_ = false;
    if (!restored.ok()) {
      restored = absl::Status(
          restored.code(),
          absl::StrCat("the rebuild hook failed on session ", fresh.id(),
                       " at ", fresh.address(), ": ", restored.message()));
    }
    for (size_t layer = 0; restored.ok() && layer < lengths.size(); ++layer) {
      if (fresh.lengths_[layer] != lengths[layer]) {
        restored = absl::FailedPreconditionError(
            absl::StrCat("the rebuild hook left layer ", layer, " of session ",
                         fresh.id(), " at ", fresh.lengths_[layer],
                         " tokens; the lost session held ", lengths[layer]));
      }
    }
    if (!restored.ok()) {
      // Its pages go now, not at its TTL, within what is left of the call's
      // deadline (at most a second): a second of its own ran the call past
      // its timeout when the hook failed on it, an audit found. This Session
      // stays the lost one, whose next call fails as gone again (and
      // rebuilds again).
      // (With nothing left it is not sent: gRPC may still answer a call
      // whose deadline has just passed.)
      const absl::Duration left =
          std::min(Remaining(deadline), absl::Seconds(1));
      std::string deleted = "no time was left to delete it: it goes at its TTL";
      if (left > absl::ZeroDuration()) {
        const absl::Status deletion = fresh.Delete(left);
        deleted = deletion.ok()
                      ? "deleted it"
                      : absl::StrCat("deleting it failed (", deletion.message(),
                                     "): it goes at its TTL");
      }
      return absl::Status(
          restored.code(),
          absl::StrCat(restored.message(), " (", deleted,
                       "; this session is still the lost one, to rebuild "
                       "again)"));
    }
  }
  RebuildHook hook = std::move(rebuild_);
  *this = std::move(fresh);
  rebuild_ = std::move(hook);
  return absl::OkStatus();
}

StepInputs AppendInputs(int64_t layer, v1::Tensor key, v1::Tensor value) {
  StepInputs inputs;
  inputs.layer = layer;
  inputs.key = std::move(key);
  inputs.value = std::move(value);
  return inputs;
}

StepInputs AttendInputs(int64_t layer, v1::Tensor key, v1::Tensor value,
                        v1::Tensor query, const v1::StepOptions& options) {
  StepInputs inputs = AppendInputs(layer, std::move(key), std::move(value));
  inputs.query = std::move(query);
  inputs.options = options;
  return inputs;
}

absl::Status Session::Append(int64_t layer, v1::Tensor key, v1::Tensor value,
                             absl::Duration timeout) {
  return Step(AppendInputs(layer, std::move(key), std::move(value)), timeout)
      .status();
}

absl::StatusOr<StepOutput> Session::Attend(int64_t layer, v1::Tensor key,
                                           v1::Tensor value, v1::Tensor query,
                                           const v1::StepOptions& options,
                                           absl::Duration timeout) {
  return Step(AttendInputs(layer, std::move(key), std::move(value),
                           std::move(query), options),
              timeout);
}

absl::StatusOr<Session> Session::Fork(std::optional<int64_t> length,
                                      absl::Duration timeout,
                                      int64_t ttl_seconds) const {
  const absl::Time deadline = absl::Now() + timeout;
  v1::ForkSessionRequest request;
  request.set_session_id(id());
  if (length) request.set_length(*length);
  request.set_ttl_seconds(ttl_seconds);
  request.set_replica_incarnation(replica_.incarnation());
  absl::StatusOr<v1::ForkSessionResponse> response =
      client_->ForkSession(request, timeout);
  if (!response.ok()) {
    return ReplicaGoneOr(response.status(),
                         RefusedForIncarnation(response.status(), deadline),
                         deadline);
  }
  ATTNSERVE_ASSIGN_OR_RETURN(Session child,
                             FromServer(client_, response->session(), ""));
  child.replica_ = response->replica();
  child.address_ = address_;
  child.replicas_ = replicas_;
  return child;
}

absl::Status Session::Truncate(int64_t length, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  v1::TruncateSessionRequest request;
  request.set_session_id(id());
  request.set_length(length);
  request.set_replica_incarnation(replica_.incarnation());
  absl::StatusOr<v1::TruncateSessionResponse> response =
      client_->TruncateSession(request, timeout);
  if (!response.ok()) {
    return ReplicaGoneOr(response.status(),
                         RefusedForIncarnation(response.status(), deadline),
                         deadline);
  }
  ATTNSERVE_RETURN_IF_ERROR(CheckServerInfo(response->session()));
  ATTNSERVE_RETURN_IF_ERROR(CheckSameSession(response->session(), id()));
  Adopt(response->session());
  return absl::OkStatus();
}

absl::Status Session::Delete(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  int attempts = 0;
  v1::DeleteSessionRequest request;
  request.set_session_id(id());
  request.set_replica_incarnation(replica_.incarnation());
  absl::StatusOr<v1::DeleteSessionResponse> response =
      client_->DeleteSession(request, timeout, &attempts);
  // NOT_FOUND counts as done after an attempt, of this call or an earlier
  // one, that may have deleted the session without its answer arriving.
  const bool maybe_deleted = attempts > 1 || delete_sent_;
  // DeleteSession fails FAILED_PRECONDITION only for the incarnation: the
  // replica restarted, and the session went with the process that held it.
  const bool restarted =
      replicas_ != nullptr && absl::IsFailedPrecondition(response.status());
  if (!response.ok() && !restarted &&
      !(maybe_deleted && absl::IsNotFound(response.status()))) {
    // Only a failure without the server's answer may hide a deletion.
    const absl::StatusCode code = response.status().code();
    delete_sent_ = delete_sent_ ||
                   code == absl::StatusCode::kDeadlineExceeded ||
                   code == absl::StatusCode::kUnavailable ||
                   code == absl::StatusCode::kCancelled ||
                   code == absl::StatusCode::kUnknown ||
                   code == absl::StatusCode::kInternal;
    return ReplicaGoneOr(response.status(), false, deadline);
  }
  deleted_ = true;
  return absl::OkStatus();
}

absl::Status Session::Sync(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  v1::GetSessionRequest request;
  request.set_session_id(id());
  request.set_replica_incarnation(replica_.incarnation());
  absl::StatusOr<v1::GetSessionResponse> response =
      client_->GetSession(request, timeout);
  // GetSession fails FAILED_PRECONDITION only for the incarnation.
  if (!response.ok()) {
    return ReplicaGoneOr(response.status(),
                         absl::IsFailedPrecondition(response.status()),
                         deadline);
  }
  ATTNSERVE_RETURN_IF_ERROR(CheckServerInfo(response->session()));
  ATTNSERVE_RETURN_IF_ERROR(CheckSameSession(response->session(), id()));
  Adopt(response->session());
  return absl::OkStatus();
}

absl::StatusOr<StepManyResults> StepMany(std::vector<SessionStepInputs> steps,
                                         absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  if (steps.empty()) {
    return absl::InvalidArgumentError("StepMany needs at least one step");
  }
  const size_t n = steps.size();
  Client* const client =
      steps[0].session == nullptr ? nullptr : steps[0].session->client_;
  std::vector<int64_t> tokens(n);
  for (size_t i = 0; i < n; ++i) {
    const Session* session = steps[i].session;
    if (session == nullptr || session->client_ == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", i, " has no session"));
    }
    if (session->client_ != client) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", i, "'s session is on another Client than step 0's"));
    }
    if (session->deleted_) {
      return absl::FailedPreconditionError(
          absl::StrCat("session ", session->id(), " was deleted"));
    }
    const int64_t layer = steps[i].inputs.layer;
    if (layer < 0 || layer >= session->num_layers()) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", i, "'s layer is ", layer, ", expected 0 to ",
                       session->num_layers() - 1));
    }
    absl::StatusOr<int64_t> appended = AppendedTokens(steps[i].inputs);
    if (!appended.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", i, ": ", appended.status().message()));
    }
    tokens[i] = *appended;
  }

  // Each step expects its layer's length plus what earlier steps of the same
  // layer in this call append.
  std::vector<int64_t> expected(n);
  std::map<LayerKey, std::vector<size_t>> groups;
  std::map<LayerKey, int64_t> running;
  v1::StepRequest request;
  for (size_t i = 0; i < n; ++i) {
    Session* session = steps[i].session;
    const LayerKey key{session, steps[i].inputs.layer};
    auto [it, inserted] =
        running.try_emplace(key, session->lengths_[key.second]);
    expected[i] = it->second;
    it->second += tokens[i];
    groups[key].push_back(i);
    FillStep(session->id(), std::move(steps[i].inputs), expected[i],
             request.add_steps());
  }

  // The replica the sessions were created on, when they all agree, so that
  // a restarted one says so instead of NOT_FOUND.
  const std::string& incarnation = steps[0].session->replica_.incarnation();
  if (!incarnation.empty() &&
      std::all_of(steps.begin(), steps.end(), [&](const auto& step) {
        return step.session->replica_.incarnation() == incarnation;
      })) {
    request.set_replica_incarnation(incarnation);
  }
  int attempts = 0;
  absl::StatusOr<v1::StepResponse> response =
      client->Step(request, Remaining(deadline), &attempts);
  if (response.ok() && response->results_size() != static_cast<int>(n)) {
    response = absl::InternalError(absl::StrCat("the server answered ",
                                                response->results_size(),
                                                " results for ", n, " steps"));
  }
  // What each appending step appends, to tell it from another later.
  std::vector<size_t> digests(n, 0);
  for (size_t i = 0; i < n; ++i) {
    if (tokens[i] > 0)
      digests[i] = StepDigest(request.steps(static_cast<int>(i)));
  }
  if (!response.ok()) {
    // The steps that append may or may not have landed: the next step on
    // these layers finds out (see session.h).
    std::map<LayerKey, size_t> added;
    for (size_t i = 0; i < n; ++i) {
      if (tokens[i] == 0) continue;
      const LayerKey key{steps[i].session, steps[i].inputs.layer};
      key.first->unanswered_[key.second].push_back(
          {expected[i], tokens[i], digests[i]});
      ++added[key];
    }
    // Earlier calls' oldest go past kMostUnanswered; this call's steps all
    // stay (a chunked prefill's, sent again, recovers whole).
    for (const auto& [key, count] : added) {
      std::vector<Session::Unanswered>& lost =
          key.first->unanswered_[key.second];
      const size_t keep = std::max(kMostUnanswered, count);
      if (lost.size() > keep) {
        lost.erase(lost.begin(), lost.end() - static_cast<ptrdiff_t>(keep));
      }
    }
    // A Step call carrying an incarnation fails FAILED_PRECONDITION as a
    // whole only for that incarnation (a step's own refusals are in its
    // result).
    return steps[0].session->ReplicaGoneOr(
        response.status(),
        !request.replica_incarnation().empty() &&
            absl::IsFailedPrecondition(response.status()),
        deadline);
  }

  StepManyResults results(n, absl::UnknownError("unset"));
  // Steps that landed on an earlier attempt and whose output is to be
  // recomputed by a query-only step at this length.
  std::vector<std::pair<size_t, int64_t>> recompute;
  // GetSession's answer per session, asked at most once.
  std::map<Session*, absl::StatusOr<v1::SessionInfo>> fetched;

  for (const auto& [key, indices] : groups) {
    Session* session = key.first;
    const int64_t layer = key.second;
    const int64_t start = expected[indices[0]];
    const std::vector<Session::Unanswered>& lost = session->unanswered_[layer];
    const bool may_have_landed = attempts > 1 || !lost.empty();
    const auto end_of = [&](size_t i) { return expected[i] + tokens[i]; };

    // The leading steps refused for their expected length, when an earlier
    // attempt may have appended them.
    size_t refused = 0;
    if (may_have_landed) {
      while (refused < indices.size()) {
        const v1::StepResult& result = response->results(indices[refused]);
        if (!Failed(result) ||
            result.error().code() !=
                static_cast<int>(absl::StatusCode::kFailedPrecondition)) {
          break;
        }
        ++refused;
      }
    }

    // How far the earlier attempt got: the expected length of the first step
    // that was taken after the refused ones, else the server's length now.
    std::optional<int64_t> landed_end;
    absl::Status lookup_error;
    if (refused > 0) {
      if (refused < indices.size() &&
          !Failed(response->results(indices[refused]))) {
        landed_end = expected[indices[refused]];
      } else {
        auto [it, inserted] = fetched.try_emplace(session, v1::SessionInfo());
        if (inserted) {
          v1::GetSessionRequest get;
          get.set_session_id(session->id());
          get.set_replica_incarnation(session->replica_.incarnation());
          absl::StatusOr<v1::GetSessionResponse> info =
              client->GetSession(get, Remaining(deadline));
          if (info.ok()) {
            it->second = info->session();
          } else {
            // GetSession fails FAILED_PRECONDITION only for the incarnation.
            it->second = session->ReplicaGoneOr(
                info.status(), absl::IsFailedPrecondition(info.status()),
                deadline);
          }
        }
        if (!it->second.ok()) {
          lookup_error = it->second.status();
        } else if (layer < it->second->lengths_size()) {
          landed_end = it->second->lengths(static_cast<int>(layer));
        }
      }
    }
    // The last refused step whose end is where the earlier attempt got.
    std::optional<size_t> last_landed;
    if (landed_end && *landed_end != start) {
      for (size_t j = 0; j < refused; ++j) {
        if (end_of(indices[j]) == *landed_end) last_landed = j;
      }
    }

    // Who landed what the layer holds past `start`: these refused steps
    // (sent more than once, or identical to a lost call's), a lost call's
    // other steps, or either, which cannot be told.
    enum class Landed { kNone, kThese, kLost, kEither };
    Landed landed = Landed::kNone;
    if (landed_end && *landed_end != start) {
      const auto same_as_lost = [&](size_t i) {
        return std::any_of(lost.begin(), lost.end(), [&](const auto& e) {
          return e.expected == expected[i] && e.tokens == tokens[i] &&
                 e.digest == digests[i];
        });
      };
      // Query-only steps among them appended nothing either way.
      const bool these =
          last_landed.has_value() &&
          std::all_of(indices.begin(), indices.begin() + *last_landed + 1,
                      [&](size_t i) {
                        return tokens[i] == 0 || attempts > 1 ||
                               same_as_lost(i);
                      });
      // A lost step in the span these would have filled, unlike them.
      const bool other_lost =
          std::any_of(lost.begin(), lost.end(), [&](const auto& e) {
            return e.expected >= start && e.expected < *landed_end &&
                   std::none_of(indices.begin(), indices.begin() + refused,
                                [&](size_t i) {
                                  return e.expected == expected[i] &&
                                         e.tokens == tokens[i] &&
                                         e.digest == digests[i];
                                });
          });
      const bool lost_ends_there = std::any_of(
          lost.begin(), lost.end(),
          [&](const auto& e) { return e.expected + e.tokens == *landed_end; });
      landed = these ? (other_lost ? Landed::kEither : Landed::kThese)
               : lost_ends_there ? Landed::kLost
                                 : Landed::kNone;
    }

    int64_t final_length = session->lengths_[layer];
    // Whether this layer's length is now known from the server's word (a
    // server still at `start` had not taken the earlier attempt).
    bool known = landed_end.has_value() && *landed_end == start;
    if (landed == Landed::kLost || landed == Landed::kEither) {
      final_length = *landed_end;
      known = true;
    }
    const size_t first_recompute = recompute.size();
    for (size_t j = 0; j < indices.size(); ++j) {
      const size_t i = indices[j];
      v1::StepResult& result = *response->mutable_results(static_cast<int>(i));
      if (!Failed(result)) {
        final_length = result.length();
        known = true;
        results[i] = OutputOf(std::move(result));
        continue;
      }
      absl::Status error = FromErrorStatus(result.error());
      if (j < refused && landed == Landed::kThese && j <= *last_landed) {
        StepOutput output;
        output.length = end_of(i);
        output.recovered = true;
        results[i] = std::move(output);
        final_length = end_of(i);
        known = true;
        if (request.steps(static_cast<int>(i)).has_query()) {
          recompute.emplace_back(i, end_of(i));
        }
        continue;
      }
      if (j < refused && !lookup_error.ok()) {
        error = absl::Status(error.code(),
                             absl::StrCat(error.message(),
                                          " (and asking the server for the "
                                          "session's lengths failed: ",
                                          lookup_error.ToString(), ")"));
      } else if (absl::IsNotFound(error) &&
                 !session->replica_.incarnation().empty() &&
                 !response->replica().incarnation().empty() &&
                 response->replica().incarnation() !=
                     session->replica_.incarnation()) {
        // A call of sessions from several incarnations carries none: the
        // answering process names its own.
        error = session->ReplicaGoneOr(std::move(error), true);
      } else if (j < refused && landed == Landed::kLost) {
        error = absl::FailedPreconditionError(absl::StrCat(
            "an earlier call's steps on session ", session->id(), " layer ",
            layer,
            ", given up without their answer, had landed: the layer "
            "holds ",
            *landed_end,
            " tokens, and the session now expects that; this step "
            "was not appended (send it again if it follows them)"));
      } else if (j < refused && landed == Landed::kEither) {
        error = absl::FailedPreconditionError(absl::StrCat(
            "session ", session->id(), " layer ", layer, " holds ", *landed_end,
            " tokens: either this call's steps (sent more than once) or an "
            "earlier call's of other keys and values, given up without their "
            "answer, landed, and which cannot be told; the session now "
            "expects ",
            *landed_end, " (Truncate to ", start,
            " and send the ones you want again)"));
      } else if (j < refused && landed_end && *landed_end != start) {
        error = absl::FailedPreconditionError(absl::StrCat(
            "session ", session->id(), " layer ", layer, " holds ", *landed_end,
            " tokens, this client expected ", start,
            ": another writer changed it (Session::Sync takes the server's "
            "lengths); the server said: ",
            error.message()));
      }
      results[i] = std::move(error);
    }
    session->lengths_[layer] = final_length;
    if (known) session->unanswered_[layer].clear();
    // A recomputed output is the lost one only if nothing was appended after
    // its step; otherwise the cache has moved past it.
    for (size_t r = first_recompute; r < recompute.size(); ++r) {
      auto& [i, length] = recompute[r];
      if (length != final_length) {
        results[i] = absl::DataLossError(absl::StrCat(
            "step ", i,
            " had landed on an earlier attempt, but its output "
            "was lost and cannot be recomputed: later tokens followed it "
            "(its tokens are kept)"));
        length = -1;
      }
    }
  }
  recompute.erase(
      std::remove_if(recompute.begin(), recompute.end(),
                     [](const auto& entry) { return entry.second < 0; }),
      recompute.end());
  if (recompute.empty()) return results;

  // The lost answers' outputs: the same queries over the same tokens, with
  // nothing appended, so this call is safe to retry as it stands.
  v1::StepRequest again;
  // The sessions' incarnation, when they agree, as the first call carried it.
  again.set_replica_incarnation(request.replica_incarnation());
  for (const auto& [i, length] : recompute) {
    const v1::SessionStep& original = request.steps(static_cast<int>(i));
    v1::SessionStep* step = again.add_steps();
    step->set_session_id(original.session_id());
    step->set_layer(original.layer());
    step->set_expected_length(length);
    *step->mutable_query() = original.query();
    *step->mutable_options() = original.options();
  }
  absl::StatusOr<v1::StepResponse> answers =
      client->Step(again, Remaining(deadline));
  if (answers.ok() && answers->results_size() != again.steps_size()) {
    answers = absl::InternalError(
        absl::StrCat("the server answered ", answers->results_size(),
                     " results for ", again.steps_size(), " steps"));
  }
  for (size_t r = 0; r < recompute.size(); ++r) {
    const size_t i = recompute[r].first;
    absl::Status error;
    if (!answers.ok()) {
      // Not told as the replica gone, even for another incarnation: a rebuild
      // would send the step again, and its tokens, which landed, twice.
      error = answers.status();
    } else if (Failed(answers->results(static_cast<int>(r)))) {
      error = FromErrorStatus(answers->results(static_cast<int>(r)).error());
    }
    if (!error.ok()) {
      results[i] = absl::Status(
          error.code(),
          absl::StrCat("the step had landed on an earlier attempt (its tokens "
                       "are kept), but recomputing its lost output failed: ",
                       error.message()));
      continue;
    }
    StepOutput output =
        OutputOf(std::move(*answers->mutable_results(static_cast<int>(r))));
    output.recovered = true;
    results[i] = std::move(output);
  }
  return results;
}

}  // namespace attnserve
