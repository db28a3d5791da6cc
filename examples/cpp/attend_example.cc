// Calls attnserve from C++ through the installed client library
// (find_package(attnserve CONFIG) → attnserve::client, or pkg-config's
// attnserve-client), and checks every answer against attention computed here
// in double precision:
//
//   attend   a causal, grouped-query Attend [2, 8, 64, 32] (2 key heads);
//   session  a KV-cache session: a 60-token prompt, then 4 decode steps that
//            each send one token's key, value and query.
//
//   attend_example [TARGET]     (TARGET: localhost:50051)
//
// Prints "PASS <check>: ..." per check; exits 1 on the first failure.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnserve/client/client.h"
#include "attnserve/client/session.h"
#include "attnserve/client/tensors.h"

namespace {

constexpr double kTolerance = 1e-4;
const absl::Duration kTimeout = absl::Seconds(20);

std::vector<float> Random(size_t count, std::mt19937& random) {
  std::normal_distribution<float> normal;
  std::vector<float> values(count);
  for (float& value : values) value = normal(random);
  return values;
}

// softmax(q·kᵀ/√d) v for one query row against `keys` rows of `key` and
// `value` ([keys, d] each, row-major): what the server should answer.
std::vector<double> AttendRow(const float* query, const float* key,
                              const float* value, int64_t keys, int64_t d) {
  std::vector<double> scores(keys);
  double max_score = -INFINITY;
  for (int64_t j = 0; j < keys; ++j) {
    double dot = 0;
    for (int64_t c = 0; c < d; ++c) dot += double{query[c]} * key[j * d + c];
    scores[j] = dot / std::sqrt(static_cast<double>(d));
    max_score = std::max(max_score, scores[j]);
  }
  double sum = 0;
  for (double& score : scores) sum += (score = std::exp(score - max_score));
  std::vector<double> out(d, 0.0);
  for (int64_t j = 0; j < keys; ++j) {
    for (int64_t c = 0; c < d; ++c)
      out[c] += scores[j] / sum * value[j * d + c];
  }
  return out;
}

int Fail(const char* check, const absl::Status& status) {
  std::fprintf(stderr, "FAIL %s: %s\n", check, status.ToString().c_str());
  return 1;
}

// A causal Attend with 8 query heads over 2 key/value heads.
int CheckAttend(attnserve::Client& client, std::mt19937& random) {
  constexpr int64_t kB = 2, kH = 8, kHkv = 2, kL = 64, kD = 32;
  const std::vector<float> query = Random(kB * kH * kL * kD, random);
  const std::vector<float> key = Random(kB * kHkv * kL * kD, random);
  const std::vector<float> value = Random(kB * kHkv * kL * kD, random);
  attnserve::v1::AttendRequest request;
  *request.mutable_query() =
      attnserve::MakeTensor(attnserve::v1::FLOAT32, {kB, kH, kL, kD}, query);
  *request.mutable_key() =
      attnserve::MakeTensor(attnserve::v1::FLOAT32, {kB, kHkv, kL, kD}, key);
  *request.mutable_value() =
      attnserve::MakeTensor(attnserve::v1::FLOAT32, {kB, kHkv, kL, kD}, value);
  request.mutable_options()->set_causal(true);

  absl::StatusOr<attnserve::v1::AttendResponse> response =
      client.Attend(request, kTimeout);
  if (!response.ok()) return Fail("attend", response.status());
  std::vector<float> output(kB * kH * kL * kD);
  const absl::Status read = attnserve::ReadFloatsInto(
      response->output(), {kB, kH, kL, kD}, absl::MakeSpan(output));
  if (!read.ok()) return Fail("attend", read);

  double max_error = 0;
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t h = 0; h < kH; ++h) {
      const int64_t kv_head = b * kHkv + h / (kH / kHkv);
      for (int64_t i = 0; i < kL; ++i) {
        const int64_t row = ((b * kH + h) * kL + i) * kD;
        // Causal (top-left): query i sees keys 0..i.
        const std::vector<double> expected =
            AttendRow(&query[row], &key[kv_head * kL * kD],
                      &value[kv_head * kL * kD], i + 1, kD);
        for (int64_t c = 0; c < kD; ++c) {
          max_error =
              std::max(max_error, std::abs(output[row + c] - expected[c]));
        }
      }
    }
  }
  if (max_error > kTolerance) {
    return Fail("attend", absl::InternalError("max |error| " +
                                              std::to_string(max_error)));
  }
  std::printf(
      "PASS attend: [2, 8, 64, 32] causal GQA, max |error| %.2e, "
      "server compute %lld us of %lld us\n",
      max_error, static_cast<long long>(response->timing().compute_us()),
      static_cast<long long>(response->timing().server_us()));
  return 0;
}

// A prompt, then decode steps of one token each, against the reference over
// every token the session holds.
int CheckSession(attnserve::Client& client, std::mt19937& random) {
  constexpr int64_t kH = 8, kHkv = 2, kD = 32, kPrompt = 60, kSteps = 4;
  attnserve::v1::CreateSessionRequest create;
  create.set_num_layers(1);
  create.set_num_heads(kH);
  create.set_num_kv_heads(kHkv);
  create.set_key_dim(kD);
  create.set_dtype(attnserve::v1::FLOAT32);
  absl::StatusOr<attnserve::Session> session =
      attnserve::Session::Create(&client, create, kTimeout);
  if (!session.ok()) return Fail("session", session.status());

  // What the session holds, per key/value head: [Hkv][tokens][D].
  std::vector<std::vector<float>> keys(kHkv), values(kHkv);
  const auto append = [&](int64_t tokens, attnserve::v1::Tensor* key_tensor,
                          attnserve::v1::Tensor* value_tensor) {
    const std::vector<float> key = Random(kHkv * tokens * kD, random);
    const std::vector<float> value = Random(kHkv * tokens * kD, random);
    for (int64_t g = 0; g < kHkv; ++g) {
      keys[g].insert(keys[g].end(), key.begin() + g * tokens * kD,
                     key.begin() + (g + 1) * tokens * kD);
      values[g].insert(values[g].end(), value.begin() + g * tokens * kD,
                       value.begin() + (g + 1) * tokens * kD);
    }
    *key_tensor =
        attnserve::MakeTensor(attnserve::v1::FLOAT32, {kHkv, tokens, kD}, key);
    *value_tensor = attnserve::MakeTensor(attnserve::v1::FLOAT32,
                                          {kHkv, tokens, kD}, value);
  };

  attnserve::v1::Tensor key, value;
  append(kPrompt, &key, &value);
  absl::Status status =
      session->Append(/*layer=*/0, std::move(key), std::move(value), kTimeout);
  if (!status.ok()) return Fail("session", status);

  double max_error = 0;
  for (int64_t step = 0; step < kSteps; ++step) {
    append(1, &key, &value);
    const std::vector<float> query = Random(kH * kD, random);
    absl::StatusOr<attnserve::StepOutput> out = session->Attend(
        /*layer=*/0, std::move(key), std::move(value),
        attnserve::MakeTensor(attnserve::v1::FLOAT32, {kH, 1, kD}, query),
        attnserve::v1::StepOptions(), kTimeout);
    if (!out.ok()) return Fail("session", out.status());
    std::vector<float> output(kH * kD);
    status = attnserve::ReadFloatsInto(*out->output, {kH, 1, kD},
                                       absl::MakeSpan(output));
    if (!status.ok()) return Fail("session", status);
    const int64_t tokens = kPrompt + step + 1;
    for (int64_t h = 0; h < kH; ++h) {
      const int64_t g = h / (kH / kHkv);
      const std::vector<double> expected = AttendRow(
          &query[h * kD], keys[g].data(), values[g].data(), tokens, kD);
      for (int64_t c = 0; c < kD; ++c) {
        max_error =
            std::max(max_error, std::abs(output[h * kD + c] - expected[c]));
      }
    }
  }
  status = session->Delete(kTimeout);
  if (!status.ok()) return Fail("session", status);
  if (max_error > kTolerance) {
    return Fail("session", absl::InternalError("max |error| " +
                                               std::to_string(max_error)));
  }
  std::printf(
      "PASS session: %lld-token prompt, %lld decode steps, "
      "max |error| %.2e\n",
      static_cast<long long>(kPrompt), static_cast<long long>(kSteps),
      max_error);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string target = argc > 1 ? argv[1] : "localhost:50051";
  attnserve::ClientOptions options;
  options.wait_for_ready = true;  // rides out a server still starting
  absl::StatusOr<std::unique_ptr<attnserve::Client>> client =
      attnserve::Client::Connect(target, options);
  if (!client.ok()) return Fail("connect", client.status());
  std::mt19937 random(2026);
  if (CheckAttend(**client, random) != 0) return 1;
  if (CheckSession(**client, random) != 0) return 1;
  return 0;
}
