// The service's own costs, over loopback gRPC against an in-process server:
//   - a tiny Attend (B=1, H=1, L=16, D=64) at concurrency 1: latency
//   percentiles;
//   - a large Attend (1, 16, 2048, 64): the server's time outside compute, as a
//   fraction of
//     compute (ServerTiming.server_us − compute_us: validation, queue,
//     conversion);
//   - 64 calls in flight of a small Attend (B=1, H=8, L=128, D=64): requests/s
//   with dynamic
//     batching off (max_batch 1) and on (max_batch 32);
//   - compression: zlib as gRPC runs it (gzip, default level) on 1 MiB of
//     each kind of tensor a request carries (random float32/bfloat16/float16,
//     and BOOL masks: causal, key padding, random), its ratio and speed; and
//     a call's p50 over loopback with requests and responses gzipped or not,
//     for random tensors and for a request that is mostly a BOOL mask;
//   - the Open Inference Protocol: a 1 MiB Attend as ModelInfer against the
//     same call on the native path, p50s and their ratio.
//
//   build/bench/service_bench [--benchmark_filter=...]
#include <zlib.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnserve/client/client.h"
#include "attnserve/client/tensors.h"
#include "attnserve/server/rpc/wire_messages.h"
#include "attnserve/server/server.h"
#include "benchmark/benchmark.h"
#include "grpcpp/grpcpp.h"
#include "inference/grpc_service.grpc.pb.h"

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

// With `compression`, requests are sent compressed so and the server
// compresses its responses alike.
Served Serve(int max_batch, Compression compression = Compression::kNone) {
  ServerOptions options;
  options.address = "127.0.0.1";
  options.port = 0;
  options.scheduling.max_batch = max_batch;
  if (compression != Compression::kNone) {
    options.transport.accept_compressed_requests = true;
    options.transport.response_compression = compression == Compression::kGzip
                                                 ? GRPC_COMPRESS_GZIP
                                                 : GRPC_COMPRESS_DEFLATE;
  }
  ClientOptions client_options;
  client_options.compression = compression;
  Served served;
  served.server = AttnServer::Start(options).value();
  served.client =
      Client::Connect(absl::StrCat("127.0.0.1:", served.server->port()),
                      client_options)
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
std::vector<double> MeasureLatency(
    benchmark::State& state, const v1::AttendRequest& request,
    absl::StatusCode expected, Compression compression = Compression::kNone) {
  Served served = Serve(1, compression);
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

// The tensors requests carry, 1 MiB of each: what compression makes of them.
enum PayloadKind {
  kRandomFloat32,
  kRandomBfloat16,
  kRandomFloat16,
  kCausalMask,
  kPaddingMask,
  kRandomMask,
};
const char* const kPayloadNames[] = {
    "random_float32",   "random_bfloat16",       "random_float16",
    "causal_bool_mask", "key_padding_bool_mask", "random_bool_mask"};

std::string Payload(PayloadKind kind) {
  constexpr int64_t kBytes = 1 << 20;
  std::mt19937 random(17);
  std::normal_distribution<float> normal;
  switch (kind) {
    case kRandomFloat32:
    case kRandomBfloat16:
    case kRandomFloat16: {
      const int64_t width = kind == kRandomFloat32 ? 4 : 2;
      std::vector<float> values(static_cast<size_t>(kBytes / width));
      for (float& value : values) value = normal(random);
      const v1::DType dtype = kind == kRandomFloat32    ? v1::FLOAT32
                              : kind == kRandomBfloat16 ? v1::BFLOAT16
                                                        : v1::FLOAT16;
      return MakeTensor(dtype, {static_cast<int64_t>(values.size())}, values)
          .data();
    }
    case kCausalMask:
    case kPaddingMask:
    case kRandomMask: {
      constexpr int64_t kSide = 1024;  // [1024, 1024] bytes
      std::string mask(kBytes, '\0');
      std::bernoulli_distribution coin(0.5);
      for (int64_t i = 0; i < kSide; ++i) {
        for (int64_t j = 0; j < kSide; ++j) {
          const bool visible = kind == kCausalMask    ? j <= i
                               : kind == kPaddingMask ? j < 700
                                                      : coin(random);
          mask[static_cast<size_t>(i * kSide + j)] = visible ? 1 : 0;
        }
      }
      return mask;
    }
  }
  return {};
}

// gzip as gRPC 1.51 compresses a message (message_compress.cc: deflateInit2
// with Z_DEFAULT_COMPRESSION, 15 | 16 window bits, memLevel 8).
std::string Gzip(const std::string& input) {
  z_stream stream{};
  deflateInit2(&stream, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15 | 16, 8,
               Z_DEFAULT_STRATEGY);
  std::string output(deflateBound(&stream, input.size()), '\0');
  stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(input.data()));
  stream.avail_in = static_cast<uInt>(input.size());
  stream.next_out = reinterpret_cast<Bytef*>(output.data());
  stream.avail_out = static_cast<uInt>(output.size());
  deflate(&stream, Z_FINISH);
  output.resize(stream.total_out);
  deflateEnd(&stream);
  return output;
}

std::string Gunzip(const std::string& input, size_t size) {
  z_stream stream{};
  inflateInit2(&stream, 15 | 16);
  std::string output(size, '\0');
  stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(input.data()));
  stream.avail_in = static_cast<uInt>(input.size());
  stream.next_out = reinterpret_cast<Bytef*>(output.data());
  stream.avail_out = static_cast<uInt>(output.size());
  inflate(&stream, Z_FINISH);
  output.resize(stream.total_out);
  inflateEnd(&stream);
  return output;
}

void BM_Compress(benchmark::State& state) {
  const auto kind = static_cast<PayloadKind>(state.range(0));
  state.SetLabel(kPayloadNames[kind]);
  const std::string payload = Payload(kind);
  double deflate_s = 0, inflate_s = 0;
  size_t compressed_bytes = 0;
  for (auto _ : state) {
    absl::Time start = absl::Now();
    const std::string compressed = Gzip(payload);
    deflate_s += absl::ToDoubleSeconds(absl::Now() - start);
    start = absl::Now();
    const std::string inflated = Gunzip(compressed, payload.size());
    inflate_s += absl::ToDoubleSeconds(absl::Now() - start);
    if (inflated != payload) state.SkipWithError("the round trip differs");
    compressed_bytes = compressed.size();
  }
  const double n = static_cast<double>(state.iterations());
  const double megabytes = static_cast<double>(payload.size()) / 1e6;
  state.counters["ratio"] = static_cast<double>(compressed_bytes) /
                            static_cast<double>(payload.size());
  state.counters["deflate_MBps"] = megabytes * n / deflate_s;
  state.counters["inflate_MBps"] = megabytes * n / inflate_s;
}
BENCHMARK(BM_Compress)
    ->ArgName("payload")
    ->DenseRange(kRandomFloat32, kRandomMask)
    ->Iterations(10)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// A call's round trip with requests and responses compressed (gzip) or not:
// a 1 MiB Attend of random float32 tensors (1, 8, 128, 64) each of Q, K, V
// with 256 KiB), and a masked one whose request is mostly its BOOL mask
// ([1, 8, 512, 512] causal: 2 MiB; Q, K, V of (1, 8, 512, 8) random float32).
void BM_CompressedAttendLatency(benchmark::State& state) {
  const bool masked = state.range(0) == 1;
  const auto compression = static_cast<Compression>(state.range(1));
  state.SetLabel(
      absl::StrCat(masked ? "causal_mask" : "random_float32", "/",
                   compression == Compression::kNone ? "none" : "gzip"));
  std::mt19937 random(5);
  std::normal_distribution<float> normal;
  const auto random_tensor = [&](std::vector<int64_t> shape) {
    int64_t count = 1;
    for (int64_t dim : shape) count *= dim;
    std::vector<float> values(static_cast<size_t>(count));
    for (float& value : values) value = normal(random);
    return MakeFloat32Tensor(shape, values);
  };
  v1::AttendRequest request;
  const int64_t length = masked ? 512 : 128, dim = masked ? 8 : 64;
  *request.mutable_query() = random_tensor({1, 8, length, dim});
  *request.mutable_key() = random_tensor({1, 8, length, dim});
  *request.mutable_value() = random_tensor({1, 8, length, dim});
  if (masked) {
    std::vector<bool> mask(8 * 512 * 512);
    for (int64_t h = 0; h < 8; ++h) {
      for (int64_t i = 0; i < 512; ++i) {
        for (int64_t j = 0; j < 512; ++j) {
          mask[static_cast<size_t>((h * 512 + i) * 512 + j)] = j <= i;
        }
      }
    }
    *request.mutable_options()->mutable_attn_mask() =
        MakeBoolTensor({1, 8, 512, 512}, mask);
  }
  state.counters["request_bytes"] = static_cast<double>(request.ByteSizeLong());
  MeasureLatency(state, request, absl::StatusCode::kOk, compression);
}
BENCHMARK(BM_CompressedAttendLatency)
    ->ArgNames({"masked", "compression"})
    ->ArgsProduct({{0, 1},
                   {static_cast<int64_t>(Compression::kNone),
                    static_cast<int64_t>(Compression::kGzip)}})
    ->Iterations(300)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The Open Inference Protocol's cost over the native path: the same 1 MiB
// Attend (Q, K, V of (1, 8, 171, 64) random float32) as attnserve.v1's Attend
// and as ModelInfer of model sdpa (raw_input_contents), alternated call by
// call on one server, each with its own channel; the p50s and their ratio.
void BM_OipAttendOverhead(benchmark::State& state) {
  Served served = Serve(1);
  std::mt19937 random(9);
  std::normal_distribution<float> normal;
  const std::vector<int64_t> shape = {1, 8, 171, 64};
  std::vector<float> values(static_cast<size_t>(8 * 171 * 64));
  v1::AttendRequest native;
  inference::ModelInferRequest infer;
  infer.set_model_name("sdpa");
  for (const char* name : {"QUERY", "KEY", "VALUE"}) {
    for (float& value : values) value = normal(random);
    v1::Tensor tensor = MakeFloat32Tensor(shape, values);
    auto* input = infer.add_inputs();
    input->set_name(name);
    input->set_datatype("FP32");
    *input->mutable_shape() = tensor.shape();
    infer.add_raw_input_contents(tensor.data());
    v1::Tensor* field = name[0] == 'Q'   ? native.mutable_query()
                        : name[0] == 'K' ? native.mutable_key()
                                         : native.mutable_value();
    *field = std::move(tensor);
  }
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(64 << 20);
  arguments.SetMaxSendMessageSize(64 << 20);
  const auto stub =
      inference::GRPCInferenceService::NewStub(grpc::CreateCustomChannel(
          absl::StrCat("127.0.0.1:", served.server->port()),
          grpc::InsecureChannelCredentials(), arguments));
  const auto call_oip = [&] {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + kTimeout));
    inference::ModelInferResponse response;
    return stub->ModelInfer(&context, infer, &response).ok() &&
           response.raw_output_contents_size() == 1;
  };
  for (int i = 0; i < 20; ++i) {  // Warm both paths.
    served.client->Attend(native, kTimeout).IgnoreError();
    call_oip();
  }
  std::vector<double> native_us, oip_us;
  for (auto _ : state) {
    absl::Time start = absl::Now();
    const bool native_ok = served.client->Attend(native, kTimeout).ok();
    native_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
    start = absl::Now();
    const bool oip_ok = call_oip();
    oip_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
    if (!native_ok || !oip_ok) {
      state.SkipWithError("a call failed");
      break;
    }
  }
  if (native_us.empty()) return;
  state.counters["native_p50_us"] = Percentile(native_us, 0.5);
  state.counters["oip_p50_us"] = Percentile(oip_us, 0.5);
  state.counters["oip_over_native"] =
      Percentile(oip_us, 0.5) / Percentile(native_us, 0.5);
  state.counters["request_bytes"] = static_cast<double>(native.ByteSizeLong());
}
BENCHMARK(BM_OipAttendOverhead)
    ->Iterations(300)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace attnserve

BENCHMARK_MAIN();
