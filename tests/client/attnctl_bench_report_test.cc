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

}  // namespace
}  // namespace attnserve
