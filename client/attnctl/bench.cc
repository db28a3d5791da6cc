#include "bench.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/barrier.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/common/flops.h"
#include "bench_report.h"
#include "cli.h"
#include "request_flags.h"
#include "weights.h"

ABSL_FLAG(int32_t, concurrency, 4,
          "bench: workers, each with one call in flight (1 to 1024).");
ABSL_FLAG(absl::Duration, duration, absl::ZeroDuration(),
          "bench: measure for this long (up to 1h); this or --requests.");
ABSL_FLAG(int64_t, requests, 0,
          "bench: measure this many calls in all (up to 1e9); this or "
          "--duration. With both, whichever ends first.");
ABSL_FLAG(absl::Duration, warmup, absl::ZeroDuration(),
          "bench: call for this long first, uncounted (up to 10m).");
ABSL_FLAG(std::string, rpc, "attend", "bench: attend or mha.");
ABSL_FLAG(bool, json, false, "bench: print the report as one JSON object.");

namespace attnserve {
namespace {

constexpr int kMaxConcurrency = 1024;
constexpr int64_t kMaxRequests = 1'000'000'000;

// One synchronous call; its status.
using Call = std::function<absl::Status()>;

struct LoopConfig {
  int concurrency = 1;
  absl::Duration warmup;
  absl::Duration duration = absl::InfiniteDuration();
  int64_t requests = kMaxRequests;
};

// What one worker saw; each worker owns one, merged after the join.
struct WorkerTally {
  LatencyHistogram latencies;
  std::map<absl::StatusCode, int64_t> errors;
  int64_t warmup_requests = 0;
  int64_t requests = 0;
};

// What a bench calls, and how the report describes it.
struct BenchTarget {
  std::string shape;
  std::string input_dtype;
  double flops_per_request = 0.0;
  Call call;
};

absl::StatusOr<LoopConfig> LoopConfigFromFlags() {
  LoopConfig config;
  config.concurrency = absl::GetFlag(FLAGS_concurrency);
  config.warmup = absl::GetFlag(FLAGS_warmup);
  const absl::Duration duration = absl::GetFlag(FLAGS_duration);
  const int64_t requests = absl::GetFlag(FLAGS_requests);
  if (config.concurrency < 1 || config.concurrency > kMaxConcurrency) {
    return absl::InvalidArgumentError(
        absl::StrCat("--concurrency is ", config.concurrency,
                     ", expected 1 to ", kMaxConcurrency));
  }
  if (config.warmup < absl::ZeroDuration() ||
      config.warmup > absl::Minutes(10)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--warmup is ", absl::FormatDuration(config.warmup),
                     ", expected 0 to 10m"));
  }
  if (duration < absl::ZeroDuration() || duration > absl::Hours(1) ||
      requests < 0 || requests > kMaxRequests ||
      (duration == absl::ZeroDuration() && requests == 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bench needs --duration (up to 1h) or --requests (up to ", kMaxRequests,
        "); got --duration=", absl::FormatDuration(duration),
        " --requests=", requests));
  }
  if (duration > absl::ZeroDuration()) config.duration = duration;
  if (requests > 0) config.requests = requests;
  return config;
}

// Calls until `warmup_end`, waits at `barrier` for every worker, then calls
// until the measured phase ends.
void RunWorker(const LoopConfig& config, const Call& call,
               absl::Time warmup_end, absl::Barrier& barrier,
               std::atomic<int64_t>& issued, WorkerTally& tally) {
  while (absl::Now() < warmup_end) {
    call().IgnoreError();
    ++tally.warmup_requests;
  }
  barrier.Block();
  const absl::Time end = absl::Now() + config.duration;
  while (absl::Now() < end &&
         issued.fetch_add(1, std::memory_order_relaxed) < config.requests) {
    const absl::Time start = absl::Now();
    const absl::Status status = call();
    const absl::Duration latency = absl::Now() - start;
    ++tally.requests;
    if (status.ok()) {
      tally.latencies.Record(latency);
    } else {
      ++tally.errors[status.code()];
    }
  }
}

// Runs the closed loop; fills the measured fields of `report`.
void RunClosedLoop(const LoopConfig& config, const Call& call,
                   BenchReport& report) {
  std::vector<WorkerTally> tallies(config.concurrency);
  std::atomic<int64_t> issued{0};
  absl::Barrier barrier(config.concurrency + 1);
  const absl::Time warmup_end = absl::Now() + config.warmup;
  std::vector<std::thread> workers;
  workers.reserve(config.concurrency);
  for (WorkerTally& tally : tallies) {
    workers.emplace_back(RunWorker, std::cref(config), std::cref(call),
                         warmup_end, std::ref(barrier), std::ref(issued),
                         std::ref(tally));
  }
  barrier.Block();
  const absl::Time start = absl::Now();
  for (std::thread& worker : workers) worker.join();
  report.elapsed = absl::Now() - start;
  for (const WorkerTally& tally : tallies) {
    report.latencies.Merge(tally.latencies);
    for (const auto& [code, count] : tally.errors) report.errors[code] += count;
    report.warmup_requests += tally.warmup_requests;
    report.requests += tally.requests;
  }
}

// Prepares Attend calls; returns the exit status of a failure, else kExitOk.
int PrepareAttend(Client& client, BenchTarget& target) {
  absl::StatusOr<v1::AttendRequest> request =
      AttendRequestFromFlags(InputMode::kFilesOrRandom);
  if (!request.ok()) return UsageError(request.status());
  const v1::Tensor& query = request->query();
  const v1::Tensor& key = request->key();
  const v1::Tensor& value = request->value();
  if (query.shape_size() == 4 && key.shape_size() == 4 &&
      value.shape_size() == 4) {
    target.shape = absl::StrCat("B=", query.shape(0), " H=", query.shape(1),
                                " Hkv=", key.shape(1), " Lq=", query.shape(2),
                                " Lk=", key.shape(2), " Dk=", query.shape(3),
                                " Dv=", value.shape(3));
    const AttentionDims dims{static_cast<double>(query.shape(0)),
                             static_cast<double>(query.shape(1)),
                             static_cast<double>(query.shape(2)),
                             static_cast<double>(key.shape(2)),
                             static_cast<double>(query.shape(3)),
                             static_cast<double>(value.shape(3))};
    target.flops_per_request =
        AttentionFlops(dims, request->options().causal());
  }
  target.input_dtype = v1::DType_Name(query.dtype());
  auto shared = std::make_shared<const v1::AttendRequest>(*std::move(request));
  target.call = [&client, shared, timeout = CallTimeout()] {
    return client.Attend(*shared, timeout).status();
  };
  return kExitOk;
}

// Prepares MultiHeadAttention calls; returns the exit status of a failure,
// else kExitOk.
int PrepareMultiHead(Client& client, BenchTarget& target) {
  absl::StatusOr<MultiHeadDraft> draft =
      MultiHeadDraftFromFlags(InputMode::kFilesOrRandom);
  if (!draft.ok()) return UsageError(draft.status());
  v1::MultiHeadAttentionRequest& request = draft->request;
  absl::StatusOr<v1::WeightsInfo> info = WeightsInfoFor(client, request);
  if (!info.ok()) return Fail(info.status());
  if (draft->needs_random_inputs) {
    const absl::Status added = AddRandomMultiHeadInputs(*info, &request);
    if (!added.ok()) return UsageError(added);
  }
  const v1::Tensor& input = request.query_input();
  const v1::Tensor& kv_input =
      request.has_kv_input() ? request.kv_input() : input;
  if (input.shape_size() == 3 && kv_input.shape_size() == 3) {
    const double batch = input.shape(0), query_len = input.shape(1),
                 key_len = kv_input.shape(1);
    const double embed = info->embed_dim(), kv_embed = info->kv_embed_dim(),
                 heads = info->num_heads(), kv_heads = info->num_kv_heads(),
                 key_dim = info->key_dim(), value_dim = info->value_dim();
    target.shape = absl::StrCat(
        "B=", input.shape(0), " Lq=", input.shape(1), " Lk=", kv_input.shape(1),
        " E=", info->embed_dim(), " Ekv=", info->kv_embed_dim(),
        " H=", info->num_heads(), " Hkv=", info->num_kv_heads(),
        " Dk=", info->key_dim(), " Dv=", info->value_dim());
    target.flops_per_request =
        MultiHeadFlops({batch, heads, query_len, key_len, key_dim, value_dim},
                       {embed, kv_embed, kv_heads}, request.options().causal());
  }
  target.input_dtype = v1::DType_Name(input.dtype());
  auto shared =
      std::make_shared<const v1::MultiHeadAttentionRequest>(std::move(request));
  target.call = [&client, shared, timeout = CallTimeout()] {
    return client.MultiHeadAttention(*shared, timeout).status();
  };
  return kExitOk;
}

}  // namespace

int RunBench(Client& client) {
  absl::StatusOr<LoopConfig> config = LoopConfigFromFlags();
  if (!config.ok()) return UsageError(config.status());
  BenchReport report;
  report.rpc = absl::AsciiStrToLower(absl::GetFlag(FLAGS_rpc));
  BenchTarget target;
  int prepared = kExitOk;
  if (report.rpc == "attend") {
    prepared = PrepareAttend(client, target);
  } else if (report.rpc == "mha") {
    prepared = PrepareMultiHead(client, target);
  } else {
    return UsageError(absl::InvalidArgumentError(absl::StrCat(
        "--rpc is '", absl::GetFlag(FLAGS_rpc), "', expected attend or mha")));
  }
  if (prepared != kExitOk) return prepared;
  report.shape = target.shape;
  report.input_dtype = target.input_dtype;
  report.flops_per_request = target.flops_per_request;
  report.concurrency = config->concurrency;
  report.warmup = config->warmup;

  RunClosedLoop(*config, target.call, report);
  const std::string text = absl::GetFlag(FLAGS_json) ? FormatBenchJson(report)
                                                     : FormatBenchText(report);
  std::fputs(text.c_str(), stdout);
  return report.latencies.count() > 0 ? kExitOk : kExitCallFailed;
}

}  // namespace attnserve
