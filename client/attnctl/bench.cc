#include "bench.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/client/session.h"
#include "attnserve/common/flops.h"
#include "bench_report.h"
#include "cli.h"
#include "request_flags.h"
#include "weights.h"

// Defined with the other random-input flags (request_flags.cc).
ABSL_DECLARE_FLAG(uint64_t, seed);

ABSL_FLAG(int32_t, concurrency, 4,
          "bench: workers, each with one call in flight (1 to 1024).");
ABSL_FLAG(absl::Duration, duration, absl::ZeroDuration(),
          "bench: measure for this long (up to 1h); this or --requests.");
ABSL_FLAG(int64_t, requests, 0,
          "bench: measure this many calls in all (up to 1e9); this or "
          "--duration. With both, whichever ends first.");
ABSL_FLAG(absl::Duration, warmup, absl::ZeroDuration(),
          "bench: call for this long first, uncounted (up to 10m).");
ABSL_FLAG(std::string, rpc, "attend", "bench: attend, mha or step.");
ABSL_FLAG(int64_t, sessions, 4,
          "bench --rpc=step: KV-cache sessions decoded together (1 to 1024).");
ABSL_FLAG(int64_t, context, 1024,
          "bench --rpc=step: tokens each session is prefilled with.");
ABSL_FLAG(int64_t, steps, 64,
          "bench --rpc=step: decode steps measured (1 to 1e6), after one "
          "uncounted.");
ABSL_FLAG(bool, compare_stateless, false,
          "bench --rpc=step: also decode the same shapes with Attend calls "
          "that carry the whole context, in turns with the steps (a tenth "
          "of them each), and compare.");
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

// Where the threads and the main thread wait for each other: before the
// warm-up, and between it and the measured phase. Unlike absl::Barrier it can
// be opened before everyone came, for threads that could not be started.
class StartGate {
 public:
  explicit StartGate(int parties) : missing_(parties) {}

  // Waits for the other parties or for Abandon(); the time the last party
  // arrived, when the measured phase starts for all of them alike, or nothing
  // if it is not to run.
  std::optional<absl::Time> Arrive() {
    absl::MutexLock lock(&mutex_);
    if (--missing_ == 0) opened_ = absl::Now();
    mutex_.Await(absl::Condition(
        +[](StartGate* gate) {
          return gate->missing_ <= 0 || gate->abandoned_;
        },
        this));
    if (abandoned_) return std::nullopt;
    return opened_;
  }

  // Releases everyone waiting, or to come, with Arrive() false.
  void Abandon() {
    absl::MutexLock lock(&mutex_);
    abandoned_ = true;
  }

 private:
  absl::Mutex mutex_;
  int missing_ ABSL_GUARDED_BY(mutex_);
  bool abandoned_ ABSL_GUARDED_BY(mutex_) = false;
  absl::Time opened_ ABSL_GUARDED_BY(mutex_);
};

// Threads started beside the workers and ended before the first call: the
// room they held (stack address space, a task each) is left for gRPC's own
// threads, which it starts while calls run and cannot do without.
constexpr int kSpareThreads = 8;

// Waits at `launch` until every worker and spare thread exists, then for
// `spares_ended`; calls until the warm-up ends, waits at `measure` for every
// worker, then calls until the measured phase ends.
void RunWorker(const LoopConfig& config, const Call& call, StartGate& launch,
               const absl::Notification& spares_ended, StartGate& measure,
               std::atomic<int64_t>& issued, WorkerTally& tally) {
  if (!launch.Arrive()) return;
  spares_ended.WaitForNotification();
  const absl::Time warmup_end = absl::Now() + config.warmup;
  while (absl::Now() < warmup_end) {
    call().IgnoreError();
    ++tally.warmup_requests;
  }
  // Every worker's phase, and the elapsed time, count from one instant: a
  // worker's own clock read after the gate opened would end its phase late,
  // and the report's elapsed time short of --duration.
  const std::optional<absl::Time> opened = measure.Arrive();
  if (!opened) return;
  const absl::Time end = *opened + config.duration;
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
// RESOURCE_EXHAUSTED, with no call made, if the system would not start every
// worker thread and the spares; the caller must then end the process without
// shutting gRPC down (see RunBench).
absl::Status RunClosedLoop(const LoopConfig& config, const Call& call,
                           BenchReport& report) {
  std::vector<WorkerTally> tallies(config.concurrency);
  std::atomic<int64_t> issued{0};
  // No call is made until every thread exists: calls made while the system
  // refuses threads would have gRPC refused its own too.
  StartGate launch(config.concurrency + kSpareThreads + 1);
  absl::Notification spares_ended;
  StartGate measure(config.concurrency + 1);
  std::vector<std::thread> workers;
  std::vector<std::thread> spares;
  workers.reserve(config.concurrency);
  spares.reserve(kSpareThreads);
  absl::Status started;
  for (int i = 0; i < config.concurrency + kSpareThreads; ++i) {
    try {
      if (i < config.concurrency) {
        workers.emplace_back(RunWorker, std::cref(config), std::cref(call),
                             std::ref(launch), std::cref(spares_ended),
                             std::ref(measure), std::ref(issued),
                             std::ref(tallies[i]));
      } else {
        spares.emplace_back([&launch] { launch.Arrive(); });
      }
    } catch (const std::system_error& error) {
      started = absl::ResourceExhaustedError(absl::StrCat(
          "started ", workers.size(), " of --concurrency=", config.concurrency,
          " worker threads and ", spares.size(), " of the ", kSpareThreads,
          " spare ones that keep room for gRPC's own: ", error.what()));
      launch.Abandon();
      measure.Abandon();
      break;
    }
  }
  const bool launched = launch.Arrive().has_value();
  for (std::thread& spare : spares) spare.join();
  spares_ended.Notify();
  const std::optional<absl::Time> start =
      launched ? measure.Arrive() : std::nullopt;
  for (std::thread& worker : workers) worker.join();
  if (!start) return started;
  report.elapsed = absl::Now() - *start;
  for (const WorkerTally& tally : tallies) {
    report.latencies.Merge(tally.latencies);
    for (const auto& [code, count] : tally.errors) report.errors[code] += count;
    report.warmup_requests += tally.warmup_requests;
    report.requests += tally.requests;
  }
  return absl::OkStatus();
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
        AttentionFlops(dims, request->options().causal(),
                       request->options().causal_alignment() ==
                           v1::AttentionOptions::BOTTOM_RIGHT);
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
                       {embed, kv_embed, kv_heads}, request.options().causal(),
                       request.options().causal_alignment() ==
                           v1::AttentionOptions::BOTTOM_RIGHT);
  }
  target.input_dtype = v1::DType_Name(input.dtype());
  auto shared =
      std::make_shared<const v1::MultiHeadAttentionRequest>(std::move(request));
  target.call = [&client, shared, timeout = CallTimeout()] {
    return client.MultiHeadAttention(*shared, timeout).status();
  };
  return kExitOk;
}

constexpr int64_t kMaxSessions = 1024;
constexpr int64_t kMaxSteps = 1'000'000;
constexpr int64_t kMaxContext = int64_t{1} << 24;

struct DecodeConfig {
  int64_t sessions = 0;
  int64_t context = 0;
  int64_t steps = 0;
  bool compare_stateless = false;
};

absl::StatusOr<DecodeConfig> DecodeConfigFromFlags() {
  DecodeConfig config;
  config.sessions = absl::GetFlag(FLAGS_sessions);
  config.context = absl::GetFlag(FLAGS_context);
  config.steps = absl::GetFlag(FLAGS_steps);
  config.compare_stateless = absl::GetFlag(FLAGS_compare_stateless);
  if (config.sessions < 1 || config.sessions > kMaxSessions ||
      config.context < 0 || config.context > kMaxContext || config.steps < 1 ||
      config.steps > kMaxSteps) {
    return absl::InvalidArgumentError(
        absl::StrCat("bench --rpc=step needs --sessions in [1, ", kMaxSessions,
                     "], --context in [0, 2^24] and --steps in [1, ", kMaxSteps,
                     "]; got --sessions=", config.sessions,
                     " --context=", config.context, " --steps=", config.steps));
  }
  return config;
}

// Bytes of one element of `dtype` as sent.
int64_t ElementBytes(v1::DType dtype) { return dtype == v1::FLOAT32 ? 4 : 2; }

// Fills each session's every layer with `context` random tokens, in chunks
// of at most a quarter of --max_message_bytes.
absl::Status Prefill(std::vector<Session>& sessions, int64_t context) {
  if (context == 0 || sessions.empty()) return absl::OkStatus();
  const v1::SessionInfo& info = sessions[0].info();
  const int64_t token_bytes =
      info.num_kv_heads() * (info.key_dim() + info.value_dim()) * 4;
  // At most 2^20 tokens a step, the most a step's tensors may hold.
  const int64_t chunk = std::clamp<int64_t>(
      MaxMessageBytes() / 4 / std::max<int64_t>(token_bytes, 1), 1,
      std::min<int64_t>(context, int64_t{1} << 20));
  for (int64_t layer = 0; layer < info.num_layers(); ++layer) {
    // One random chunk per size, sent to every session: the values do not
    // matter to the timing.
    std::map<int64_t, StepInputs> chunks;
    for (Session& session : sessions) {
      for (int64_t done = 0; done < context;) {
        const int64_t tokens = std::min(chunk, context - done);
        auto it = chunks.find(tokens);
        if (it == chunks.end()) {
          absl::StatusOr<StepInputs> inputs =
              RandomStepInputs(info, layer, tokens, 0, 7 + tokens);
          if (!inputs.ok()) return inputs.status();
          it = chunks.emplace(tokens, *std::move(inputs)).first;
        }
        absl::StatusOr<StepOutput> out =
            session.Step(it->second, CallTimeout());
        if (!out.ok()) return out.status();
        done += tokens;
      }
    }
  }
  return absl::OkStatus();
}

// Times decode steps [first, last] of `phase` (step 0, uncounted, warms it
// up before its first), each made of one call per layer; `call(step, layer,
// &request_bytes, &response_bytes)` makes one. Returns false once a step
// failed.
bool RunDecodePhase(int64_t first, int64_t last, int64_t layers,
                    const std::function<absl::Status(int64_t, int64_t, int64_t*,
                                                     int64_t*)>& call,
                    DecodePhase& phase) {
  int64_t scratch = 0;
  for (int64_t layer = 0; first == 1 && layer < layers; ++layer) {
    if (!call(0, layer, &scratch, &scratch).ok()) break;  // Warm-up.
  }
  const absl::Time start = absl::Now();
  bool ok = true;
  for (int64_t step = first; step <= last; ++step) {
    ++phase.steps;
    const absl::Time step_start = absl::Now();
    int64_t request_bytes = 0, response_bytes = 0;
    absl::Status status;
    for (int64_t layer = 0; layer < layers && status.ok(); ++layer) {
      status = call(step, layer, &request_bytes, &response_bytes);
    }
    if (!status.ok()) {
      // The sessions' lengths are not known past a failed step.
      ++phase.errors[status.code()];
      ok = false;
      break;
    }
    phase.latencies.Record(absl::Now() - step_start);
    phase.request_bytes += request_bytes;
    phase.response_bytes += response_bytes;
  }
  phase.elapsed += absl::Now() - start;
  return ok;
}

// The first failed result of `response`, else OK.
absl::Status FirstStepError(const v1::StepResponse& response) {
  for (const v1::StepResult& result : response.results()) {
    if (result.has_error() && result.error().code() != 0) {
      return absl::Status(static_cast<absl::StatusCode>(result.error().code()),
                          result.error().message());
    }
  }
  return absl::OkStatus();
}

// bench --rpc=step: create --sessions sessions, prefill --context tokens
// each, then time --steps decode steps of one token per session (one Step
// call per layer carrying every session's step); with --compare_stateless,
// the same decode as Attend calls carrying the whole context.
int RunDecodeBench(Client& client) {
  absl::StatusOr<DecodeConfig> config = DecodeConfigFromFlags();
  if (!config.ok()) return UsageError(config.status());
  absl::StatusOr<v1::CreateSessionRequest> create =
      CreateSessionRequestFromFlags();
  if (!create.ok()) return UsageError(create.status());
  if (create->max_tokens() == 0) {
    create->set_max_tokens(config->context + config->steps + 1);
  }
  DecodeBenchReport report;
  report.sessions = config->sessions;
  report.cache_dtype = v1::DType_Name(create->dtype());

  const absl::Time prefill_start = absl::Now();
  std::vector<Session> sessions;
  const auto cleanup = [&] {
    for (Session& session : sessions)
      session.Delete(CallTimeout()).IgnoreError();
  };
  for (int64_t i = 0; i < config->sessions; ++i) {
    absl::StatusOr<Session> session =
        Session::Create(&client, *create, CallTimeout());
    if (!session.ok()) {
      cleanup();
      return Fail(session.status());
    }
    sessions.push_back(*std::move(session));
  }
  const v1::SessionInfo info = sessions[0].info();
  // Checked before the prefill, which may take minutes; its making is not
  // the prefill's time.
  const absl::Time making = absl::Now();
  std::optional<v1::AttendRequest> attend;
  if (config->compare_stateless) {
    // One Attend per layer with B = the sessions, over the context the first
    // decode step sees: the shapes of the Step phase, every key and value
    // shipped every time.
    absl::StatusOr<v1::AttendRequest> request = RandomDecodeAttendRequest(
        info, config->sessions, config->context + 1, absl::GetFlag(FLAGS_seed));
    if (!request.ok()) {
      cleanup();
      return UsageError(request.status());
    }
    attend = *std::move(request);
  }
  const absl::Duration made = absl::Now() - making;
  const absl::Status prefilled = Prefill(sessions, config->context);
  if (!prefilled.ok()) {
    cleanup();
    return Fail(prefilled);
  }
  report.prefill = absl::Now() - prefill_start - made;

  // One request per layer, every session's one-token step; each decode step
  // only moves the expected lengths on.
  const int64_t layers = info.num_layers();
  std::vector<v1::StepRequest> requests(layers);
  for (int64_t layer = 0; layer < layers; ++layer) {
    absl::StatusOr<StepInputs> inputs =
        RandomStepInputs(info, layer, 1, 1, absl::GetFlag(FLAGS_seed) + layer);
    if (!inputs.ok()) {
      cleanup();
      return UsageError(inputs.status());
    }
    report.input_dtype = v1::DType_Name(inputs->query->dtype());
    for (Session& session : sessions) {
      *requests[layer].add_steps() =
          session.BuildStep(*inputs, session.length(layer));
    }
  }
  const v1::DType input_dtype = requests[0].steps(0).query().dtype();
  const v1::DType output_dtype =
      requests[0].steps(0).options().output_dtype() == v1::DTYPE_UNSPECIFIED
          ? input_dtype
          : requests[0].steps(0).options().output_dtype();
  report.payload_bytes_per_step =
      layers * config->sessions *
      ((info.num_heads() * info.key_dim() +
        info.num_kv_heads() * (info.key_dim() + info.value_dim())) *
           ElementBytes(input_dtype) +
       info.num_heads() * info.value_dim() * ElementBytes(output_dtype));
  report.shape = absl::StrCat(
      "sessions=", config->sessions, " context=", config->context,
      " layers=", layers, " H=", info.num_heads(), " Hkv=", info.num_kv_heads(),
      " Dk=", info.key_dim(), " Dv=", info.value_dim());

  DecodePhase step_phase;
  step_phase.rpc = "step";
  DecodePhase attend_phase;
  attend_phase.rpc = "attend";
  const auto step_call = [&](int64_t step, int64_t layer,
                             int64_t* request_bytes, int64_t* response_bytes) {
    v1::StepRequest& request = requests[layer];
    for (v1::SessionStep& session_step : *request.mutable_steps()) {
      session_step.set_expected_length(config->context + step);
    }
    absl::StatusOr<v1::StepResponse> response =
        client.Step(request, CallTimeout());
    if (!response.ok()) return response.status();
    *request_bytes += static_cast<int64_t>(request.ByteSizeLong());
    *response_bytes += static_cast<int64_t>(response->ByteSizeLong());
    return FirstStepError(*response);
  };
  const auto attend_call = [&](int64_t, int64_t, int64_t* request_bytes,
                               int64_t* response_bytes) {
    absl::StatusOr<v1::AttendResponse> response =
        client.Attend(*attend, CallTimeout());
    if (!response.ok()) return response.status();
    *request_bytes += static_cast<int64_t>(attend->ByteSizeLong());
    *response_bytes += static_cast<int64_t>(response->ByteSizeLong());
    return absl::OkStatus();
  };
  // With --compare_stateless the two phases take turns, a tenth of the steps
  // each, so that both meet the same host: on a shared machine the load
  // moves within seconds, and phases run one after the other would compare
  // two different minutes.
  const int64_t rounds =
      attend.has_value() ? std::min<int64_t>(config->steps, 10) : 1;
  // A phase stops at its first failed step; the other goes on alone.
  bool step_going = true, attend_going = attend.has_value();
  for (int64_t round = 0; round < rounds && (step_going || attend_going);
       ++round) {
    const int64_t first = config->steps * round / rounds + 1;
    const int64_t last = config->steps * (round + 1) / rounds;
    step_going = step_going &&
                 RunDecodePhase(first, last, layers, step_call, step_phase);
    attend_going = attend_going && RunDecodePhase(first, last, layers,
                                                  attend_call, attend_phase);
  }
  cleanup();
  report.phases.push_back(std::move(step_phase));
  if (attend.has_value()) report.phases.push_back(std::move(attend_phase));

  const std::string text = absl::GetFlag(FLAGS_json)
                               ? FormatDecodeBenchJson(report)
                               : FormatDecodeBenchText(report);
  std::fputs(text.c_str(), stdout);
  return report.phases[0].latencies.count() > 0 ? kExitOk : kExitCallFailed;
}

}  // namespace

int RunBench(Client& client) {
  if (absl::AsciiStrToLower(absl::GetFlag(FLAGS_rpc)) == "step") {
    return RunDecodeBench(client);
  }
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
    return UsageError(absl::InvalidArgumentError(
        absl::StrCat("--rpc is '", absl::GetFlag(FLAGS_rpc),
                     "', expected attend, mha or step")));
  }
  if (prepared != kExitOk) return prepared;
  report.shape = target.shape;
  report.input_dtype = target.input_dtype;
  report.flops_per_request = target.flops_per_request;
  report.concurrency = config->concurrency;
  report.warmup = config->warmup;

  const absl::Status ran = RunClosedLoop(*config, target.call, report);
  if (!ran.ok()) {
    // While the system refused our threads it may have refused one of gRPC's
    // (a timer thread the backup poller's timer asks for, say). gRPC 1.51
    // counts such a thread before starting it, and its shutdown, at the
    // channel's end, would wait forever for the one that never ran: end here.
    const int exit_status = Fail(ran);
    std::fflush(nullptr);
    std::_Exit(exit_status);
  }
  const std::string text = absl::GetFlag(FLAGS_json) ? FormatBenchJson(report)
                                                     : FormatBenchText(report);
  std::fputs(text.c_str(), stdout);
  return report.latencies.count() > 0 ? kExitOk : kExitCallFailed;
}

}  // namespace attnserve
