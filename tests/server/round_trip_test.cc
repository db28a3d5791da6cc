// A server on loopback, called through the client library, against the
// reference.
#include <algorithm>
#include <cmath>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "attnserve/server/attention/attention_compute.h"
#include "attnserve/server/attention/request_validator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"
#include "server/server_fixture.h"

namespace attnserve {
namespace {

using ::attnserve::testing::RandomValues;
using ::attnserve::testing::ReferenceAttention;
using ::attnserve::testing::ReferenceShape;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(30);

v1::AttendRequest MakeRequest(const ReferenceShape& s, uint64_t seed) {
  return ::attnserve::testing::RandomAttendRequest(s, seed);
}

// The reference's answer for a request built by MakeRequest.
std::vector<double> Expected(const ReferenceShape& s,
                             const v1::AttendRequest& request) {
  ::attnserve::testing::ReferenceOptions options;
  if (request.options().has_scale()) options.scale = request.options().scale();
  return ReferenceAttention(s, Float32Values(request.query()).value(),
                            Float32Values(request.key()).value(),
                            Float32Values(request.value()).value(), options)
      .output;
}

void ExpectMatchesReference(const std::vector<float>& actual,
                            const std::vector<double>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    ASSERT_NEAR(actual[i], expected[i], 2e-6 + 1e-5 * std::abs(expected[i]))
        << "index " << i;
  }
}

// `half` with its query, key and value sent as FLOAT32: the same values.
v1::AttendRequest Float32Twin(const v1::AttendRequest& half) {
  v1::AttendRequest full = half;
  for (v1::Tensor* tensor :
       {full.mutable_query(), full.mutable_key(), full.mutable_value()}) {
    const std::vector<float> values = FloatValues(*tensor).value();
    *tensor = MakeTensor(
        v1::FLOAT32,
        std::vector<int64_t>(tensor->shape().begin(), tensor->shape().end()),
        values);
  }
  return full;
}

// Sends `half` and its FLOAT32 twin: their outputs and lse must be equal,
// bit for bit.
template <typename Client>
void ExpectSameAnswersAsFloat32(Client& client, const v1::AttendRequest& half) {
  const absl::StatusOr<v1::AttendResponse> in_place =
      client.Attend(half, kTimeout);
  const absl::StatusOr<v1::AttendResponse> widened =
      client.Attend(Float32Twin(half), kTimeout);
  ASSERT_TRUE(in_place.ok()) << in_place.status();
  ASSERT_TRUE(widened.ok()) << widened.status();
  EXPECT_EQ(FloatValues(in_place->output()).value(),
            FloatValues(widened->output()).value());
  EXPECT_EQ(FloatValues(in_place->lse()).value(),
            FloatValues(widened->lse()).value());
}

using RoundTripTest = ::attnserve::testing::ServerFixture;

TEST_F(RoundTripTest, AttendMatchesReferenceAcrossShapes) {
  const ReferenceShape shapes[] = {
      {1, 1, 1, 1, 1, 1, 1},     {2, 3, 3, 17, 129, 16, 8},
      {1, 4, 2, 129, 3, 3, 17},  {3, 2, 1, 1, 17, 64, 64},
      {2, 8, 8, 64, 64, 64, 64},
  };
  uint64_t seed = 10;
  for (const ReferenceShape& s : shapes) {
    SCOPED_TRACE(::testing::Message()
                 << "B=" << s.batch << " H=" << s.heads << " Hkv=" << s.kv_heads
                 << " Lq=" << s.query_len << " Lk=" << s.key_len
                 << " Dk=" << s.key_dim << " Dv=" << s.value_dim);
    const v1::AttendRequest request = MakeRequest(s, seed += 3);
    absl::StatusOr<v1::AttendResponse> response =
        client_->Attend(request, kTimeout);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->output().dtype(), v1::FLOAT32);
    EXPECT_THAT(response->output().shape(),
                ElementsAre(s.batch, s.heads, s.query_len, s.value_dim));
    ExpectMatchesReference(Float32Values(response->output()).value(),
                           Expected(s, request));
  }
}

// Decode-shaped Attends over BFLOAT16 and FLOAT16 keys and values are read in
// place, in their dtype (the paged kernel); their answers equal those of the
// same values sent as FLOAT32 (the fused kernel) within 1e-6 relative, with
// GQA, key lengths (one of 0), lse, and without or with the bottom-right
// causal mask.
TEST_F(RoundTripTest, HalfPrecisionDecodeReadInPlaceAgreesWithFloat32) {
  const int64_t batch = 3, heads = 8, kv_heads = 2, keys = 300, dim = 128;
  for (const v1::DType dtype : {v1::BFLOAT16, v1::FLOAT16}) {
    for (const bool causal : {false, true}) {
      for (const bool lengths : {false, true}) {
        SCOPED_TRACE(absl::StrCat(v1::DType_Name(dtype), " causal ", causal,
                                  " key_lengths ", lengths));
        v1::AttendRequest half;
        *half.mutable_query() =
            MakeTensor(dtype, {batch, heads, 1, dim},
                       RandomValues(batch * heads * dim, 1));
        *half.mutable_key() =
            MakeTensor(dtype, {batch, kv_heads, keys, dim},
                       RandomValues(batch * kv_heads * keys * dim, 2));
        *half.mutable_value() =
            MakeTensor(dtype, {batch, kv_heads, keys, dim},
                       RandomValues(batch * kv_heads * keys * dim, 3));
        v1::AttentionOptions& options = *half.mutable_options();
        options.set_return_lse(true);
        if (causal) {
          options.set_causal(true);
          options.set_causal_alignment(v1::AttentionOptions::BOTTOM_RIGHT);
        }
        if (lengths) {
          for (const int64_t length : {300, 0, 17}) {
            options.add_key_lengths(length);
          }
        }
        v1::AttendRequest full = Float32Twin(half);
        full.mutable_options()->set_output_dtype(v1::FLOAT32);
        half.mutable_options()->set_output_dtype(v1::FLOAT32);
        const absl::StatusOr<v1::AttendResponse> in_place =
            client_->Attend(half, kTimeout);
        const absl::StatusOr<v1::AttendResponse> widened =
            client_->Attend(full, kTimeout);
        ASSERT_TRUE(in_place.ok()) << in_place.status();
        ASSERT_TRUE(widened.ok()) << widened.status();
        const std::vector<float> a = FloatValues(in_place->output()).value();
        const std::vector<float> b = FloatValues(widened->output()).value();
        ASSERT_EQ(a.size(), b.size());
        for (size_t i = 0; i < a.size(); ++i) {
          ASSERT_NEAR(a[i], b[i], 1e-6 * std::max(1.0f, std::abs(b[i])))
              << "output " << i;
        }
        const std::vector<float> lse_a = FloatValues(in_place->lse()).value();
        const std::vector<float> lse_b = FloatValues(widened->lse()).value();
        ASSERT_EQ(lse_a.size(), lse_b.size());
        for (size_t i = 0; i < lse_a.size(); ++i) {
          if (std::isinf(lse_b[i])) {
            EXPECT_EQ(lse_a[i], lse_b[i]) << "lse " << i;
          } else {
            ASSERT_NEAR(lse_a[i], lse_b[i],
                        1e-6 * std::max(1.0f, std::abs(lse_b[i])))
                << "lse " << i;
          }
        }
      }
    }
  }
}

// A decode whose keys and values alone are half precision, with ALiBi (or a
// window), takes a path that computes them: the slopes are seen when the
// route is chosen, not only once the options are bound.
TEST_F(RoundTripTest, HalfPrecisionDecodeWithALiBiOrAWindowIsComputed) {
  for (const bool alibi : {true, false}) {
    SCOPED_TRACE(alibi ? "ALiBi" : "window");
    v1::AttendRequest half;
    *half.mutable_query() =
        MakeTensor(v1::FLOAT32, {1, 4, 1, 16}, RandomValues(64, 11));
    *half.mutable_key() =
        MakeTensor(v1::BFLOAT16, {1, 2, 40, 16}, RandomValues(1280, 12));
    *half.mutable_value() =
        MakeTensor(v1::BFLOAT16, {1, 2, 40, 16}, RandomValues(1280, 13));
    if (alibi) {
      *half.mutable_options()->mutable_alibi_slopes() =
          MakeTensor(v1::FLOAT32, {4}, {0.5f, 0.25f, 0.125f, 0.0625f});
    } else {
      half.mutable_options()->set_window_left(7);
      half.mutable_options()->set_causal(true);
      half.mutable_options()->set_causal_alignment(
          v1::AttentionOptions::BOTTOM_RIGHT);
    }
    const absl::StatusOr<v1::AttendResponse> in_place =
        client_->Attend(half, kTimeout);
    const absl::StatusOr<v1::AttendResponse> widened =
        client_->Attend(Float32Twin(half), kTimeout);
    ASSERT_TRUE(in_place.ok()) << in_place.status();
    ASSERT_TRUE(widened.ok()) << widened.status();
    const std::vector<float> a = FloatValues(in_place->output()).value();
    const std::vector<float> b = FloatValues(widened->output()).value();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_NEAR(a[i], b[i], 1e-6 * std::max(1.0f, std::abs(b[i])))
          << "output " << i;
    }
  }
}

// Prefill-shaped Attends over BFLOAT16 and FLOAT16 tensors are read where
// they lie (AttentionEngine::AttendHalf, no f32 copy) and answer exactly what
// the same values sent as FLOAT32 answer, at both precisions, with GQA, a
// causal mask, key lengths and lse.
TEST_F(RoundTripTest, HalfPrecisionPrefillReadInPlaceEqualsFloat32) {
  const int64_t batch = 2, heads = 8, kv_heads = 2, queries = 70, keys = 300,
                dim = 64;
  for (const v1::DType dtype : {v1::BFLOAT16, v1::FLOAT16}) {
    for (const auto precision :
         {v1::AttentionOptions::F32, v1::AttentionOptions::BF16}) {
      SCOPED_TRACE(
          absl::StrCat(v1::DType_Name(dtype), " precision ",
                       v1::AttentionOptions::Precision_Name(precision)));
      v1::AttendRequest half;
      *half.mutable_query() =
          MakeTensor(dtype, {batch, heads, queries, dim},
                     RandomValues(batch * heads * queries * dim, 11));
      *half.mutable_key() =
          MakeTensor(dtype, {batch, kv_heads, keys, dim},
                     RandomValues(batch * kv_heads * keys * dim, 12));
      *half.mutable_value() =
          MakeTensor(dtype, {batch, kv_heads, keys, dim},
                     RandomValues(batch * kv_heads * keys * dim, 13));
      v1::AttentionOptions& options = *half.mutable_options();
      options.set_return_lse(true);
      options.set_causal(true);
      options.set_causal_alignment(v1::AttentionOptions::BOTTOM_RIGHT);
      options.add_key_lengths(300);
      options.add_key_lengths(123);
      options.set_precision(precision);
      options.set_output_dtype(v1::FLOAT32);
      ExpectSameAnswersAsFloat32(*client_, half);
    }
  }
}

// Packed sequences in one half dtype are read where they lie too
// (AttendPackedHalf) and answer exactly what their FLOAT32 twin answers.
TEST_F(RoundTripTest, HalfPrecisionPackedSequencesEqualFloat32) {
  const int64_t heads = 4, kv_heads = 2, dim = 32;
  const std::vector<int64_t> cu_q = {0, 5, 5, 70}, cu_k = {0, 40, 41, 300};
  for (const v1::DType dtype : {v1::BFLOAT16, v1::FLOAT16}) {
    for (const auto precision :
         {v1::AttentionOptions::F32, v1::AttentionOptions::BF16}) {
      SCOPED_TRACE(
          absl::StrCat(v1::DType_Name(dtype), " precision ",
                       v1::AttentionOptions::Precision_Name(precision)));
      v1::AttendRequest half;
      *half.mutable_query() = MakeTensor(dtype, {cu_q.back(), heads, dim},
                                         RandomValues(70 * heads * dim, 21));
      *half.mutable_key() = MakeTensor(dtype, {cu_k.back(), kv_heads, dim},
                                       RandomValues(300 * kv_heads * dim, 22));
      *half.mutable_value() =
          MakeTensor(dtype, {cu_k.back(), kv_heads, dim},
                     RandomValues(300 * kv_heads * dim, 23));
      v1::AttentionOptions& options = *half.mutable_options();
      for (const int64_t offset : cu_q) options.add_cu_seqlens_q(offset);
      for (const int64_t offset : cu_k) options.add_cu_seqlens_k(offset);
      options.set_causal(true);
      options.set_causal_alignment(v1::AttentionOptions::BOTTOM_RIGHT);
      options.set_return_lse(true);
      options.set_precision(precision);
      options.set_output_dtype(v1::FLOAT32);
      ExpectSameAnswersAsFloat32(*client_, half);
    }
  }
}

// Which Attends the validator marks for AttendHalf: query, key and value all
// in one half-precision dtype, any shape.
TEST(AttendReadsInputsInPlaceTest, AllThreeInOneHalfDtype) {
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(EngineOptions{}).value();
  RequestChecks checks;
  checks.engine = engine.get();
  const auto decide = [&checks](v1::DType query, v1::DType key_value) {
    v1::AttendRequest request;
    *request.mutable_query() =
        MakeTensor(query, {1, 4, 9, 16}, RandomValues(4 * 9 * 16, 1));
    *request.mutable_key() =
        MakeTensor(key_value, {1, 2, 40, 16}, RandomValues(2 * 40 * 16, 2));
    *request.mutable_value() =
        MakeTensor(key_value, {1, 2, 40, 16}, RandomValues(2 * 40 * 16, 3));
    const absl::StatusOr<AttendWork> work =
        ValidateAttendRequest(request, checks);
    EXPECT_TRUE(work.ok()) << work.status();
    return work.ok() && work->inputs_in_place;
  };
  EXPECT_TRUE(decide(v1::BFLOAT16, v1::BFLOAT16));
  EXPECT_TRUE(decide(v1::FLOAT16, v1::FLOAT16));
  EXPECT_FALSE(decide(v1::FLOAT32, v1::FLOAT32));
  EXPECT_FALSE(decide(v1::FLOAT32, v1::BFLOAT16));
  EXPECT_FALSE(decide(v1::BFLOAT16, v1::FLOAT16));
}

// Which Attends ComputeAttend reads in place: decode-shaped, half-precision
// keys and values, no mask, no weights, no top-left causal mask.
TEST(AttendReadsKeysInPlaceTest, OnlyHalfPrecisionDecodeWithoutMasks) {
  std::unique_ptr<AttentionEngine> engine =
      AttentionEngine::Create(EngineOptions{}).value();
  RequestChecks checks;
  checks.engine = engine.get();
  const auto decide = [&checks, &engine](v1::DType dtype, int64_t query_len,
                                         const auto& set_options) {
    v1::AttendRequest request;
    *request.mutable_query() = MakeTensor(dtype, {2, 4, query_len, 16},
                                          RandomValues(128 * query_len, 1));
    *request.mutable_key() =
        MakeTensor(dtype, {2, 2, 40, 16}, RandomValues(2 * 2 * 40 * 16, 2));
    *request.mutable_value() =
        MakeTensor(dtype, {2, 2, 40, 16}, RandomValues(2 * 2 * 40 * 16, 3));
    set_options(request.mutable_options());
    const absl::StatusOr<AttendWork> work =
        ValidateAttendRequest(request, checks);
    EXPECT_TRUE(work.ok()) << work.status();
    return work.ok() && AttendReadsKeysInPlace(*engine, *work, request);
  };
  const auto none = [](v1::AttentionOptions*) {};
  EXPECT_TRUE(decide(v1::BFLOAT16, 1, none));
  EXPECT_TRUE(decide(v1::FLOAT16, 1, none));
  EXPECT_FALSE(decide(v1::FLOAT32, 1, none));  // Read in place anyway.
  EXPECT_FALSE(decide(v1::BFLOAT16, 2, none));
  EXPECT_TRUE(decide(v1::BFLOAT16, 1, [](v1::AttentionOptions* o) {
    o->set_causal(true);
    o->set_causal_alignment(v1::AttentionOptions::BOTTOM_RIGHT);
    o->add_key_lengths(40);
    o->add_key_lengths(0);
    o->set_return_lse(true);
    o->set_precision(v1::AttentionOptions::BF16);
  }));
  EXPECT_FALSE(decide(v1::BFLOAT16, 1, [](v1::AttentionOptions* o) {
    o->set_causal(true);  // Top-left: the one row sees key 0 alone.
  }));
  EXPECT_FALSE(decide(v1::BFLOAT16, 1, [](v1::AttentionOptions* o) {
    o->set_return_weights(v1::AttentionOptions::PER_HEAD);
  }));
  EXPECT_FALSE(decide(v1::BFLOAT16, 1, [](v1::AttentionOptions* o) {
    *o->mutable_alibi_slopes() =
        MakeTensor(v1::FLOAT32, {4}, {0.5f, 0.25f, 0.125f, 0.0625f});
  }));
  EXPECT_FALSE(decide(v1::BFLOAT16, 1, [](v1::AttentionOptions* o) {
    *o->mutable_attn_mask() = MakeBoolTensor({40}, std::vector<bool>(40, true));
  }));
}

TEST_F(RoundTripTest, CustomScaleTravelsToTheEngine) {
  const ReferenceShape s = {1, 2, 2, 9, 9, 8, 8};
  v1::AttendRequest request = MakeRequest(s, 40);
  request.mutable_options()->set_scale(3.0f);
  absl::StatusOr<v1::AttendResponse> response =
      client_->Attend(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  ExpectMatchesReference(Float32Values(response->output()).value(),
                         Expected(s, request));
}

TEST_F(RoundTripTest, ResponseCarriesServerTimings) {
  const v1::AttendRequest request =
      MakeRequest({2, 8, 8, 128, 128, 64, 64}, 50);
  absl::StatusOr<v1::AttendResponse> response =
      client_->Attend(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(response->has_timing());
  EXPECT_GE(response->timing().queue_us(), 0);
  EXPECT_GT(response->timing().compute_us(), 0);
  EXPECT_GE(response->timing().server_us(), response->timing().compute_us());
}

TEST_F(RoundTripTest, ConcurrentCallersEachGetTheirOwnAnswer) {
  const ReferenceShape s = {1, 2, 2, 17, 33, 16, 16};
  constexpr int kCallers = 4;
  constexpr int kCallsEach = 5;
  std::vector<std::thread> callers;
  std::vector<int> failures(kCallers, 0);
  for (int caller = 0; caller < kCallers; ++caller) {
    callers.emplace_back([&, caller] {
      for (int call = 0; call < kCallsEach; ++call) {
        const v1::AttendRequest request =
            MakeRequest(s, 1000 + caller * 100 + call);
        absl::StatusOr<v1::AttendResponse> response =
            client_->Attend(request, kTimeout);
        const std::vector<double> expected = Expected(s, request);
        std::vector<float> actual =
            response.ok() ? Float32Values(response->output()).value()
                          : std::vector<float>();
        bool matches = actual.size() == expected.size();
        for (size_t i = 0; matches && i < actual.size(); ++i) {
          matches = std::abs(actual[i] - expected[i]) <=
                    2e-6 + 1e-5 * std::abs(expected[i]);
        }
        if (!matches) ++failures[caller];
      }
    });
  }
  for (std::thread& caller : callers) caller.join();
  EXPECT_THAT(failures, ::testing::Each(0));
}

TEST_F(RoundTripTest, HealthReportsServingForServerAndService) {
  for (const char* service : {"", "attnserve.v1.AttentionService"}) {
    SCOPED_TRACE(service);
    absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus>
        status = client_->CheckHealth(service, kTimeout);
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_EQ(*status, grpc::health::v1::HealthCheckResponse::SERVING);
  }
}

TEST_F(RoundTripTest, HealthOfUnknownServiceIsNotFound) {
  EXPECT_EQ(client_->CheckHealth("no.such.Service", kTimeout).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(RoundTripTest, HealthTurnsNotServingOnShutdown) {
  server_->Shutdown();
  const absl::StatusCode code =
      client_->CheckHealth("", absl::Seconds(2)).status().code();
  EXPECT_THAT(code, ::testing::AnyOf(absl::StatusCode::kUnavailable,
                                     absl::StatusCode::kDeadlineExceeded));
}

TEST_F(RoundTripTest, ExpiredDeadlineIsNotComputed) {
  const v1::AttendRequest request = MakeRequest({1, 1, 1, 1, 1, 1, 1}, 60);
  EXPECT_EQ(client_->Attend(request, absl::Seconds(-1)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(ServerStartTest, RejectsBadOptionsByName) {
  struct Case {
    const char* field;
    void (*mutate)(ServerOptions&);
  };
  const Case cases[] = {
      {"port", [](ServerOptions& o) { o.port = 70000; }},
      {"threads", [](ServerOptions& o) { o.engine.num_threads = -2; }},
      {"num_threads is 5000",
       [](ServerOptions& o) { o.engine.num_threads = 5000; }},
      {"drain_grace is inf",
       [](ServerOptions& o) { o.drain_grace = absl::InfiniteDuration(); }},
      {"max_queue_delay is 11s",
       [](ServerOptions& o) {
         o.scheduling.max_queue_delay = absl::Seconds(11);
       }},
      {"message_timeout is inf",
       [](ServerOptions& o) {
         o.transport.message_timeout = absl::Seconds(std::nan(""));
       }},
      {"stream_idle_timeout is 0",
       [](ServerOptions& o) {
         o.transport.stream_idle_timeout = absl::ZeroDuration();
       }},
      {"handshake_timeout is 2h, expected > 0 and at most 1h",
       [](ServerOptions& o) {
         o.transport.handshake_timeout = absl::Hours(2);
       }},
      {"address is \"127.0.0.1:50051\", expected a host name or an IP "
       "address without a port",
       [](ServerOptions& o) { o.address = "127.0.0.1:50051"; }},
      {"metrics_address is \"10.0.0.300\", expected an IPv4 address",
       [](ServerOptions& o) { o.metrics_address = "10.0.0.300"; }},
      {"tls.reload_interval is -1s, expected zero (off) or positive",
       [](ServerOptions& o) { o.tls.reload_interval = absl::Seconds(-1); }},
      {"metrics_port is 50051, the same as `port`",
       [](ServerOptions& o) {
         o.port = 50051;
         o.metrics_port = 50051;
       }},
      {"max_message_bytes",
       [](ServerOptions& o) {
         o.transport.max_message_bytes = int64_t{1} << 31;
       }},
      {"max_workspace_bytes",
       [](ServerOptions& o) { o.engine.max_workspace_bytes = 0; }},
      {"max_batch", [](ServerOptions& o) { o.scheduling.max_batch = 0; }},
      {"executors", [](ServerOptions& o) { o.scheduling.executors = 0; }},
      {"max_queue", [](ServerOptions& o) { o.scheduling.max_queue = -1; }},
      {"metrics_port", [](ServerOptions& o) { o.metrics_port = 70000; }},
      {"tls.cert_file", [](ServerOptions& o) { o.tls.cert_file = "x.pem"; }},
      {"max_weights_bytes",
       [](ServerOptions& o) { o.memory.max_weights_bytes = -1; }},
  };
  for (const Case& test_case : cases) {
    SCOPED_TRACE(test_case.field);
    ServerOptions options;
    options.address = "127.0.0.1";
    options.port = 0;
    test_case.mutate(options);
    const absl::Status status = AttnServer::Start(options).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr(test_case.field));
  }
}

TEST(ServerStartTest, PortInUseIsUnavailable) {
  ServerOptions options;
  options.address = "127.0.0.1";
  options.port = 0;
  absl::StatusOr<std::unique_ptr<AttnServer>> first =
      AttnServer::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  options.port = (*first)->port();
  const absl::Status second = AttnServer::Start(options).status();
  EXPECT_EQ(second.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.message(), HasSubstr(absl::StrCat(options.port)));
}

}  // namespace
}  // namespace attnserve
