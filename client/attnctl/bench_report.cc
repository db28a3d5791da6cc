#include "bench_report.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace attnserve {
namespace {

// Bucket k holds latencies in [kGrowth^k, kGrowth^(k+1)) nanoseconds.
constexpr double kGrowth = 1.01;
// ceil(ln(1e12) / ln(1.01)): up to 1000 s.
constexpr int kBuckets = 2777;

int BucketOf(absl::Duration latency) {
  const double nanoseconds = std::max(1.0, absl::ToDoubleNanoseconds(latency));
  const int bucket =
      static_cast<int>(std::floor(std::log(nanoseconds) / std::log(kGrowth)));
  return std::clamp(bucket, 0, kBuckets - 1);
}

double Milliseconds(absl::Duration duration) {
  return absl::ToDoubleMilliseconds(duration);
}

// `json` as nlohmann::json dumps it on one line, except that a finite
// floating-point number has a fixed count of decimals: 3 for "throughput_rps"
// (under the key `key`), 6 for the others. nlohmann::json prints the shortest
// text that reads back as the same double ("2.0"), and the report keeps its
// documented form ("2.000").
std::string DumpWithFixedDecimals(const nlohmann::ordered_json& json,
                                  absl::string_view key) {
  if (json.is_number_float() && std::isfinite(json.get<double>())) {
    return absl::StrFormat("%.*f", key == "throughput_rps" ? 3 : 6,
                           json.get<double>());
  }
  if (!json.is_object()) return json.dump();
  std::string text = "{";
  for (const auto& [name, value] : json.items()) {
    absl::StrAppend(&text, text.size() > 1 ? "," : "",
                    nlohmann::ordered_json(name).dump(), ":",
                    DumpWithFixedDecimals(value, name));
  }
  return text + "}";
}

}  // namespace

LatencyHistogram::LatencyHistogram() : buckets_(kBuckets, 0) {}

void LatencyHistogram::Record(absl::Duration latency) {
  ++buckets_[BucketOf(latency)];
  ++count_;
  sum_ += latency;
  min_ = std::min(min_, latency);
  max_ = std::max(max_, latency);
}

void LatencyHistogram::Merge(const LatencyHistogram& other) {
  for (int k = 0; k < kBuckets; ++k) buckets_[k] += other.buckets_[k];
  count_ += other.count_;
  sum_ += other.sum_;
  min_ = std::min(min_, other.min_);
  max_ = std::max(max_, other.max_);
}

absl::Duration LatencyHistogram::mean() const {
  return count_ == 0 ? absl::ZeroDuration() : sum_ / count_;
}

absl::Duration LatencyHistogram::Percentile(double quantile) const {
  if (count_ == 0) return absl::ZeroDuration();
  const int64_t rank = std::clamp<int64_t>(
      static_cast<int64_t>(std::ceil(quantile * static_cast<double>(count_))),
      1, count_);
  if (rank == 1) return min_;
  if (rank == count_) return max_;
  int64_t seen = 0;
  int bucket = 0;
  for (; bucket < kBuckets; ++bucket) {
    seen += buckets_[bucket];
    if (seen >= rank) break;
  }
  const absl::Duration middle =
      absl::Nanoseconds(std::pow(kGrowth, bucket + 0.5));
  return std::clamp(middle, min_, max_);
}

int64_t BenchReport::error_count() const {
  int64_t total = 0;
  for (const auto& [code, count] : errors) total += count;
  return total;
}

double BenchReport::throughput() const {
  const double seconds = absl::ToDoubleSeconds(elapsed);
  return seconds > 0 ? static_cast<double>(requests) / seconds : 0.0;
}

double BenchReport::gflops_per_second() const {
  const double seconds = absl::ToDoubleSeconds(elapsed);
  return seconds > 0 ? static_cast<double>(latencies.count()) *
                           flops_per_request / seconds / 1e9
                     : 0.0;
}

std::string FormatBenchText(const BenchReport& report) {
  std::string text = absl::StrFormat(
      "bench %s %s %s, concurrency %d, warm-up %s (%d requests)\n"
      "requests %d ok %d errors %d in %s\n"
      "throughput %.1f req/s, %.3f GFLOP/s\n"
      "latency p50 %.3fms p90 %.3fms p99 %.3fms max %.3fms mean %.3fms\n",
      report.rpc, report.shape, report.input_dtype, report.concurrency,
      absl::FormatDuration(report.warmup), report.warmup_requests,
      report.requests, report.latencies.count(), report.error_count(),
      absl::FormatDuration(report.elapsed), report.throughput(),
      report.gflops_per_second(),
      Milliseconds(report.latencies.Percentile(0.50)),
      Milliseconds(report.latencies.Percentile(0.90)),
      Milliseconds(report.latencies.Percentile(0.99)),
      Milliseconds(report.latencies.max()),
      Milliseconds(report.latencies.mean()));
  if (!report.errors.empty()) {
    text += "errors by code:";
    for (const auto& [code, count] : report.errors) {
      absl::StrAppend(&text, " ", absl::StatusCodeToString(code), "=", count);
    }
    text += "\n";
  }
  return text;
}

std::string FormatBenchJson(const BenchReport& report) {
  nlohmann::ordered_json errors = nlohmann::ordered_json::object();
  for (const auto& [code, count] : report.errors) {
    errors[absl::StatusCodeToString(code)] = count;
  }
  const nlohmann::ordered_json json = {
      {"rpc", report.rpc},
      {"shape", report.shape},
      {"input_dtype", report.input_dtype},
      {"concurrency", report.concurrency},
      {"warmup_s", absl::ToDoubleSeconds(report.warmup)},
      {"warmup_requests", report.warmup_requests},
      {"requests", report.requests},
      {"ok", report.latencies.count()},
      {"error_count", report.error_count()},
      {"errors", errors},
      {"elapsed_s", absl::ToDoubleSeconds(report.elapsed)},
      {"throughput_rps", report.throughput()},
      {"flops_per_request", std::llround(report.flops_per_request)},
      {"gflops_per_s", report.gflops_per_second()},
      {"latency_ms",
       {{"p50", Milliseconds(report.latencies.Percentile(0.50))},
        {"p90", Milliseconds(report.latencies.Percentile(0.90))},
        {"p99", Milliseconds(report.latencies.Percentile(0.99))},
        {"max", Milliseconds(report.latencies.max())},
        {"mean", Milliseconds(report.latencies.mean())}}}};
  return DumpWithFixedDecimals(json, "") + "\n";
}

int64_t DecodePhase::error_count() const {
  int64_t total = 0;
  for (const auto& [code, count] : errors) total += count;
  return total;
}

double DecodePhase::tokens_per_second(int64_t sessions) const {
  const double seconds = absl::ToDoubleSeconds(elapsed);
  return seconds > 0
             ? static_cast<double>(latencies.count() * sessions) / seconds
             : 0.0;
}

double DecodePhase::request_bytes_per_step() const {
  return latencies.count() > 0 ? static_cast<double>(request_bytes) /
                                     static_cast<double>(latencies.count())
                               : 0.0;
}

double DecodePhase::response_bytes_per_step() const {
  return latencies.count() > 0 ? static_cast<double>(response_bytes) /
                                     static_cast<double>(latencies.count())
                               : 0.0;
}

std::string FormatDecodeBenchText(const DecodeBenchReport& report) {
  std::string text =
      absl::StrFormat("bench step %s %s, cache %s, prefill %s\n", report.shape,
                      report.input_dtype, report.cache_dtype,
                      absl::FormatDuration(report.prefill));
  const double payload = static_cast<double>(report.payload_bytes_per_step);
  std::map<absl::StatusCode, int64_t> errors;
  for (const DecodePhase& phase : report.phases) {
    const double wire =
        phase.request_bytes_per_step() + phase.response_bytes_per_step();
    absl::StrAppendFormat(
        &text,
        "%s: %d steps ok %d errors %d in %s, %.1f tokens/s, step p50 %.3fms "
        "p99 %.3fms\n"
        "%s: wire %.0f bytes/step (request %.0f + response %.0f), q+k+v+o "
        "%.0f bytes/step (%.2fx)\n",
        phase.rpc, phase.steps, phase.latencies.count(), phase.error_count(),
        absl::FormatDuration(phase.elapsed),
        phase.tokens_per_second(report.sessions),
        Milliseconds(phase.latencies.Percentile(0.50)),
        Milliseconds(phase.latencies.Percentile(0.99)), phase.rpc, wire,
        phase.request_bytes_per_step(), phase.response_bytes_per_step(),
        payload, payload > 0 ? wire / payload : 0.0);
    for (const auto& [code, count] : phase.errors) errors[code] += count;
  }
  if (report.phases.size() == 2) {
    const DecodePhase& step = report.phases[0];
    const DecodePhase& attend = report.phases[1];
    const double attend_rate = attend.tokens_per_second(report.sessions);
    const double attend_wire =
        attend.request_bytes_per_step() + attend.response_bytes_per_step();
    absl::StrAppendFormat(
        &text, "%s vs %s: %.2fx tokens/s, %.4fx bytes/step\n", step.rpc,
        attend.rpc,
        attend_rate > 0 ? step.tokens_per_second(report.sessions) / attend_rate
                        : 0.0,
        attend_wire > 0
            ? (step.request_bytes_per_step() + step.response_bytes_per_step()) /
                  attend_wire
            : 0.0);
  }
  if (!errors.empty()) {
    text += "errors by code:";
    for (const auto& [code, count] : errors) {
      absl::StrAppend(&text, " ", absl::StatusCodeToString(code), "=", count);
    }
    text += "\n";
  }
  return text;
}

std::string FormatDecodeBenchJson(const DecodeBenchReport& report) {
  nlohmann::ordered_json phases = nlohmann::ordered_json::object();
  for (const DecodePhase& phase : report.phases) {
    nlohmann::ordered_json errors = nlohmann::ordered_json::object();
    for (const auto& [code, count] : phase.errors) {
      errors[absl::StatusCodeToString(code)] = count;
    }
    phases[phase.rpc] = {
        {"steps", phase.steps},
        {"ok", phase.latencies.count()},
        {"error_count", phase.error_count()},
        {"errors", errors},
        {"elapsed_s", absl::ToDoubleSeconds(phase.elapsed)},
        {"tokens_per_s", phase.tokens_per_second(report.sessions)},
        {"latency_ms",
         {{"p50", Milliseconds(phase.latencies.Percentile(0.50))},
          {"p99", Milliseconds(phase.latencies.Percentile(0.99))},
          {"max", Milliseconds(phase.latencies.max())},
          {"mean", Milliseconds(phase.latencies.mean())}}},
        {"request_bytes_per_step", phase.request_bytes_per_step()},
        {"response_bytes_per_step", phase.response_bytes_per_step()}};
  }
  const nlohmann::ordered_json json = {
      {"rpc", "step"},
      {"shape", report.shape},
      {"input_dtype", report.input_dtype},
      {"cache_dtype", report.cache_dtype},
      {"sessions", report.sessions},
      {"prefill_s", absl::ToDoubleSeconds(report.prefill)},
      {"payload_bytes_per_step", report.payload_bytes_per_step},
      {"phases", phases}};
  return DumpWithFixedDecimals(json, "") + "\n";
}

}  // namespace attnserve
