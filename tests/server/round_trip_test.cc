// A server on loopback, called through the client library, against the
// reference.
#include <cmath>
#include <thread>
#include <vector>

#include "absl/time/time.h"
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
