// A decode step on one session sharded over several replicas against a step
// on one replica holding one shard's worth of tokens (issue #24's "131,072
// tokens over 4 replicas within 1.3x of a 32,768-token step on one").
// bench/sharded_decode.sh starts the servers and runs it.
//
//   sharded_decode_bench --sharded=ipv4:127.0.0.1:p1,... --single=127.0.0.1:p0
//       [--tokens=131072] [--shards=4] [--steps=40] [--heads=32] [--kv_heads=8]
//       [--dim=128] [--dtype=bf16]
//
// Both sessions are prefilled with the same random tokens in chunks, then
// each runs --steps decode steps (one token appended, one query row), the
// single and the sharded one alternating so that both see the same machine;
// it prints each one's p50 and p90 step time (client wall clock, the merge
// included) and their ratio.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/client/client.h"
#include "attnserve/client/replicas.h"
#include "attnserve/client/session.h"
#include "attnserve/client/sharded_session.h"

namespace attnserve {
namespace {

struct Flags {
  std::string sharded, single;
  int64_t tokens = 131072, shards = 4, steps = 40, heads = 32, kv_heads = 8,
          dim = 128;
  v1::DType dtype = v1::BFLOAT16;
};

bool ParseFlags(int argc, char** argv, Flags* flags) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    if (!absl::StartsWith(arg, "--") || eq == std::string::npos) return false;
    const std::string name = arg.substr(2, eq - 2), value = arg.substr(eq + 1);
    int64_t* number = name == "tokens"     ? &flags->tokens
                      : name == "shards"   ? &flags->shards
                      : name == "steps"    ? &flags->steps
                      : name == "heads"    ? &flags->heads
                      : name == "kv_heads" ? &flags->kv_heads
                      : name == "dim"      ? &flags->dim
                                           : nullptr;
    if (number != nullptr) {
      if (!absl::SimpleAtoi(value, number) || *number < 1) return false;
    } else if (name == "sharded") {
      flags->sharded = value;
    } else if (name == "single") {
      flags->single = value;
    } else if (name == "dtype") {
      if (value == "f32") {
        flags->dtype = v1::FLOAT32;
      } else if (value == "bf16") {
        flags->dtype = v1::BFLOAT16;
      } else if (value == "f16") {
        flags->dtype = v1::FLOAT16;
      } else {
        return false;
      }
    } else {
      return false;
    }
  }
  return !flags->sharded.empty() && !flags->single.empty() &&
         flags->tokens % flags->shards == 0;
}

void Check(const absl::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what, status.ToString().c_str());
  std::exit(1);
}

double Percentile(std::vector<double> values, double p) {
  std::sort(values.begin(), values.end());
  return values[static_cast<size_t>(p * (values.size() - 1))];
}

int Run(const Flags& f) {
  constexpr absl::Duration kTimeout = absl::Seconds(120);
  const int64_t shard_tokens = f.tokens / f.shards;
  v1::CreateSessionRequest create;
  create.set_num_layers(1);
  create.set_num_heads(f.heads);
  create.set_num_kv_heads(f.kv_heads);
  create.set_key_dim(f.dim);
  create.set_dtype(f.dtype);

  absl::StatusOr<std::unique_ptr<Client>> single_client =
      Client::Connect(f.single);
  Check(single_client.status(), "connecting to --single");
  absl::StatusOr<Session> single =
      Session::Create(single_client->get(), create, kTimeout);
  Check(single.status(), "creating the single session");
  absl::StatusOr<std::unique_ptr<Replicas>> replicas =
      Replicas::Connect(f.sharded);
  Check(replicas.status(), "resolving --sharded");
  absl::StatusOr<ShardedSession> sharded =
      ShardedSession::Create(replicas->get(), create, shard_tokens, kTimeout);
  Check(sharded.status(), "creating the sharded session");

  // Prefill: one random chunk, sent again and again (the values do not
  // change the time).
  const int64_t chunk = std::min<int64_t>(4096, shard_tokens);
  std::mt19937 random(7);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(f.kv_heads * chunk * f.dim));
  for (float& v : values) v = uniform(random);
  const v1::Tensor block =
      MakeTensor(f.dtype, {f.kv_heads, chunk, f.dim}, values);
  const absl::Time prefill_started = absl::Now();
  for (int64_t at = 0; at < f.tokens; at += chunk) {
    Check(sharded->Append(0, block, block, kTimeout), "prefilling sharded");
    if (at < shard_tokens) {
      Check(single->Append(0, block, block, kTimeout), "prefilling single");
    }
  }
  std::printf("prefilled %lld + %lld tokens in %.1f s\n",
              static_cast<long long>(f.tokens),
              static_cast<long long>(shard_tokens),
              absl::ToDoubleSeconds(absl::Now() - prefill_started));

  std::vector<float> one(static_cast<size_t>(f.kv_heads * f.dim));
  for (float& v : one) v = uniform(random);
  const v1::Tensor token = MakeTensor(f.dtype, {f.kv_heads, 1, f.dim}, one);
  std::vector<float> q(static_cast<size_t>(f.heads * f.dim));
  for (float& v : q) v = uniform(random);
  const v1::Tensor query = MakeTensor(f.dtype, {f.heads, 1, f.dim}, q);
  std::vector<double> single_ms, sharded_ms;
  for (int64_t step = 0; step < f.steps + 2; ++step) {  // 2 warm-up steps
    absl::Time t = absl::Now();
    Check(single->Attend(0, token, token, query, v1::StepOptions(), kTimeout)
              .status(),
          "single step");
    const double a = absl::ToDoubleMilliseconds(absl::Now() - t);
    t = absl::Now();
    Check(sharded->Attend(0, token, token, query, v1::StepOptions(), kTimeout)
              .status(),
          "sharded step");
    const double b = absl::ToDoubleMilliseconds(absl::Now() - t);
    if (step >= 2) {
      single_ms.push_back(a);
      sharded_ms.push_back(b);
    }
  }
  const double single_p50 = Percentile(single_ms, 0.5);
  const double sharded_p50 = Percentile(sharded_ms, 0.5);
  std::printf("one replica, %lld tokens: step p50 %.2f ms, p90 %.2f ms\n",
              static_cast<long long>(shard_tokens + f.steps + 2), single_p50,
              Percentile(single_ms, 0.9));
  std::printf(
      "%lld shards on %zu replicas, %lld tokens: step p50 %.2f ms, p90 %.2f "
      "ms\n",
      static_cast<long long>(f.shards), (*replicas)->addresses().size(),
      static_cast<long long>(f.tokens + f.steps + 2), sharded_p50,
      Percentile(sharded_ms, 0.9));
  std::printf("sharded / one replica: %.2fx\n", sharded_p50 / single_p50);
  Check(sharded->Delete(kTimeout), "deleting the sharded session");
  Check(single->Delete(kTimeout), "deleting the single session");
  return 0;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  attnserve::Flags flags;
  if (!attnserve::ParseFlags(argc, argv, &flags)) {
    std::fprintf(stderr,
                 "usage: %s --sharded=TARGET --single=TARGET [--tokens=131072] "
                 "[--shards=4] [--steps=40] [--heads=32] [--kv_heads=8] "
                 "[--dim=128] [--dtype=bf16|f16|f32] (tokens a multiple of "
                 "shards)\n",
                 argv[0]);
    return 2;
  }
  return attnserve::Run(flags);
}
