// Three attnserve processes on loopback, as a Deployment's replicas: clients
// over the multi-address target with round_robin and retries lose no call
// when a replica is killed (SIGKILL) or drained (SIGTERM) under load, and
// leave it out by its connection state and its health rather than by failed
// calls; the replicas agree on a weights version after the shared folder
// changes; sessions are placed by rendezvous hashing, pinned to their
// replica, told apart when it is gone (killed or restarted), rebuilt
// elsewhere through the caller's hook, kept off a draining replica; and a
// session sharded over the replicas answers as one session does.
#include "attnserve/client/replicas.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/client/client.h"
#include "attnserve/client/session.h"
#include "attnserve/client/sharded_session.h"
#include "gmock/gmock.h"
#include "grpcpp/channel.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"
#include "reference/tolerance.h"
#include "reliability/attnserve_process.h"
#include "server/weights_helpers.h"

namespace attnserve {
namespace {

using ::attnserve::testing::AttnserveProcess;
using ::attnserve::testing::MetricSum;
using ::attnserve::testing::RandomValues;
using ::attnserve::testing::ReferenceAttention;
using ::attnserve::testing::ReferenceMhaShape;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int kReplicas = 3;
constexpr absl::Duration kTimeout = absl::Seconds(20);

// Polls `done` every 20 ms for up to `limit`.
bool Eventually(const std::function<bool()>& done, absl::Duration limit) {
  const absl::Time by = absl::Now() + limit;
  while (!done()) {
    if (absl::Now() > by) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

class ReplicasTest : public ::testing::Test {
 protected:
  // Starts replica `i` named "replica-<i>" with `flags`.
  std::unique_ptr<AttnserveProcess> StartReplica(
      int i, std::vector<std::string> flags) {
    flags.push_back(absl::StrCat("--replica_name=replica-", i));
    absl::StatusOr<std::unique_ptr<AttnserveProcess>> process =
        AttnserveProcess::Start(ATTNSERVE_BINARY, flags);
    EXPECT_TRUE(process.ok()) << process.status();
    return process.ok() ? *std::move(process) : nullptr;
  }

  void StartReplicas(const std::vector<std::string>& flags) {
    for (int i = 0; i < kReplicas; ++i) {
      replicas_.push_back(StartReplica(i, flags));
      ASSERT_NE(replicas_.back(), nullptr);
    }
  }

  // "ipv4:127.0.0.1:p0,127.0.0.1:p1,127.0.0.1:p2": one gRPC target over
  // all of them, as a headless Service's name resolves to every pod.
  std::string Target() const {
    std::vector<std::string> addresses;
    for (const auto& replica : replicas_) {
      addresses.push_back(replica->target());
    }
    return absl::StrCat("ipv4:", absl::StrJoin(addresses, ","));
  }

  int IndexOf(const std::string& address) const {
    for (int i = 0; i < static_cast<int>(replicas_.size()); ++i) {
      if (replicas_[i] != nullptr && replicas_[i]->target() == address) {
        return i;
      }
    }
    return -1;
  }

  std::vector<std::unique_ptr<AttnserveProcess>> replicas_;
};

// One small Attend and the reference's answer.
struct Probe {
  v1::AttendRequest request;
  std::vector<double> expected;
};

Probe MakeProbe(uint64_t seed) {
  constexpr int64_t kHeads = 2, kQuery = 4, kKeys = 16, kDim = 8;
  const std::vector<float> q = RandomValues(kHeads * kQuery * kDim, seed);
  const std::vector<float> k = RandomValues(kHeads * kKeys * kDim, seed + 1);
  const std::vector<float> v = RandomValues(kHeads * kKeys * kDim, seed + 2);
  Probe probe;
  *probe.request.mutable_query() =
      MakeFloat32Tensor({1, kHeads, kQuery, kDim}, q);
  *probe.request.mutable_key() = MakeFloat32Tensor({1, kHeads, kKeys, kDim}, k);
  *probe.request.mutable_value() =
      MakeFloat32Tensor({1, kHeads, kKeys, kDim}, v);
  probe.expected = ReferenceAttention(
                       {1, kHeads, kHeads, kQuery, kKeys, kDim, kDim}, q, k, v)
                       .output;
  return probe;
}

bool Matches(const v1::AttendResponse& response,
             const std::vector<double>& expected) {
  absl::StatusOr<std::vector<float>> output = FloatValues(response.output());
  if (!output.ok() || output->size() != expected.size()) return false;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (std::abs((*output)[i] - expected[i]) >
        1e-5 + 1e-5 * std::abs(expected[i])) {
      return false;
    }
  }
  return true;
}

// What one call of the load saw.
struct CallRecord {
  absl::Time started;
  int attempts = 0;
};

TEST_F(ReplicasTest, KilledAndDrainedReplicasLoseNoCall) {
  StartReplicas({"--drain_grace_seconds=3"});
  if (HasFatalFailure()) return;
  ClientOptions options;
  options.health_check = true;
  options.retry.max_attempts = 6;
  options.retry.initial_backoff = absl::Milliseconds(20);
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect(Target(), options);
  ASSERT_TRUE(client.ok()) << client.status();

  // The load: 3 callers, each call's answer checked against the reference.
  // Bounded in time (the stop below, or 40 s) and count.
  constexpr int kCallers = 3;
  constexpr int kMostCalls = 20000;
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0}, wrong{0};
  absl::Mutex mutex;
  std::vector<CallRecord> records;
  std::vector<std::string> first_errors;
  std::vector<std::thread> callers;
  const absl::Time load_started = absl::Now();
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int i = 0; i < kMostCalls && !stop.load(); ++i) {
        if (absl::Now() - load_started > absl::Seconds(40)) break;
        const Probe probe = MakeProbe(1000003u * (c + 1) + 7u * i);
        CallRecord record{absl::Now(), 0};
        absl::StatusOr<v1::AttendResponse> answer = (*client)->Attend(
            probe.request, absl::Seconds(10), &record.attempts);
        absl::MutexLock lock(&mutex);
        records.push_back(record);
        if (!answer.ok()) {
          ++errors;
          if (first_errors.size() < 5) {
            first_errors.push_back(answer.status().ToString());
          }
        } else if (!Matches(*answer, probe.expected)) {
          ++wrong;
        }
      }
    });
  }

  absl::SleepFor(absl::Milliseconds(1500));
  const absl::Time killed = absl::Now();
  replicas_[0]->Signal(SIGKILL);
  ASSERT_TRUE(replicas_[0]->Wait(absl::Seconds(10)).status().code() ==
              absl::StatusCode::kInternal);  // Ended by a signal.
  absl::SleepFor(absl::Milliseconds(1500));

  const auto attends = [&](int i) {
    absl::StatusOr<std::string> metrics = replicas_[i]->ScrapeMetrics();
    return metrics.ok() ? MetricSum(*metrics, "attnserve_requests_total",
                                    {{"rpc", "Attend"}})
                        : -1.0;
  };
  const double before_drain = attends(1);
  const absl::Time drained = absl::Now();
  replicas_[1]->Signal(SIGTERM);
  // Within the 3 s grace the replica still serves, but its health says
  // NOT_SERVING at once and the clients' health checks leave it out.
  absl::SleepFor(absl::Milliseconds(700));
  const double early_in_grace = attends(1);
  absl::SleepFor(absl::Milliseconds(1500));
  const double late_in_grace = attends(1);
  absl::StatusOr<int> drain_exit = replicas_[1]->Wait(absl::Seconds(40));
  absl::SleepFor(absl::Milliseconds(1000));
  stop = true;
  for (std::thread& caller : callers) caller.join();

  ASSERT_TRUE(drain_exit.ok()) << drain_exit.status();
  EXPECT_EQ(*drain_exit, 0);
  EXPECT_EQ(errors.load(), 0) << absl::StrJoin(first_errors, "\n");
  EXPECT_EQ(wrong.load(), 0);
  int after_kill = 0, after_kill_retried = 0, in_drain = 0,
      in_drain_retried = 0;
  for (const CallRecord& record : records) {
    if (record.started > killed + absl::Milliseconds(500) &&
        record.started < drained) {
      ++after_kill;
      if (record.attempts > 1) ++after_kill_retried;
    }
    if (record.started > drained) {
      ++in_drain;
      if (record.attempts > 1) ++in_drain_retried;
    }
  }
  std::cerr << records.size() << " calls; " << after_kill
            << " between the kill (+0.5 s) and the drain, " << in_drain
            << " from the drain on; Attends served by the draining replica: "
            << before_drain << " before, " << early_in_grace << " at 0.7 s, "
            << late_in_grace << " at 2.2 s of its grace\n";
  EXPECT_GT(after_kill, 20);
  EXPECT_GT(in_drain, 20);
  // The killed replica's connection is down: the channel sends nothing there,
  // so no call needs a second attempt.
  EXPECT_EQ(after_kill_retried, 0);
  EXPECT_EQ(in_drain_retried, 0);
  // The draining replica got no call once its health said NOT_SERVING.
  EXPECT_GT(before_drain, 0);
  EXPECT_EQ(late_in_grace, early_in_grace);
}

TEST_F(ReplicasTest, ReplicasAgreeOnAWeightsVersionAfterAChange) {
  const std::filesystem::path root =
      std::filesystem::path(::testing::TempDir()) /
      absl::StrCat("replicas_weights_", getpid());
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root);
  const ReferenceMhaShape tiny{1, 2, 2, 4, 4, 2, 2, 4, 4};
  const v1::ProjectionWeights first = testing::MakeWeights(tiny, 500);
  const v1::ProjectionWeights second = testing::MakeWeights(tiny, 510);
  ASSERT_TRUE(testing::WriteWeightsFolder(
      root / ".attn.1", "num_heads=2\nversion=1\n", first, "<f4"));
  std::filesystem::create_directory_symlink(".attn.1", root / "attn");
  StartReplicas({absl::StrCat("--weights_dir=", root.string()),
                 "--weights_reload_seconds=1", "--demo_weights=false"});
  if (HasFatalFailure()) return;
  std::vector<std::unique_ptr<Client>> clients;
  for (const auto& replica : replicas_) {
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(replica->target());
    ASSERT_TRUE(client.ok());
    clients.push_back(*std::move(client));
  }
  const auto versions = [&] {
    std::vector<int64_t> seen;
    for (const auto& client : clients) {
      absl::StatusOr<v1::ListWeightsResponse> list =
          client->ListWeights(kTimeout);
      seen.push_back(list.ok() && list->weights_size() == 1
                         ? list->weights(0).version()
                         : -1);
    }
    return seen;
  };
  EXPECT_EQ(versions(), std::vector<int64_t>(kReplicas, 1));

  // The new version is written apart and swapped in by a link rename, as a
  // volume's atomic update does.
  ASSERT_TRUE(testing::WriteWeightsFolder(
      root / ".attn.2", "num_heads=2\nversion=2\n", second, "<f4"));
  std::filesystem::create_directory_symlink(".attn.2", root / ".attn.link");
  std::filesystem::rename(root / ".attn.link", root / "attn");
  EXPECT_TRUE(Eventually(
      [&] { return versions() == std::vector<int64_t>(kReplicas, 2); },
      absl::Seconds(30)))
      << "versions: " << absl::StrJoin(versions(), ", ");

  v1::MultiHeadAttentionRequest request =
      testing::MakeRequest(tiny, 520, false);
  request.set_weights_name("attn");
  request.set_weights_version(2);
  const std::vector<double> expected =
      testing::Expected(tiny, request, second).output;
  for (int i = 0; i < kReplicas; ++i) {
    absl::StatusOr<v1::MultiHeadAttentionResponse> answer =
        clients[i]->MultiHeadAttention(request, kTimeout);
    ASSERT_TRUE(answer.ok()) << "replica " << i << ": " << answer.status();
    EXPECT_EQ(answer->weights_version(), 2);
    testing::ExpectNear(answer->output(), expected, testing::kAbs,
                        testing::kRel, absl::StrCat("replica ", i));
  }
  request.set_weights_version(1);
  for (int i = 0; i < kReplicas; ++i) {
    const absl::Status stale =
        clients[i]->MultiHeadAttention(request, kTimeout).status();
    EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(stale.message()),
                HasSubstr("weights_name 'attn' is at version 2 on this server, "
                          "the request's weights_version is 1"));
  }
  std::error_code ignored;
  std::filesystem::remove_all(root, ignored);
}

// A session as the test knows it: every token it appended, per kv head.
struct SessionModel {
  static constexpr int64_t kHeads = 2, kKvHeads = 2, kDim = 8;
  std::vector<std::vector<float>> keys{kKvHeads}, values{kKvHeads};
  int64_t length = 0;

  // `tokens` random tokens as a step's key and value, recorded.
  std::pair<v1::Tensor, v1::Tensor> Append(int64_t tokens, uint64_t seed) {
    const std::vector<float> k = RandomValues(kKvHeads * tokens * kDim, seed);
    const std::vector<float> v =
        RandomValues(kKvHeads * tokens * kDim, seed + 1);
    const size_t row = static_cast<size_t>(tokens * kDim);
    for (size_t h = 0; h < kKvHeads; ++h) {
      keys[h].insert(keys[h].end(), k.begin() + h * row,
                     k.begin() + (h + 1) * row);
      values[h].insert(values[h].end(), v.begin() + h * row,
                       v.begin() + (h + 1) * row);
    }
    length += tokens;
    return {MakeFloat32Tensor({kKvHeads, tokens, kDim}, k),
            MakeFloat32Tensor({kKvHeads, tokens, kDim}, v)};
  }

  // Tokens [from, to) as a step's key and value (for a rebuild).
  std::pair<v1::Tensor, v1::Tensor> Tokens(int64_t from, int64_t to) const {
    std::vector<float> k, v;
    for (size_t h = 0; h < kKvHeads; ++h) {
      k.insert(k.end(), keys[h].begin() + from * kDim,
               keys[h].begin() + to * kDim);
      v.insert(v.end(), values[h].begin() + from * kDim,
               values[h].begin() + to * kDim);
    }
    return {MakeFloat32Tensor({kKvHeads, to - from, kDim}, k),
            MakeFloat32Tensor({kKvHeads, to - from, kDim}, v)};
  }

  // The reference's output for one query row over every token.
  std::vector<double> Expected(const std::vector<float>& query) const {
    std::vector<float> k, v;
    for (size_t h = 0; h < kKvHeads; ++h) {
      k.insert(k.end(), keys[h].begin(), keys[h].end());
      v.insert(v.end(), values[h].begin(), values[h].end());
    }
    return ReferenceAttention({1, kHeads, kKvHeads, 1, length, kDim, kDim},
                              query, k, v)
        .output;
  }
};

v1::CreateSessionRequest SmallSession() {
  v1::CreateSessionRequest create;
  create.set_num_layers(1);
  create.set_num_heads(SessionModel::kHeads);
  create.set_num_kv_heads(SessionModel::kKvHeads);
  create.set_key_dim(SessionModel::kDim);
  create.set_dtype(v1::FLOAT32);
  return create;
}

// A decode step on `session` (one token, one query row), checked against
// `model`.
absl::Status Decode(Session& session, SessionModel& model, uint64_t seed,
                    absl::Duration timeout = kTimeout) {
  auto [key, value] = model.Append(1, seed);
  const std::vector<float> query =
      RandomValues(SessionModel::kHeads * SessionModel::kDim, seed + 2);
  absl::StatusOr<StepOutput> out = session.Attend(
      0, std::move(key), std::move(value),
      MakeFloat32Tensor({SessionModel::kHeads, 1, SessionModel::kDim}, query),
      v1::StepOptions(), timeout);
  if (!out.ok()) {
    model.length -= 1;
    for (size_t h = 0; h < SessionModel::kKvHeads; ++h) {
      model.keys[h].resize(model.keys[h].size() - SessionModel::kDim);
      model.values[h].resize(model.values[h].size() - SessionModel::kDim);
    }
    return out.status();
  }
  absl::StatusOr<std::vector<float>> output = FloatValues(*out->output);
  if (!output.ok()) return output.status();
  const std::vector<double> expected = model.Expected(query);
  for (size_t i = 0; i < expected.size(); ++i) {
    if (std::abs((*output)[i] - expected[i]) >
        1e-5 + 1e-5 * std::abs(expected[i])) {
      return absl::InternalError(absl::StrCat(
          "output ", i, " is ", (*output)[i], ", expected ", expected[i]));
    }
  }
  return absl::OkStatus();
}

TEST_F(ReplicasTest, SessionsArePinnedToldGoneAndRebuilt) {
  StartReplicas({"--drain_grace_seconds=1"});
  if (HasFatalFailure()) return;
  ClientOptions options;
  options.retry.max_attempts = 3;
  options.retry.initial_backoff = absl::Milliseconds(20);
  absl::StatusOr<std::unique_ptr<Replicas>> replicas =
      Replicas::Connect(Target(), options);
  ASSERT_TRUE(replicas.ok()) << replicas.status();
  ASSERT_EQ((*replicas)->addresses().size(), 3u);

  // Sessions until one replica holds three (the victim's) and another holds
  // some, each placed on its rendezvous first choice and told which replica
  // holds it.
  std::vector<Session> sessions;
  std::vector<SessionModel> models;
  std::map<std::string, std::vector<size_t>> on;
  std::string victim;
  for (int i = 0; i < 60 && (victim.empty() || on.size() < 2); ++i) {
    absl::StatusOr<Session> session =
        (*replicas)->CreateSession(SmallSession(), kTimeout);
    ASSERT_TRUE(session.ok()) << session.status();
    EXPECT_EQ(session->address(), (*replicas)->Rank(session->id())[0]);
    EXPECT_EQ(session->replica().name(),
              absl::StrCat("replica-", IndexOf(session->address())));
    EXPECT_EQ(session->replica().incarnation().size(), 16u);
    on[session->address()].push_back(sessions.size());
    if (victim.empty() && on[session->address()].size() == 3) {
      victim = session->address();
    }
    sessions.push_back(*std::move(session));
    models.emplace_back();
  }
  ASSERT_FALSE(victim.empty());
  EXPECT_GE(on.size(), 2u) << "sessions spread over the replicas";
  for (size_t s = 0; s < sessions.size(); ++s) {
    auto [key, value] = models[s].Append(5, 100 * s);
    ASSERT_TRUE(sessions[s].Append(0, key, value, kTimeout).ok());
    ASSERT_TRUE(Decode(sessions[s], models[s], 100 * s + 10).ok());
  }

  const int victim_index = IndexOf(victim);
  const std::string victim_name = absl::StrCat("replica-", victim_index);
  const std::string port = victim.substr(victim.rfind(':') + 1);
  replicas_[victim_index]->Signal(SIGKILL);
  ASSERT_FALSE(replicas_[victim_index]->Wait(absl::Seconds(10)).ok());

  // Without a hook: the replica is gone, said so, not NOT_FOUND.
  const size_t a = on[victim][0], b = on[victim][1], c = on[victim][2];
  absl::Status gone = Decode(sessions[a], models[a], 7000);
  EXPECT_TRUE(IsReplicaGone(gone)) << gone;
  EXPECT_EQ(gone.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(gone.message()),
              HasSubstr(absl::StrCat("'s replica ", victim_name)));
  EXPECT_THAT(std::string(gone.message()),
              HasSubstr("is gone, and the session with it: it is unreachable"));

  // A hook that restores too little: the new session is deleted, and the
  // Session stays the lost one, its lengths as they were, still told gone
  // (until 2026-12-06 it became the half-restored session, whose next step
  // attended over the missing tokens as a success, and the session leaked).
  std::string partial_id, partial_address;
  const std::vector<int64_t> lengths_before = sessions[b].lengths();
  const std::string old_id = sessions[b].id();
  sessions[b].SetRebuild([&](Session& fresh,
                             const std::vector<int64_t>& lengths,
                             absl::Duration timeout) {
    partial_id = fresh.id();
    partial_address = fresh.address();
    auto [key, value] = models[b].Tokens(0, lengths[0] - 1);
    return fresh.Append(0, std::move(key), std::move(value), timeout);
  });
  gone = Decode(sessions[b], models[b], 7050);
  EXPECT_TRUE(IsReplicaGone(gone)) << gone;
  EXPECT_THAT(std::string(gone.message()),
              AllOf(HasSubstr("rebuilding it failed: the rebuild hook left "
                              "layer 0 of session "),
                    HasSubstr("this session is still the lost one")));
  EXPECT_EQ(sessions[b].id(), old_id);
  EXPECT_EQ(sessions[b].lengths(), lengths_before);
  ASSERT_FALSE(partial_id.empty());
  v1::GetSessionRequest partial;
  partial.set_session_id(partial_id);
  EXPECT_EQ((*replicas)
                ->client(partial_address)
                ->GetSession(partial, kTimeout)
                .status()
                .code(),
            absl::StatusCode::kNotFound);

  // A hook that fails on the step's deadline: nothing is left to delete its
  // session with, and the step keeps to its timeout (until 2026-12-07 the
  // delete had a second of its own past it, an audit found).
  std::string waited_id, waited_address;
  sessions[b].SetRebuild(
      [&](Session& fresh, const std::vector<int64_t>&, absl::Duration timeout) {
        waited_id = fresh.id();
        waited_address = fresh.address();
        absl::SleepFor(timeout);
        return absl::DeadlineExceededError("the hook ran out of time");
      });
  gone = Decode(sessions[b], models[b], 7070, absl::Seconds(1));
  EXPECT_TRUE(IsReplicaGone(gone)) << gone;
  EXPECT_THAT(std::string(gone.message()),
              HasSubstr("the hook ran out of time (no time was left to delete "
                        "it: it goes at its TTL; this session is still the "
                        "lost one"));
  EXPECT_EQ(sessions[b].id(), old_id);
  v1::DeleteSessionRequest leftover;
  leftover.set_session_id(waited_id);
  EXPECT_TRUE((*replicas)
                  ->client(waited_address)
                  ->DeleteSession(leftover, kTimeout)
                  .ok());

  // With a hook: rebuilt on the next replica from the caller's tokens, and
  // the step answered there.
  int rebuilds = 0;
  sessions[b].SetRebuild([&](Session& fresh,
                             const std::vector<int64_t>& lengths,
                             absl::Duration timeout) {
    ++rebuilds;
    auto [key, value] = models[b].Tokens(0, lengths[0]);
    return fresh.Append(0, std::move(key), std::move(value), timeout);
  });
  absl::Status rebuilt = Decode(sessions[b], models[b], 7100);
  EXPECT_TRUE(rebuilt.ok()) << rebuilt;
  EXPECT_EQ(rebuilds, 1);
  EXPECT_NE(sessions[b].address(), victim);
  EXPECT_NE(sessions[b].id(), old_id);
  EXPECT_EQ(sessions[b].address(),
            (*replicas)->Rank(sessions[b].id())[0] == victim
                ? (*replicas)->Rank(sessions[b].id())[1]
                : (*replicas)->Rank(sessions[b].id())[0]);
  EXPECT_TRUE(Decode(sessions[b], models[b], 7200).ok());

  // The other replicas' sessions never noticed.
  for (const auto& [address, indices] : on) {
    if (address == victim) continue;
    for (size_t s : indices) {
      EXPECT_TRUE(Decode(sessions[s], models[s], 7300 + s).ok()) << address;
    }
  }

  // The same name and address, another process: its steps are refused for
  // their incarnation, and the client says the replica restarted.
  replicas_[victim_index] =
      StartReplica(victim_index, {absl::StrCat("--port=", port)});
  ASSERT_NE(replicas_[victim_index], nullptr);
  ASSERT_TRUE((*replicas)->client(victim)->channel()->WaitForConnected(
      absl::ToChronoTime(absl::Now() + absl::Seconds(10))));
  gone = Decode(sessions[c], models[c], 7400);
  EXPECT_TRUE(IsReplicaGone(gone)) << gone;
  EXPECT_THAT(std::string(gone.message()), HasSubstr("it restarted"));
  EXPECT_THAT(std::string(gone.message()),
              HasSubstr(absl::StrCat("this is replica ", victim_name)));
  // Every other call of a pinned session carries the incarnation and says
  // so too (a fork or truncation, which a window may also refuse
  // FAILED_PRECONDITION, asks GetSession to tell them apart).
  const auto expect_restarted = [&](const absl::Status& status) {
    EXPECT_TRUE(IsReplicaGone(status)) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("it restarted"));
  };
  expect_restarted(sessions[c].Truncate(1, kTimeout));
  expect_restarted(sessions[c].Fork(std::nullopt, kTimeout).status());
  expect_restarted(sessions[c].Sync(kTimeout));
  // A StepMany of sessions from both incarnations carries none: the stale
  // session's step is told gone, the new one's answered.
  absl::StatusOr<Session> fresh =
      Session::Create((*replicas)->client(victim), SmallSession(), kTimeout);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  SessionModel fresh_model;
  auto [fresh_key, fresh_value] = fresh_model.Append(2, 7500);
  auto [stale_key, stale_value] = models[a].Append(1, 7600);
  std::vector<SessionStepInputs> mixed;
  mixed.push_back({&*fresh, AppendInputs(0, fresh_key, fresh_value)});
  mixed.push_back({&sessions[a], AppendInputs(0, stale_key, stale_value)});
  absl::StatusOr<StepManyResults> stepped =
      StepMany(std::move(mixed), kTimeout);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  ASSERT_EQ(stepped->size(), 2u);
  EXPECT_TRUE((*stepped)[0].ok()) << (*stepped)[0].status();
  EXPECT_EQ(fresh->length(0), 2);
  expect_restarted((*stepped)[1].status());
  // A delete is done: the session went with the process that held it (it
  // said "create the session again elsewhere" every time until 2026-12-07),
  // and the new process's session of another caller is untouched.
  EXPECT_TRUE(sessions[a].Delete(kTimeout).ok());
  EXPECT_TRUE(sessions[a].deleted());
  EXPECT_TRUE(
      (*replicas)->client(victim)->GetSession(fresh->id(), kTimeout).ok());
  // Rebuilt by hand (no hook: the layers come back empty).
  ASSERT_TRUE(sessions[c].Rebuild(kTimeout).ok());
  EXPECT_EQ(sessions[c].length(0), 0);

  // With no other replica to take it, a rebuild asks the session's own
  // (until 2026-12-07 never: a single replica's sessions, their replica
  // restarted, could not be rebuilt).
  v1::CreateSessionRequest on_victim = SmallSession();
  on_victim.set_session_id(RandomSessionId());
  for (int i = 0;
       i < 1000 && (*replicas)->Rank(on_victim.session_id())[0] != victim;
       ++i) {
    on_victim.set_session_id(RandomSessionId());
  }
  absl::StatusOr<Session> last =
      (*replicas)->CreateSession(on_victim, kTimeout);
  ASSERT_TRUE(last.ok()) << last.status();
  ASSERT_EQ(last->address(), victim);
  for (int i = 0; i < kReplicas; ++i) {
    if (i == victim_index) continue;
    replicas_[i]->Signal(SIGKILL);
    EXPECT_FALSE(absl::IsDeadlineExceeded(
        replicas_[i]->Wait(absl::Seconds(10)).status()));  // Killed, gone.
  }
  const std::string before = last->id();
  const absl::Status rebuilt_there = last->Rebuild(kTimeout);
  ASSERT_TRUE(rebuilt_there.ok()) << rebuilt_there;
  EXPECT_EQ(last->address(), victim);
  EXPECT_NE(last->id(), before);
}

TEST_F(ReplicasTest, ADrainingReplicaTakesNoNewSessionsButServesItsOwn) {
  StartReplicas({"--drain_grace_seconds=4"});
  if (HasFatalFailure()) return;
  absl::StatusOr<std::unique_ptr<Replicas>> replicas =
      Replicas::Connect(Target());
  ASSERT_TRUE(replicas.ok()) << replicas.status();
  // A session on replica 0, then replica 0 drains.
  std::optional<Session> held;
  for (int i = 0; i < 60 && !held; ++i) {
    absl::StatusOr<Session> session =
        (*replicas)->CreateSession(SmallSession(), kTimeout);
    ASSERT_TRUE(session.ok()) << session.status();
    if (session->address() == replicas_[0]->target()) {
      held = *std::move(session);
    }
  }
  ASSERT_TRUE(held.has_value());
  SessionModel model;
  auto [key, value] = model.Append(3, 900);
  ASSERT_TRUE(held->Append(0, key, value, kTimeout).ok());
  replicas_[0]->Signal(SIGTERM);
  absl::SleepFor(absl::Milliseconds(300));
  // New sessions whose first choice is replica 0 go to their second.
  int moved = 0;
  for (int i = 0; i < 30; ++i) {
    absl::StatusOr<Session> session =
        (*replicas)->CreateSession(SmallSession(), kTimeout);
    ASSERT_TRUE(session.ok()) << session.status();
    EXPECT_NE(session->address(), replicas_[0]->target());
    if ((*replicas)->Rank(session->id())[0] == replicas_[0]->target()) ++moved;
  }
  EXPECT_GT(moved, 0);
  // Its own session is served through the grace.
  EXPECT_TRUE(Decode(*held, model, 910).ok());
  absl::StatusOr<int> exit_status = replicas_[0]->Wait(absl::Seconds(40));
  ASSERT_TRUE(exit_status.ok()) << exit_status.status();
  EXPECT_EQ(*exit_status, 0);
  // After the drain the session is gone with its replica.
  EXPECT_TRUE(IsReplicaGone(Decode(*held, model, 920)));

  // A hung replica (stopped) gets its share of the deadline, not all of it:
  // a session whose first choice it is goes to the next (until 2026-12-06 the
  // whole 6 s went to it, and the create failed DEADLINE_EXCEEDED).
  const std::string hung = replicas_[1]->target();
  v1::CreateSessionRequest request = SmallSession();
  request.set_session_id(RandomSessionId());
  for (int i = 0;
       i < 1000 && (*replicas)->Rank(request.session_id())[0] != hung; ++i) {
    request.set_session_id(RandomSessionId());
  }
  ASSERT_EQ((*replicas)->Rank(request.session_id())[0], hung);
  replicas_[1]->Signal(SIGSTOP);
  absl::StatusOr<Session> moved_on =
      (*replicas)->CreateSession(request, absl::Seconds(6));
  replicas_[1]->Signal(SIGCONT);
  ASSERT_TRUE(moved_on.ok()) << moved_on.status();
  EXPECT_NE(moved_on->address(), hung);
  SessionModel moved_model;
  EXPECT_TRUE(Decode(*moved_on, moved_model, 930).ok());
}

// A replica refusing a create for want of room (RESOURCE_EXHAUSTED: here
// max_sessions with kv_eviction none) passes it to the next in rendezvous
// order; every replica full is RESOURCE_EXHAUSTED naming each. A refusal of
// the request itself (a page past the whole KV cache), which the server
// marks and every replica would make, ends the create at once. Until
// 2026-12-07 the first full replica ended it (an audit of the Python
// client, whose Replicas did the same).
TEST_F(ReplicasTest, AFullReplicaPassesTheSessionToTheNext) {
  StartReplicas(
      {"--max_sessions=1", "--kv_eviction=none", "--kv_cache_bytes=4194304"});
  if (HasFatalFailure()) return;
  absl::StatusOr<std::unique_ptr<Replicas>> replicas =
      Replicas::Connect(Target());
  ASSERT_TRUE(replicas.ok()) << replicas.status();
  std::vector<Session> held;
  std::set<std::string> addresses;
  for (int i = 0; i < kReplicas; ++i) {
    absl::StatusOr<Session> session =
        (*replicas)->CreateSession(SmallSession(), kTimeout);
    ASSERT_TRUE(session.ok()) << session.status();
    addresses.insert(session->address());
    held.push_back(*std::move(session));
  }
  EXPECT_EQ(addresses.size(), static_cast<size_t>(kReplicas));
  const absl::Status full =
      (*replicas)->CreateSession(SmallSession(), kTimeout).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_THAT(std::string(full.message()), HasSubstr("no replica of "));
  for (Session& session : held) {
    ASSERT_TRUE(session.Delete(kTimeout).ok());
  }
  v1::CreateSessionRequest large = SmallSession();
  large.set_num_heads(64);
  large.set_num_kv_heads(64);
  large.set_key_dim(256);
  large.set_max_tokens(4096);  // Pages of 64 tokens: 8 MiB, past 4 MiB.
  const absl::Status too_large =
      (*replicas)->CreateSession(large, kTimeout).status();
  EXPECT_EQ(too_large.code(), absl::StatusCode::kResourceExhausted)
      << too_large;
  EXPECT_THAT(std::string(too_large.message()),
              ::testing::Not(HasSubstr("no replica of ")));
}

TEST_F(ReplicasTest, AShardedSessionAnswersAsOneSession) {
  StartReplicas({});
  if (HasFatalFailure()) return;
  absl::StatusOr<std::unique_ptr<Replicas>> replicas =
      Replicas::Connect(Target());
  ASSERT_TRUE(replicas.ok()) << replicas.status();
  constexpr int64_t kHeads = 4, kKvHeads = 2, kDim = 16, kShard = 64;
  v1::CreateSessionRequest create;
  create.set_num_layers(2);
  create.set_num_heads(kHeads);
  create.set_num_kv_heads(kKvHeads);
  create.set_key_dim(kDim);
  create.set_dtype(v1::FLOAT32);
  absl::StatusOr<ShardedSession> sharded =
      ShardedSession::Create(replicas->get(), create, kShard, kTimeout);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  absl::StatusOr<Session> one = (*replicas)->CreateSession(create, kTimeout);
  ASSERT_TRUE(one.ok()) << one.status();

  // Chunks that cross the shard boundaries, on layer 1 only: layer 0 stays
  // empty.
  std::vector<float> keys, values;  // [Hkv, L, D] once assembled
  std::vector<std::vector<float>> key_heads(kKvHeads), value_heads(kKvHeads);
  int64_t length = 0;
  const auto append = [&](int64_t tokens, uint64_t seed) {
    const std::vector<float> k = RandomValues(kKvHeads * tokens * kDim, seed);
    const std::vector<float> v =
        RandomValues(kKvHeads * tokens * kDim, seed + 1);
    for (int64_t h = 0; h < kKvHeads; ++h) {
      key_heads[h].insert(key_heads[h].end(), k.begin() + h * tokens * kDim,
                          k.begin() + (h + 1) * tokens * kDim);
      value_heads[h].insert(value_heads[h].end(), v.begin() + h * tokens * kDim,
                            v.begin() + (h + 1) * tokens * kDim);
    }
    length += tokens;
    return std::make_pair(MakeFloat32Tensor({kKvHeads, tokens, kDim}, k),
                          MakeFloat32Tensor({kKvHeads, tokens, kDim}, v));
  };
  {
    // An output dtype the shards never see (they answer f32) is refused
    // before any is sent a step (until 2026-12-07 it was answered with f16
    // bytes under its name).
    StepInputs bad_dtype;
    bad_dtype.layer = 1;
    bad_dtype.query =
        MakeFloat32Tensor({kHeads, 1, kDim}, RandomValues(kHeads * kDim, 999));
    bad_dtype.options.set_output_dtype(v1::BOOL);
    const absl::Status refused =
        sharded->Step(std::move(bad_dtype), kTimeout).status();
    EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
    EXPECT_THAT(std::string(refused.message()),
                HasSubstr("options.output_dtype is BOOL"));
  }
  for (const int64_t chunk : {50, 50, 50, 30}) {
    auto [k, v] = append(chunk, 1000 + length);
    ASSERT_TRUE(one->Append(1, k, v, kTimeout).ok());
    ASSERT_TRUE(sharded->Append(1, k, v, kTimeout).ok());
  }
  EXPECT_EQ(sharded->length(1), 180);
  EXPECT_EQ(sharded->length(0), 0);
  ASSERT_EQ(sharded->shards().size(), 3u);
  std::set<std::string> addresses;
  for (const Session& shard : sharded->shards()) {
    addresses.insert(shard.address());
  }
  EXPECT_EQ(addresses.size(), 3u) << "one shard per replica";
  EXPECT_EQ(sharded->shards()[0].length(1), kShard);
  EXPECT_EQ(sharded->shards()[2].length(1), 180 - 2 * kShard);

  v1::StepOptions options;
  options.set_return_lse(true);
  for (int step = 0; step < 6; ++step) {  // Crosses into a fourth shard.
    auto [k, v] = append(step == 3 ? 20 : 1, 5000 + step);
    const std::vector<float> query = RandomValues(kHeads * kDim, 6000 + step);
    const v1::Tensor q = MakeFloat32Tensor({kHeads, 1, kDim}, query);
    absl::StatusOr<StepOutput> single =
        one->Attend(1, k, v, q, options, kTimeout);
    absl::StatusOr<StepOutput> merged =
        sharded->Attend(1, k, v, q, options, kTimeout);
    ASSERT_TRUE(single.ok()) << single.status();
    ASSERT_TRUE(merged.ok()) << merged.status();
    EXPECT_EQ(merged->length, length);
    std::vector<float> all_keys, all_values;
    for (int64_t h = 0; h < kKvHeads; ++h) {
      all_keys.insert(all_keys.end(), key_heads[h].begin(), key_heads[h].end());
      all_values.insert(all_values.end(), value_heads[h].begin(),
                        value_heads[h].end());
    }
    const auto expected =
        ReferenceAttention({1, kHeads, kKvHeads, 1, length, kDim, kDim}, query,
                           all_keys, all_values);
    testing::ExpectNear("merged output", *FloatValues(*merged->output),
                        expected.output, testing::kOutputF32);
    testing::ExpectNear("merged lse", *FloatValues(*merged->lse), expected.lse,
                        testing::kLseF32);
    const std::vector<float> a = *FloatValues(*single->output);
    const std::vector<float> b = *FloatValues(*merged->output);
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_NEAR(a[i], b[i], 1e-5 * std::max(1.0f, std::abs(a[i])))
          << "against one session, step " << step << " at " << i;
    }
  }
  EXPECT_EQ(sharded->shards().size(), 4u);

  // Two query rows over more than one shard: refused, naming why.
  const v1::Tensor rows =
      MakeFloat32Tensor({kHeads, 2, kDim}, RandomValues(kHeads * 2 * kDim, 9));
  StepInputs two;
  two.layer = 1;
  two.query = rows;
  const absl::Status refused = sharded->Step(two, kTimeout).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("query holds 2 rows"));

  // A step crossing into the next shard with a malformed query appends
  // nothing anywhere: its earlier piece is not sent ahead of the refusal.
  const int64_t before = sharded->length(1);
  const int64_t tokens = kShard - before % kShard + 2;
  StepInputs bad = AttendInputs(
      1,
      MakeFloat32Tensor({kKvHeads, tokens, kDim},
                        RandomValues(kKvHeads * tokens * kDim, 10)),
      MakeFloat32Tensor({kKvHeads, tokens, kDim},
                        RandomValues(kKvHeads * tokens * kDim, 11)),
      MakeFloat32Tensor({kHeads, 1, kDim + 1},
                        RandomValues(kHeads * (kDim + 1), 12)),
      options);
  const absl::Status malformed = sharded->Step(bad, kTimeout).status();
  EXPECT_EQ(malformed.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(malformed.message()), HasSubstr("query must be"));
  EXPECT_EQ(sharded->length(1), before);
  int64_t held = 0;
  for (const Session& shard : sharded->shards()) held += shard.length(1);
  EXPECT_EQ(held, before);
  EXPECT_TRUE(sharded->Delete(kTimeout).ok());

  // What depends on a key's position in the whole sequence is refused.
  for (const auto& set : std::vector<std::function<void(v1::SessionDefaults&)>>{
           [](v1::SessionDefaults& d) { d.set_window_left(4); },
           [](v1::SessionDefaults& d) { d.set_num_sink_tokens(2); },
           [](v1::SessionDefaults& d) { d.add_alibi_slopes(0.5f); },
           [](v1::SessionDefaults& d) { d.mutable_rope(); }}) {
    v1::CreateSessionRequest positional = create;
    set(*positional.mutable_defaults());
    const absl::Status status =
        ShardedSession::Create(replicas->get(), positional, kShard, kTimeout)
            .status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()),
                HasSubstr("must be unset for a sharded session"));
  }
}

// A step whose query shard failed while its last shard appended: the append
// stands and lengths() says so, so the query alone is sent again and nothing
// is appended twice (it was, until 2026-12-06: the retried step appended its
// token again, and the output was off by 0.3 with no error). And a shard is
// still made when every replica to spare is down: on a holder; and a shard
// whose replica is gone ends the sharded session, which deletes the rest.
// Whether every thread of process `pid` has stopped (SIGSTOP reaches a thread
// running on another CPU, the io thread spinning, only as it is scheduled).
bool AllThreadsStopped(pid_t pid) {
  int threads = 0;
  std::error_code error;
  for (const auto& task : std::filesystem::directory_iterator(
           absl::StrCat("/proc/", pid, "/task"), error)) {
    std::ifstream stat(task.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const size_t name_end = line.rfind(')');
    if (name_end == std::string::npos || name_end + 2 >= line.size()) continue;
    const char state = line[name_end + 2];
    if (state != 'T' && state != 't') return false;
    ++threads;
  }
  return threads > 0;
}

TEST_F(ReplicasTest, ANewShardGoesToAHolderWhenTheSparesHang) {
  // Both replicas to spare stop answering (SIGSTOP), their channels
  // connected: they get half the step's time, and the new shard goes on the
  // replica holding shard 0 (they took it all, and the step failed
  // DEADLINE_EXCEEDED, until 2026-12-07).
  StartReplicas({});
  if (HasFatalFailure()) return;
  absl::StatusOr<std::unique_ptr<Replicas>> replicas =
      Replicas::Connect(Target());
  ASSERT_TRUE(replicas.ok()) << replicas.status();
  for (const std::string& address : (*replicas)->addresses()) {
    ASSERT_TRUE((*replicas)->client(address)->channel()->WaitForConnected(
        absl::ToChronoTime(absl::Now() + absl::Seconds(10))));
  }
  constexpr int64_t kHeads = 2, kDim = 8;
  v1::CreateSessionRequest create;
  create.set_num_layers(1);
  create.set_num_heads(kHeads);
  create.set_key_dim(kDim);
  create.set_dtype(v1::FLOAT32);
  absl::StatusOr<ShardedSession> sharded =
      ShardedSession::Create(replicas->get(), create, 2, kTimeout);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  const std::vector<float> keys = RandomValues(kHeads * 3 * kDim, 8000);
  const std::vector<float> values = RandomValues(kHeads * 3 * kDim, 8001);
  // [H, 3, D] split as tokens 0-1 and token 2.
  const auto tokens = [&](const std::vector<float>& all, int64_t from,
                          int64_t to) {
    std::vector<float> part;
    for (int64_t h = 0; h < kHeads; ++h) {
      part.insert(part.end(), all.begin() + (h * 3 + from) * kDim,
                  all.begin() + (h * 3 + to) * kDim);
    }
    return MakeFloat32Tensor({kHeads, to - from, kDim}, part);
  };
  ASSERT_TRUE(
      sharded->Append(0, tokens(keys, 0, 2), tokens(values, 0, 2), kTimeout)
          .ok());
  const std::string holder = sharded->shards()[0].address();
  std::vector<int> spares;
  for (int i = 0; i < kReplicas; ++i) {
    if (replicas_[i]->target() != holder) spares.push_back(i);
  }
  for (const int i : spares) replicas_[i]->Signal(SIGSTOP);
  for (const int i : spares) {
    EXPECT_TRUE(
        Eventually([&] { return AllThreadsStopped(replicas_[i]->pid()); },
                   absl::Seconds(10)));
  }
  const std::vector<float> query = RandomValues(kHeads * kDim, 8002);
  const absl::StatusOr<StepOutput> stepped =
      sharded->Attend(0, tokens(keys, 2, 3), tokens(values, 2, 3),
                      MakeFloat32Tensor({kHeads, 1, kDim}, query),
                      v1::StepOptions(), absl::Seconds(8));
  for (const int i : spares) replicas_[i]->Signal(SIGCONT);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  ASSERT_EQ(sharded->shards().size(), 2u);
  EXPECT_EQ(sharded->shards()[1].address(), holder);
  testing::ExpectNear("the step over 3 tokens on two shards",
                      *FloatValues(*stepped->output),
                      ReferenceAttention({1, kHeads, kHeads, 1, 3, kDim, kDim},
                                         query, keys, values)
                          .output,
                      testing::kOutputF32);
  EXPECT_TRUE(sharded->Delete(kTimeout).ok());
}

TEST_F(ReplicasTest, AShardedStepThatFailedHalfWayIsNotAppendedTwice) {
  StartReplicas({});
  if (HasFatalFailure()) return;
  absl::StatusOr<std::unique_ptr<Replicas>> replicas =
      Replicas::Connect(Target());
  ASSERT_TRUE(replicas.ok()) << replicas.status();
  constexpr int64_t kHeads = 2, kDim = 8, kShard = 4;
  v1::CreateSessionRequest create;
  create.set_num_layers(2);
  create.set_num_heads(kHeads);
  create.set_key_dim(kDim);
  create.set_dtype(v1::FLOAT32);
  absl::StatusOr<ShardedSession> sharded =
      ShardedSession::Create(replicas->get(), create, kShard, kTimeout);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  std::vector<std::vector<float>> keys(kHeads), values(kHeads);
  const auto tensors = [&](int64_t tokens, uint64_t seed) {
    const std::vector<float> k = RandomValues(kHeads * tokens * kDim, seed);
    const std::vector<float> v = RandomValues(kHeads * tokens * kDim, seed + 1);
    for (int64_t h = 0; h < kHeads; ++h) {
      keys[h].insert(keys[h].end(), k.begin() + h * tokens * kDim,
                     k.begin() + (h + 1) * tokens * kDim);
      values[h].insert(values[h].end(), v.begin() + h * tokens * kDim,
                       v.begin() + (h + 1) * tokens * kDim);
    }
    return std::make_pair(MakeFloat32Tensor({kHeads, tokens, kDim}, k),
                          MakeFloat32Tensor({kHeads, tokens, kDim}, v));
  };
  {
    auto [k, v] = tensors(6, 7000);  // Shards 0 and 1, on two replicas.
    ASSERT_TRUE(sharded->Append(0, k, v, kTimeout).ok());
  }
  ASSERT_EQ(sharded->shards().size(), 2u);
  const int first = IndexOf(sharded->shards()[0].address());
  ASSERT_GE(first, 0);
  replicas_[first]->Signal(SIGSTOP);
  auto [k, v] = tensors(1, 7100);
  const std::vector<float> query = RandomValues(kHeads * kDim, 7200);
  const v1::Tensor q = MakeFloat32Tensor({kHeads, 1, kDim}, query);
  v1::StepOptions options;
  const absl::StatusOr<StepOutput> failed =
      sharded->Attend(0, k, v, q, options, absl::Milliseconds(1500));
  replicas_[first]->Signal(SIGCONT);
  ASSERT_FALSE(failed.ok());
  EXPECT_THAT(std::string(failed.status().message()),
              ::testing::HasSubstr("the step's append stands (length() is 7)"));
  EXPECT_EQ(sharded->length(0), 7);
  StepInputs again;
  again.layer = 0;
  again.query = q;
  const absl::StatusOr<StepOutput> answered =
      sharded->Step(std::move(again), kTimeout);
  ASSERT_TRUE(answered.ok()) << answered.status();
  EXPECT_EQ(answered->length, 7);
  std::vector<float> all_keys, all_values;
  for (int64_t h = 0; h < kHeads; ++h) {
    all_keys.insert(all_keys.end(), keys[h].begin(), keys[h].end());
    all_values.insert(all_values.end(), values[h].begin(), values[h].end());
  }
  testing::ExpectNear("the step over 7 tokens", *FloatValues(*answered->output),
                      ReferenceAttention({1, kHeads, kHeads, 1, 7, kDim, kDim},
                                         query, all_keys, all_values)
                          .output,
                      testing::kOutputF32);

  // The third replica, the one spare, goes: shard 2 goes on a holder.
  std::set<int> holding;
  for (const Session& shard : sharded->shards()) {
    holding.insert(IndexOf(shard.address()));
  }
  for (int i = 0; i < kReplicas; ++i) {
    if (holding.count(i) == 0) replicas_[i]->Signal(SIGKILL);
  }
  auto [k2, v2] = tensors(2, 7300);  // Tokens 7 and 8: shard 2 starts.
  const absl::Status grown = sharded->Append(0, k2, v2, kTimeout);
  ASSERT_TRUE(grown.ok()) << grown;
  ASSERT_EQ(sharded->shards().size(), 3u);
  EXPECT_EQ(holding.count(IndexOf(sharded->shards()[2].address())), 1u);
  EXPECT_EQ(sharded->length(0), 9);

  // Shard 0's replica goes, and its tokens with it: the step says the
  // sharded session is not rebuilt (not "send the query again"), and Delete
  // deletes every shard it can reach, again and again.
  const int lost = IndexOf(sharded->shards()[0].address());
  replicas_[lost]->Signal(SIGKILL);
  ASSERT_FALSE(replicas_[lost]->Wait(absl::Seconds(10)).ok());
  auto [k3, v3] = tensors(1, 7400);
  const absl::StatusOr<StepOutput> gone =
      sharded->Attend(0, k3, v3, q, options, kTimeout);
  ASSERT_FALSE(gone.ok());
  EXPECT_TRUE(IsReplicaGone(gone.status())) << gone.status();
  EXPECT_THAT(std::string(gone.status().message()),
              ::testing::StartsWith("shard 0: "));
  EXPECT_THAT(std::string(gone.status().message()),
              HasSubstr("a sharded session is not rebuilt: Delete() it"));
  EXPECT_THAT(std::string(gone.status().message()),
              ::testing::Not(HasSubstr("send the query again")));
  // Not the Session's advice to rebuild the shard, which would be refused.
  EXPECT_THAT(std::string(gone.status().message()),
              ::testing::Not(HasSubstr("Session::Rebuild")));
  // Every later step touching the lost shard's tokens is refused, an append
  // to the last shard alone too (it was taken, the layer holding a hole,
  // until 2026-12-07).
  for (const bool with_query : {false, true}) {
    auto [k4, v4] = tensors(1, 7500);
    const absl::Status refused =
        with_query ? sharded->Attend(0, k4, v4, q, options, kTimeout).status()
                   : sharded->Append(0, k4, v4, kTimeout);
    EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
    EXPECT_THAT(std::string(refused.message()),
                ::testing::MatchesRegex(
                    "shard 0 \\(session .* at .*\\) was lost with its "
                    "replica, and with it layer 0's tokens from 0: .*"));
  }
  // A query on a layer with no tokens asks shard 0 alone: told the same.
  StepInputs empty;
  empty.layer = 1;
  empty.query = q;
  empty.options = options;
  const absl::StatusOr<StepOutput> nothing =
      sharded->Step(std::move(empty), kTimeout);
  ASSERT_FALSE(nothing.ok());
  EXPECT_TRUE(IsReplicaGone(nothing.status())) << nothing.status();
  EXPECT_THAT(
      std::string(nothing.status().message()),
      AllOf(::testing::StartsWith("shard 0: "),
            HasSubstr("a sharded session is not rebuilt: Delete() it")));
  for (int round = 0; round < 2; ++round) {
    const absl::Status deleted = sharded->Delete(kTimeout);
    EXPECT_TRUE(IsReplicaGone(deleted)) << deleted;
    EXPECT_THAT(std::string(deleted.message()),
                ::testing::StartsWith("shard 0: "));
    for (const Session& shard : sharded->shards()) {
      if (IndexOf(shard.address()) == lost) continue;
      EXPECT_TRUE(shard.deleted());
      EXPECT_TRUE(absl::IsNotFound((*replicas)
                                       ->client(shard.address())
                                       ->GetSession(shard.id(), kTimeout)
                                       .status()));
    }
  }
}

}  // namespace
}  // namespace attnserve
