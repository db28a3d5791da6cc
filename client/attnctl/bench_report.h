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

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTNCTL_BENCH_REPORT_H_
