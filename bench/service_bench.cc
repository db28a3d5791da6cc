// The service's own costs, over loopback gRPC against an in-process server:
//   - a tiny Attend (B=1, H=1, L=16, D=64) at concurrency 1: latency
//   percentiles;
//   - a large Attend (1, 16, 2048, 64): the server's time outside compute, as a
//   fraction of
//     compute (ServerTiming.server_us − compute_us: validation, queue,
//     conversion);
//   - 64 calls in flight of a small Attend (B=1, H=8, L=128, D=64): requests/s
//   with dynamic
//     batching off (max_batch 1) and on (max_batch 32).
//
//   build/bench/service_bench [--benchmark_filter=...]
#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnserve/client/client.h"
#include "attnserve/server/rpc/wire_messages.h"
#include "attnserve/server/server.h"
#include "benchmark/benchmark.h"

namespace attnserve {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(60);

v1::AttendRequest Request(int64_t b, int64_t h, int64_t l, int64_t d) {
  std::vector<float> values(static_cast<size_t>(b * h * l * d), 0.01f);
  v1::AttendRequest request;
  *request.mutable_query() = MakeFloat32Tensor({b, h, l, d}, values);
  *request.mutable_key() = MakeFloat32Tensor({b, h, l, d}, values);
  *request.mutable_value() = MakeFloat32Tensor({b, h, l, d}, values);
  return request;
}

struct Served {
  std::unique_ptr<AttnServer> server;
  std::unique_ptr<Client> client;
};

Served Serve(int max_batch) {
  ServerOptions options;
  options.address = "127.0.0.1";
  options.port = 0;
  options.scheduling.max_batch = max_batch;
  Served served;
  served.server = AttnServer::Start(options).value();
  served.client =
      Client::Connect(absl::StrCat("127.0.0.1:", served.server->port()))
          .value();
  return served;
}

double Percentile(std::vector<double> values, double p) {
  std::sort(values.begin(), values.end());
  return values[static_cast<size_t>(p *
                                    static_cast<double>(values.size() - 1))];
}

// Calls Attend with `request` once per iteration at concurrency 1, after 200
// warm-up calls, and reports the round trip's p50 and p99; `expected` is the
// code every call must end with. Returns the answers' server_us.
std::vector<double> MeasureLatency(benchmark::State& state,
                                   const v1::AttendRequest& request,
                                   absl::StatusCode expected) {
  Served served = Serve(1);
  for (int i = 0; i < 200; ++i)
    served.client->Attend(request, kTimeout).IgnoreError();  // Warm.
  std::vector<double> latencies, server_us;
  for (auto _ : state) {
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::AttendResponse> response =
        served.client->Attend(request, kTimeout);
    latencies.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
    if (response.status().code() != expected) {
      state.SkipWithError(response.status().ToString().c_str());
      break;
    }
    if (response.ok()) {
      server_us.push_back(static_cast<double>(response->timing().server_us()));
    }
  }
  if (latencies.empty()) return server_us;
  state.counters["p50_us"] = Percentile(latencies, 0.5);
  state.counters["p99_us"] = Percentile(latencies, 0.99);
  return server_us;
}

void BM_TinyAttendLatency(benchmark::State& state) {
  const std::vector<double> server_us =
      MeasureLatency(state, Request(1, 1, 16, 64), absl::StatusCode::kOk);
  if (!server_us.empty()) {
    state.counters["server_p50_us"] = Percentile(server_us, 0.5);
  }
}
BENCHMARK(BM_TinyAttendLatency)
    ->Iterations(3000)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// The floor under the tiny call: a request the handler refuses at once
// (INVALID_ARGUMENT, no tensors), so no queue, compute or tensor bytes.
void BM_RefusedAttendLatency(benchmark::State& state) {
  MeasureLatency(state, v1::AttendRequest(),
                 absl::StatusCode::kInvalidArgument);
}
BENCHMARK(BM_RefusedAttendLatency)
    ->Iterations(3000)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

void BM_LargeAttendOverhead(benchmark::State& state) {
  Served served = Serve(1);
  const v1::AttendRequest request = Request(1, 16, 2048, 64);
  served.client->Attend(request, kTimeout).IgnoreError();  // Warm.
  double compute = 0, server = 0, round_trip = 0;
  for (auto _ : state) {
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::AttendResponse> response =
        served.client->Attend(request, kTimeout);
    round_trip += absl::ToDoubleMicroseconds(absl::Now() - start);
    if (!response.ok()) {
      state.SkipWithError(response.status().ToString().c_str());
      break;
    }
    compute += static_cast<double>(response->timing().compute_us());
    server += static_cast<double>(response->timing().server_us());
  }
  state.counters["compute_ms"] =
      compute / 1e3 / static_cast<double>(state.iterations());
  state.counters["server_outside_compute"] = (server - compute) / compute;
  state.counters["round_trip_outside_compute"] =
      (round_trip - compute) / compute;
}
BENCHMARK(BM_LargeAttendOverhead)
    ->Iterations(10)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The server's handling of the large Attend's wire bytes, without gRPC: the
// parse of its 24 MB request (as gRPC hands it over, in 16 KiB slices) and the
// serialisation of its 8 MB response, with the server's BytesPool (so, after
// the first call, into and out of kept memory).
void BM_LargeAttendWire(benchmark::State& state) {
  const v1::AttendRequest original = Request(1, 16, 2048, 64);
  const std::string bytes = original.SerializeAsString();
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += 16384) {
    slices.emplace_back(bytes.data() + at,
                        std::min<size_t>(16384, bytes.size() - at));
  }
  const size_t output_bytes = original.query().data().size();
  auto pool = std::make_shared<BytesPool>(int64_t{256} << 20);
  double parse = 0, serialize = 0;
  for (auto _ : state) {
    {
      grpc::ByteBuffer wire(slices.data(), slices.size());
      v1::AttendRequest request;
      absl::Time start = absl::Now();
      if (!ParseWire(&wire, &request, pool.get()).ok())
        state.SkipWithError("parse failed");
      parse += absl::ToDoubleMilliseconds(absl::Now() - start);
      GiveTensorBytes(&request, pool.get());
    }
    v1::AttendResponse response;
    *response.mutable_output()->mutable_data() = pool->Take(output_bytes);
    response.mutable_output()->mutable_data()->resize(output_bytes);
    grpc::ByteBuffer answer;
    const absl::Time start = absl::Now();
    if (!SerializeWire(&response, &answer, pool).ok())
      state.SkipWithError("serialise failed");
    serialize += absl::ToDoubleMilliseconds(absl::Now() - start);
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["parse_ms"] = parse / n;
  state.counters["serialize_ms"] = serialize / n;
}
BENCHMARK(BM_LargeAttendWire)
    ->Iterations(20)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Keeps `in_flight` asynchronous calls going until `total` have been answered.
void BM_SmallAttendThroughput(benchmark::State& state) {
  Served served = Serve(static_cast<int>(state.range(0)));
  const v1::AttendRequest request = Request(1, 8, 128, 64);
  constexpr int kInFlight = 64;
  constexpr int kTotal = 2000;
  double compute_total_us = 0;
  for (auto _ : state) {
    absl::Mutex mutex;
    int sent = 0, answered = 0, failed = 0;
    double compute_us = 0;
    std::function<void()> send_next;
    send_next = [&] {
      served.client->AttendAsync(
          request, kTimeout, [&](absl::StatusOr<v1::AttendResponse> response) {
            bool more;
            {
              absl::MutexLock lock(&mutex);
              ++answered;
              failed += response.ok() ? 0 : 1;
              if (response.ok()) compute_us += response->timing().compute_us();
              more = sent < kTotal;
              if (more) ++sent;
            }
            if (more) send_next();
          });
    };
    {
      absl::MutexLock lock(&mutex);
      sent = kInFlight;
    }
    for (int i = 0; i < kInFlight; ++i) send_next();
    absl::MutexLock lock(&mutex);
    mutex.Await(absl::Condition(
        +[](int* count) { return *count >= kTotal; }, &answered));
    if (failed > 0) state.SkipWithError("some calls failed");
    compute_total_us += compute_us;
  }
  // A batch's compute_us is the whole batch's, in each of its answers.
  state.counters["compute_us_per_answer"] =
      compute_total_us / static_cast<double>(kTotal * state.iterations());
  state.counters["requests_per_s"] =
      benchmark::Counter(kTotal, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_SmallAttendThroughput)
    ->ArgName("max_batch")
    ->Arg(1)
    ->Arg(4)
    ->Arg(32)
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace attnserve

BENCHMARK_MAIN();
