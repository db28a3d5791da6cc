// attnctl bench's latency histogram and its text and JSON reports.
#include <cmath>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "attnctl/bench_report.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

TEST(LatencyHistogramTest, PercentilesAreWithinOnePercentOfNearestRank) {
  LatencyHistogram histogram;
  for (int ms = 1000; ms >= 1; --ms) histogram.Record(absl::Milliseconds(ms));
  EXPECT_EQ(histogram.count(), 1000);
  EXPECT_EQ(histogram.max(), absl::Milliseconds(1000));
  EXPECT_EQ(histogram.mean(), absl::Microseconds(500500));
  // Nearest rank: the ceil(q * n)-th smallest.
  for (const auto& [quantile, exact_ms] : {std::pair<double, double>{0.5, 500},
                                           {0.9, 900},
                                           {0.99, 990},
                                           {0.001, 1},
                                           {1.0, 1000}}) {
    SCOPED_TRACE(quantile);
    const double actual =
        absl::ToDoubleMilliseconds(histogram.Percentile(quantile));
    EXPECT_NEAR(actual, exact_ms, exact_ms * 0.01);
  }
}

TEST(LatencyHistogramTest, StaysWithinTheRecordedRange) {
  LatencyHistogram histogram;
  histogram.Record(absl::Microseconds(123));
  EXPECT_EQ(histogram.Percentile(0.5), absl::Microseconds(123));
  EXPECT_EQ(histogram.Percentile(0.99), absl::Microseconds(123));
  histogram.Record(absl::Hours(2));  // Past the last bucket.
  EXPECT_EQ(histogram.max(), absl::Hours(2));
  EXPECT_EQ(histogram.Percentile(1.0), absl::Hours(2));
}

TEST(LatencyHistogramTest, EmptyReportsZero) {
  LatencyHistogram histogram;
  EXPECT_EQ(histogram.Percentile(0.5), absl::ZeroDuration());
  EXPECT_EQ(histogram.mean(), absl::ZeroDuration());
  EXPECT_EQ(histogram.max(), absl::ZeroDuration());
}

TEST(LatencyHistogramTest, MergeAddsCountsAndKeepsExtremes) {
  LatencyHistogram first, second;
  first.Record(absl::Milliseconds(1));
  second.Record(absl::Milliseconds(9));
  second.Record(absl::Milliseconds(10));
  first.Merge(second);
  EXPECT_EQ(first.count(), 3);
  EXPECT_EQ(first.max(), absl::Milliseconds(10));
  EXPECT_NEAR(absl::ToDoubleMilliseconds(first.Percentile(0.34)), 9, 0.09);
  EXPECT_EQ(first.Percentile(0.01), absl::Milliseconds(1));
}

BenchReport SampleReport() {
  BenchReport report;
  report.rpc = "attend";
  report.shape = "B=1 H=2 Hkv=2 Lq=4 Lk=4 Dk=8 Dv=8";
  report.input_dtype = "FLOAT32";
  report.concurrency = 2;
  report.requests = 4;
  report.elapsed = absl::Seconds(2);
  report.errors[absl::StatusCode::kUnavailable] = 1;
  report.errors[absl::StatusCode::kDeadlineExceeded] = 2;
  report.flops_per_request = 1e9;
  report.latencies.Record(absl::Milliseconds(5));
  return report;
}

TEST(BenchReportTest, CountsThroughputOverAllCallsAndFlopsOverSuccesses) {
  const BenchReport report = SampleReport();
  EXPECT_EQ(report.error_count(), 3);
  EXPECT_DOUBLE_EQ(report.throughput(), 2.0);
  EXPECT_DOUBLE_EQ(report.gflops_per_second(), 0.5);
}

TEST(BenchReportTest, JsonIsOneLineWithTheErrorBreakdown) {
  const std::string json = FormatBenchJson(SampleReport());
  EXPECT_EQ(json.find('\n'), json.size() - 1);
  for (const char* field :
       {"\"rpc\":\"attend\"", "\"requests\":4", "\"ok\":1", "\"error_count\":3",
        "\"errors\":{\"DEADLINE_EXCEEDED\":2,\"UNAVAILABLE\":1}",
        "\"throughput_rps\":2.000", "\"gflops_per_s\":0.500000",
        "\"latency_ms\":{\"p50\":5.000000,\"p90\":5.000000,"
        "\"p99\":5.000000,\"max\":5.000000,\"mean\":5.000000}"}) {
    EXPECT_NE(json.find(field), std::string::npos) << field << " in " << json;
  }
}

TEST(BenchReportTest, TextNamesEveryErrorCode) {
  const std::string text = FormatBenchText(SampleReport());
  EXPECT_NE(text.find("requests 4 ok 1 errors 3 in 2s\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("errors by code: DEADLINE_EXCEEDED=2 UNAVAILABLE=1\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("latency p50 5.000ms"), std::string::npos) << text;
}

DecodeBenchReport SampleDecodeReport() {
  DecodeBenchReport report;
  report.shape = "sessions=4 context=16 layers=1 H=2 Hkv=2 Dk=8 Dv=8";
  report.input_dtype = "FLOAT32";
  report.cache_dtype = "BFLOAT16";
  report.sessions = 4;
  report.payload_bytes_per_step = 1000;
  report.prefill = absl::Seconds(1);
  DecodePhase step;
  step.rpc = "step";
  step.steps = 2;
  step.elapsed = absl::Seconds(1);
  step.latencies.Record(absl::Milliseconds(2));
  step.latencies.Record(absl::Milliseconds(2));
  step.request_bytes = 1800;
  step.response_bytes = 600;
  DecodePhase attend = step;
  attend.rpc = "attend";
  attend.steps = 2;
  attend.elapsed = absl::Seconds(4);
  attend.latencies = LatencyHistogram();
  attend.latencies.Record(absl::Milliseconds(8));
  attend.request_bytes = 20000;
  attend.response_bytes = 400;
  attend.errors[absl::StatusCode::kResourceExhausted] = 1;
  report.phases = {step, attend};
  return report;
}

TEST(DecodeBenchReportTest, TextComparesTheStepsWithStatelessCalls) {
  const std::string text = FormatDecodeBenchText(SampleDecodeReport());
  for (const char* line :
       {"bench step sessions=4 context=16 layers=1 H=2 Hkv=2 Dk=8 Dv=8 "
        "FLOAT32, cache BFLOAT16, prefill 1s\n",
        "step: 2 steps ok 2 errors 0 in 1s, 8.0 tokens/s, step p50 2.000ms "
        "p99 2.000ms\n",
        "step: wire 1200 bytes/step (request 900 + response 300), q+k+v+o "
        "1000 bytes/step (1.20x)\n",
        "attend: 2 steps ok 1 errors 1 in 4s, 1.0 tokens/s",
        "attend: wire 20400 bytes/step",
        "step vs attend: 8.00x tokens/s, 0.0588x bytes/step\n",
        "errors by code: RESOURCE_EXHAUSTED=1\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " in " << text;
  }
}

TEST(DecodeBenchReportTest, JsonHasOnePhaseObjectEach) {
  const std::string json = FormatDecodeBenchJson(SampleDecodeReport());
  EXPECT_EQ(json.find('\n'), json.size() - 1);
  for (const char* field :
       {"\"rpc\":\"step\"", "\"cache_dtype\":\"BFLOAT16\"",
        "\"payload_bytes_per_step\":1000", "\"phases\":{\"step\":{\"steps\":2,",
        "\"tokens_per_s\":8.000000", "\"request_bytes_per_step\":900.000000",
        "\"attend\":{\"steps\":2,\"ok\":1,\"error_count\":1,"
        "\"errors\":{\"RESOURCE_EXHAUSTED\":1}"}) {
    EXPECT_NE(json.find(field), std::string::npos) << field << " in " << json;
  }
}

}  // namespace
}  // namespace attnserve
