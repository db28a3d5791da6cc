#include "attnserve/client/sharded_session.h"

#include <algorithm>
#include <future>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "attnserve/client/tensors.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/proto/tensors.h"
#include "deadline.h"
#include "shard_merge.h"

namespace attnserve {

using internal::Remaining;

ShardedSession::ShardedSession(Replicas* replicas,
                               v1::CreateSessionRequest request,
                               int64_t shard_tokens, Session first)
    : replicas_(replicas),
      request_(std::move(request)),
      shard_tokens_(shard_tokens),
      lengths_(static_cast<size_t>(first.num_layers()), 0) {
  shards_.push_back(std::move(first));
}

absl::StatusOr<ShardedSession> ShardedSession::Create(
    Replicas* replicas, const v1::CreateSessionRequest& request,
    int64_t shard_tokens, absl::Duration timeout) {
  if (replicas == nullptr) {
    return absl::InvalidArgumentError("replicas is null");
  }
  if (!request.session_id().empty()) {
    return absl::InvalidArgumentError(
        "session_id must be empty for a sharded session: each shard draws "
        "its own");
  }
  if (shard_tokens < 1 ||
      (request.max_tokens() > 0 && shard_tokens > request.max_tokens())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard_tokens is ", shard_tokens, ", expected 1 to ",
        request.max_tokens() > 0
            ? absl::StrCat(request.max_tokens(), " (the request's max_tokens)")
            : std::string("the servers' limit")));
  }
  // Each shard's positions start at 0: what depends on a key's position in
  // the whole sequence would be computed at the wrong one.
  const v1::SessionDefaults& d = request.defaults();
  if ((d.has_window_left() && d.window_left() != -1) ||
      d.num_sink_tokens() != 0 || d.alibi_slopes_size() > 0 || d.has_rope()) {
    return absl::InvalidArgumentError(
        "defaults.window_left, num_sink_tokens, alibi_slopes and rope must be "
        "unset for a sharded session: they depend on each key's position in "
        "the whole sequence, and a shard's positions start at 0");
  }
  v1::CreateSessionRequest shard = request;
  shard.set_max_tokens(shard_tokens);
  absl::StatusOr<Session> first = replicas->CreateSession(shard, timeout);
  if (!first.ok()) return first.status();
  return ShardedSession(replicas, std::move(shard), shard_tokens,
                        *std::move(first));
}

absl::Status ShardedSession::EnsureShard(size_t index, absl::Time deadline) {
  while (shards_.size() <= index) {
    // A replica of its own while there is one; then any.
    std::set<std::string> holding;
    for (const Session& shard : shards_) holding.insert(shard.address());
    const std::vector<std::string> all = replicas_->addresses();
    std::set<std::string> spares;
    for (const std::string& address : all) {
      if (holding.count(address) == 0) spares.insert(address);
    }
    absl::StatusOr<Session> shard;
    if (spares.empty()) {
      shard = replicas_->CreateSession(request_, Remaining(deadline), {});
    } else {
      // Half of what is left (at least 2 s, or what is left) for the spares:
      // a hung one does not take the holders' turn too.
      const absl::Duration share =
          std::max(Remaining(deadline) / 2,
                   std::min(Remaining(deadline), absl::Seconds(2)));
      shard = replicas_->CreateSession(request_, share, holding);
      // The spares may all be down, draining or hung (a rolling update):
      // then a replica holding a shard.
      const absl::StatusCode code = shard.status().code();
      if ((code == absl::StatusCode::kUnavailable ||
           code == absl::StatusCode::kCancelled ||
           code == absl::StatusCode::kDeadlineExceeded) &&
          Remaining(deadline) > absl::ZeroDuration()) {
        shard = replicas_->CreateSession(request_, Remaining(deadline), spares);
      }
    }
    if (!shard.ok()) {
      return absl::Status(shard.status().code(),
                          absl::StrCat("creating shard ", shards_.size(), ": ",
                                       shard.status().message()));
    }
    shards_.push_back(*std::move(shard));
  }
  return absl::OkStatus();
}

absl::Status ShardedSession::CheckShards(int64_t layer, int64_t end) const {
  const int64_t length = lengths_[layer];
  for (const size_t s : lost_) {
    const int64_t first = static_cast<int64_t>(s) * shard_tokens_;
    if (std::max(length, end) > first) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shard ", s, " (session ", shards_[s].id(), " at ",
          shards_[s].address(),
          ") was lost with its replica, and with it layer ", layer,
          "'s tokens from ", first,
          ": a sharded session cannot get them back; Delete() it and create a "
          "new one"));
    }
  }
  for (size_t s = 0; s < shards_.size(); ++s) {
    const int64_t before = static_cast<int64_t>(s) * shard_tokens_;
    const int64_t want = std::clamp<int64_t>(length - before, 0, shard_tokens_);
    const int64_t held = shards_[s].length(layer);
    if (held != want) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shard ", s, " (session ", shards_[s].id(), " at ",
          shards_[s].address(), ") holds ", held, " tokens of layer ", layer,
          ", expected ", want, " of its ", length,
          ": its session was lost (or rebuilt empty), and a sharded session "
          "cannot get the tokens back; Delete() it and create a new one"));
    }
  }
  return absl::OkStatus();
}

namespace {

// `error` named by its shard, without a Session's advice to rebuild it (a
// sharded session is not rebuilt), `told` after it; its payloads kept.
absl::Status OfShard(const absl::Status& error, size_t shard,
                     absl::string_view told = "") {
  absl::string_view reason = error.message();
  absl::ConsumeSuffix(&reason, kRebuildAdvice);
  absl::Status named(error.code(),
                     absl::StrCat("shard ", shard, ": ", reason, told));
  error.ForEachPayload(
      [&named](absl::string_view url, const absl::Cord& payload) {
        named.SetPayload(url, payload);
      });
  return named;
}

}  // namespace

absl::Status ShardedSession::Failed(const absl::Status& error, size_t shard,
                                    int64_t layer, int64_t start, int64_t end,
                                    bool has_query) {
  int64_t stands = 0;
  for (const Session& s : shards_) stands += s.length(layer);
  lengths_[layer] = stands;
  std::string told;
  if (IsReplicaGone(error)) {
    lost_.insert(shard);
    told =
        "; the tokens the shard held went with its replica, and a sharded "
        "session is not rebuilt: Delete() it and create a new one";
  } else if (end > start && stands == end && has_query) {
    told = absl::StrCat("; the step's append stands (length() is ", end,
                        "): send the query again alone");
  } else if (start < stands && stands < end) {
    told = absl::StrCat("; the step's first ", stands - start,
                        " tokens stand (length() is ", stands,
                        "): send the rest, not the whole step again");
  }
  return OfShard(error, shard, told);
}

absl::StatusOr<StepOutput> ShardedSession::Step(StepInputs inputs,
                                                absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  const int64_t layer = inputs.layer;
  if (layer < 0 || layer >= num_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer is ", layer, ", expected 0 to ", num_layers() - 1));
  }
  absl::StatusOr<int64_t> appended = AppendedTokens(inputs);
  if (!appended.ok()) return appended.status();
  // Checked before any shard is sent a piece, so that a malformed step
  // appends nothing anywhere (the server would refuse it only at the shard
  // holding its query, after the earlier pieces were appended).
  if (absl::Status valid = CheckInputs(inputs); !valid.ok()) return valid;
  const int64_t start = lengths_[layer];
  const int64_t end = start + *appended;
  if (absl::Status held = CheckShards(layer, end); !held.ok()) return held;
  const int64_t query_rows = inputs.query && inputs.query->shape_size() == 3
                                 ? inputs.query->shape(1)
                                 : 0;
  // The shards holding tokens of the layer once the step appended.
  const size_t used =
      end == 0 ? 0 : static_cast<size_t>((end - 1) / shard_tokens_) + 1;
  if (inputs.query && used > 1 && query_rows != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "query holds ", query_rows, " rows; a step over a layer that spans ",
        used,
        " shards takes one (rows before the last would see keys of the "
        "last shard's position only partly)"));
  }
  if (used > 0) {
    if (absl::Status made = EnsureShard(used - 1, deadline); !made.ok()) {
      return made;
    }
  }

  // The append, cut at shard boundaries; the last piece goes with the query.
  StepInputs last;
  last.layer = layer;
  last.options = inputs.options;
  for (int64_t from = start; from < end;) {
    const size_t shard = static_cast<size_t>(from / shard_tokens_);
    const int64_t to =
        std::min(end, static_cast<int64_t>(shard + 1) * shard_tokens_);
    v1::Tensor key = internal::Slice(*inputs.key, 1, from - start, to - start);
    v1::Tensor value =
        internal::Slice(*inputs.value, 1, from - start, to - start);
    if (to == end) {
      last.key = std::move(key);
      last.value = std::move(value);
      break;
    }
    if (absl::Status s = shards_[shard].Append(
            layer, std::move(key), std::move(value), Remaining(deadline));
        !s.ok()) {
      return Failed(s, shard, layer, start, end, inputs.query.has_value());
    }
    lengths_[layer] = to;
    from = to;
  }
  if (!inputs.query) {
    if (last.key) {
      const size_t shard = used - 1;
      absl::StatusOr<StepOutput> done =
          shards_[shard].Step(std::move(last), Remaining(deadline));
      if (!done.ok()) {
        return Failed(done.status(), shard, layer, start, end, false);
      }
      lengths_[layer] = end;
    }
    StepOutput output;
    output.length = lengths_[layer];
    return output;
  }
  if (used == 0) {
    // No key anywhere: as one session, the query attends over nothing.
    absl::StatusOr<StepOutput> empty =
        shards_[0].Step(std::move(inputs), Remaining(deadline));
    if (!empty.ok()) return Failed(empty.status(), 0, layer, start, end, true);
    return empty;
  }

  // Every shard attends with the query, at once; the merge needs f32 outputs
  // and the lse.
  const v1::DType dtype = inputs.options.output_dtype() == v1::DTYPE_UNSPECIFIED
                              ? inputs.query->dtype()
                              : inputs.options.output_dtype();
  const bool return_lse = inputs.options.return_lse();
  v1::StepOptions shard_options = inputs.options;
  shard_options.set_return_lse(true);
  shard_options.set_output_dtype(v1::FLOAT32);
  last.options = shard_options;
  last.query = *inputs.query;
  std::vector<std::future<absl::StatusOr<StepOutput>>> others;
  for (size_t s = 0; s + 1 < used; ++s) {
    StepInputs attend;
    attend.layer = layer;
    attend.query = *inputs.query;
    attend.options = shard_options;
    others.push_back(std::async(
        std::launch::async,
        [this, s, deadline, attend = std::move(attend)]() mutable {
          return shards_[s].Step(std::move(attend), Remaining(deadline));
        }));
  }
  std::vector<absl::StatusOr<StepOutput>> parts;
  absl::StatusOr<StepOutput> tail =
      shards_[used - 1].Step(std::move(last), Remaining(deadline));
  for (auto& other : others) parts.push_back(other.get());
  parts.push_back(std::move(tail));
  // What stands, whatever failed: the earlier shards are full, and the last
  // one's Session knows whether its append landed. A step retried after a
  // failure then never appends twice.
  for (size_t s = 0; s < parts.size(); ++s) {
    if (!parts[s].ok()) {
      return Failed(parts[s].status(), s, layer, start, end, true);
    }
  }
  lengths_[layer] = end;

  for (size_t s = 0; s < parts.size(); ++s) {
    if (!parts[s]->output) {
      return absl::InternalError(absl::StrCat(
          "shard ", s, " answered a step with a query without an output"));
    }
  }
  const v1::Tensor& shape_of = *parts.back()->output;
  if (shape_of.shape_size() != 3) {
    return absl::InternalError("a shard's output is not [H, Tq, Dv]");
  }
  const int64_t heads = shape_of.shape(0), value_dim = shape_of.shape(2);
  const int64_t rows = heads * shape_of.shape(1);
  std::vector<std::vector<float>> outputs, lses;
  for (absl::StatusOr<StepOutput>& part : parts) {
    absl::StatusOr<std::vector<float>> output = FloatValues(*part->output);
    absl::StatusOr<std::vector<float>> lse =
        part->lse
            ? FloatValues(*part->lse)
            : absl::StatusOr<std::vector<float>>(absl::InternalError("no lse"));
    if (!output.ok() || !lse.ok() ||
        static_cast<int64_t>(output->size()) != rows * value_dim ||
        static_cast<int64_t>(lse->size()) != rows) {
      return absl::InternalError(
          "a shard's output or lse does not have the expected size");
    }
    outputs.push_back(*std::move(output));
    lses.push_back(*std::move(lse));
  }
  std::vector<float> output, lse;
  internal::MergeByLse(outputs, lses, rows, value_dim, &output, &lse);
  StepOutput merged;
  merged.output =
      MakeTensor(dtype, {heads, shape_of.shape(1), value_dim}, output);
  if (return_lse)
    merged.lse = MakeFloat32Tensor({heads, shape_of.shape(1)}, lse);
  merged.length = end;
  merged.recovered = std::any_of(parts.begin(), parts.end(),
                                 [](const auto& p) { return p->recovered; });
  return merged;
}

absl::Status ShardedSession::CheckInputs(const StepInputs& inputs) const {
  const v1::CreateSessionRequest& r = request_;
  const int64_t kv_heads =
      r.num_kv_heads() > 0 ? r.num_kv_heads() : r.num_heads();
  const int64_t value_dim = r.value_dim() > 0 ? r.value_dim() : r.key_dim();
  const auto check = [](const char* field, const v1::Tensor& tensor,
                        int64_t heads, int64_t dim) -> absl::Status {
    const bool float_dtype = tensor.dtype() == v1::FLOAT32 ||
                             tensor.dtype() == v1::BFLOAT16 ||
                             tensor.dtype() == v1::FLOAT16;
    if (!float_dtype || tensor.shape_size() != 3 || tensor.shape(0) != heads ||
        tensor.shape(1) < 1 || tensor.shape(2) != dim ||
        static_cast<int64_t>(tensor.data().size()) !=
            heads * tensor.shape(1) * dim * DTypeBytes(tensor.dtype())) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " must be a float tensor of shape [", heads, ", T, ", dim,
          "] (the session's) whose bytes match its shape"));
    }
    return absl::OkStatus();
  };
  if (inputs.key) {
    ATTNSERVE_RETURN_IF_ERROR(check("key", *inputs.key, kv_heads, r.key_dim()));
    ATTNSERVE_RETURN_IF_ERROR(
        check("value", *inputs.value, kv_heads, value_dim));
  }
  if (inputs.query) {
    ATTNSERVE_RETURN_IF_ERROR(
        check("query", *inputs.query, r.num_heads(), r.key_dim()));
  }
  // The shards answer f32, merged, then made the caller's dtype here: the
  // server never sees it to refuse it.
  return internal::CheckOutputDtype(inputs.options.output_dtype());
}

absl::Status ShardedSession::Append(int64_t layer, v1::Tensor key,
                                    v1::Tensor value, absl::Duration timeout) {
  return Step(AppendInputs(layer, std::move(key), std::move(value)), timeout)
      .status();
}

absl::StatusOr<StepOutput> ShardedSession::Attend(
    int64_t layer, v1::Tensor key, v1::Tensor value, v1::Tensor query,
    const v1::StepOptions& options, absl::Duration timeout) {
  return Step(AttendInputs(layer, std::move(key), std::move(value),
                           std::move(query), options),
              timeout);
}

absl::Status ShardedSession::Delete(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  // All at once: a shard whose replica hangs does not take the others' time.
  std::vector<std::pair<size_t, std::future<absl::Status>>> deletes;
  for (size_t s = 0; s < shards_.size(); ++s) {
    Session& shard = shards_[s];
    if (shard.deleted()) continue;
    deletes.emplace_back(s, std::async(std::launch::async, [&shard, deadline] {
                           return shard.Delete(Remaining(deadline));
                         }));
  }
  absl::Status first;
  for (auto& [s, deleted] : deletes) {
    absl::Status status = deleted.get();
    if (first.ok() && !status.ok()) first = OfShard(status, s);
  }
  return first;
}

}  // namespace attnserve
