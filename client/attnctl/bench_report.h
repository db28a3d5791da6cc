// What attnctl bench measures and how it reports it: a fixed-size latency
// histogram, and the summary printed as text or as one JSON object.
//
//   LatencyHistogram histogram;
//   histogram.Record(absl::Milliseconds(3));
//   absl::Duration p99 = histogram.Percentile(0.99);
//
// Not thread-safe: each bench worker keeps its own histogram, merged at the
// end.
#ifndef ATTNSERVE_CLIENT_ATTNCTL_BENCH_REPORT_H_
#define ATTNSERVE_CLIENT_ATTNCTL_BENCH_REPORT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace attnserve {

// Latencies from 1 ns to 1000 s in buckets 1% wide (longer ones count in the
// last bucket), so that memory stays fixed however long a run is. A percentile
// is within 1% of the exact nearest-rank value; the maximum is exact.
class LatencyHistogram {
 public:
  LatencyHistogram();

  void Record(absl::Duration latency);
  void Merge(const LatencyHistogram& other);

  int64_t count() const { return count_; }
  absl::Duration max() const { return max_; }
  absl::Duration mean() const;

  // The nearest-rank `quantile` (in (0, 1]) of the recorded latencies: the
  // exact minimum or maximum at the ends, else the geometric middle of its
  // bucket, clamped to the recorded range. Zero when nothing was recorded.
  absl::Duration Percentile(double quantile) const;

 private:
  std::vector<int64_t> buckets_;
  int64_t count_ = 0;
  absl::Duration sum_;
  absl::Duration min_ = absl::InfiniteDuration();
  absl::Duration max_;
};

// One bench run.
struct BenchReport {
  std::string rpc;          // "attend" or "mha".
  std::string shape;        // e.g. "B=1 H=8 Hkv=8 Lq=128 Lk=128 Dk=64 Dv=64".
  std::string input_dtype;  // e.g. "FLOAT32".
  int concurrency = 0;
  absl::Duration warmup;
  int64_t warmup_requests = 0;
  // Calls completed in the measured phase, and the wall time it took.
  int64_t requests = 0;
  absl::Duration elapsed;
  // Failed calls by status code; OK never appears.
  std::map<absl::StatusCode, int64_t> errors;
  // FLOPs of one successful call (the server's convention).
  double flops_per_request = 0.0;
  // Latencies of the successful calls.
  LatencyHistogram latencies;

  int64_t error_count() const;
  double throughput() const;         // Completed calls a second.
  double gflops_per_second() const;  // Of successful calls.
};

// The report as lines of text for a person.
std::string FormatBenchText(const BenchReport& report);

// The report as one JSON object on one line:
//   {"rpc":"attend","shape":"B=1 ...","input_dtype":"FLOAT32",
//    "concurrency":4,"warmup_s":0,"warmup_requests":0,"requests":200,
//    "ok":200,"error_count":0,"errors":{"UNAVAILABLE":0...},"elapsed_s":..,
//    "throughput_rps":..,"flops_per_request":..,"gflops_per_s":..,
//    "latency_ms":{"p50":..,"p90":..,"p99":..,"max":..,"mean":..}}
// "errors" holds only the codes that occurred. Built with nlohmann::json, so
// strings are escaped; floating-point numbers keep a fixed count of decimals
// (3 for throughput_rps, 6 for the others).
std::string FormatBenchJson(const BenchReport& report);

// One phase of bench --rpc=step: decode steps through Step, or (with
// --compare_stateless) the same decode done with Attend calls that carry the
// whole context every step.
struct DecodePhase {
  std::string rpc;    // "step" or "attend".
  int64_t steps = 0;  // Decode steps measured (each: one call per layer).
  // Failed steps by code; a phase stops at its first failure, since the
  // sessions' lengths are then unknown.
  std::map<absl::StatusCode, int64_t> errors;
  absl::Duration elapsed;
  // Latencies of the successful steps.
  LatencyHistogram latencies;
  // Serialized request and response bytes of the successful steps, summed:
  // what gRPC carries, less HTTP/2 framing.
  int64_t request_bytes = 0;
  int64_t response_bytes = 0;

  int64_t error_count() const;
  // Tokens decoded a second: `sessions` per successful step.
  double tokens_per_second(int64_t sessions) const;
  double request_bytes_per_step() const;
  double response_bytes_per_step() const;
};

// bench --rpc=step: N sessions prefilled with `context` tokens, then decode
// steps of one token each.
struct DecodeBenchReport {
  // e.g. "sessions=4 context=4096 layers=1 H=8 Hkv=8 Dk=64 Dv=64".
  std::string shape;
  std::string input_dtype;  // The tensors sent, e.g. "FLOAT32".
  std::string cache_dtype;  // How the server stores them.
  int64_t sessions = 0;
  // Bytes of the query, key, value and output of one decode step, over every
  // session and layer: the least a step could ship.
  int64_t payload_bytes_per_step = 0;
  absl::Duration prefill;  // Creating the sessions and filling them.
  std::vector<DecodePhase> phases;
};

// The report as lines of text:
//   bench step sessions=4 context=4096 ... FLOAT32, cache FLOAT32, prefill 1.2s
//   step: 64 steps ok 64 errors 0 in 91.2ms, 2807.0 tokens/s, step p50 1.402ms
//     p99 2.105ms
//   step: wire 9896 bytes/step (request 5524 + response 4372), q+k+v+o 8192
//     bytes/step (1.21x)
// with the same two lines for attend, then "step vs attend: 15.20x tokens/s,
// 0.0001x bytes/step" and the errors by code when there are any.
std::string FormatDecodeBenchText(const DecodeBenchReport& report);

// The report as one JSON object on one line.
std::string FormatDecodeBenchJson(const DecodeBenchReport& report);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTNCTL_BENCH_REPORT_H_
