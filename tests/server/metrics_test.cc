// /metrics scraped over HTTP after a known mix of calls: exact counters and
// histogram counts.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/channel.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "reference/reference_attention.h"
#include "server/metrics_scrape.h"
#include "server/server_fixture.h"

namespace attnserve {
namespace {

using ::attnserve::testing::RandomValues;
using ::attnserve::testing::Samples;
using ::attnserve::testing::Scrape;
using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(30);

v1::AttendRequest SmallAttend(uint64_t seed) {
  v1::AttendRequest request;
  *request.mutable_query() =
      MakeFloat32Tensor({1, 2, 4, 8}, RandomValues(64, seed));
  *request.mutable_key() =
      MakeFloat32Tensor({1, 2, 6, 8}, RandomValues(96, seed + 1));
  *request.mutable_value() =
      MakeFloat32Tensor({1, 2, 6, 8}, RandomValues(96, seed + 2));
  return request;
}

class MetricsTest : public ::attnserve::testing::ServerFixture {
 protected:
  void SetUp() override {
    ServerOptions options = DefaultOptions();
    options.metrics_port = 0;
    StartServer(options);
  }
};

// Scrapes need no token, so anyone who reaches the port can hold connections
// open: idle ones, and ones that stop half-way through a request. Prometheus
// must still be answered (within Scrape's 10 s), and the held connections
// dropped after the request timeout. 300 are held: more than the endpoint's
// 256 slots (the oldest then goes for each new one), and more than enough to
// have held every thread of a thread-per-connection server for a minute.
TEST_F(MetricsTest, ScrapesAreAnsweredWhileConnectionsAreHeldOpen) {
  std::vector<int> held;
  for (int i = 0; i < 300; ++i) {
    held.push_back(
        ::attnserve::testing::ConnectTo("127.0.0.1", server_->metrics_port()));
    ASSERT_GE(held.back(), 0);
    if (i % 2 == 1) {
      const char partial[] = "GET /metrics HTTP/1.1\r\nHost: a";
      ASSERT_GT(write(held.back(), partial, sizeof(partial) - 1), 0);
    }
  }
  for (int scrape = 0; scrape < 3; ++scrape) {
    EXPECT_THAT(Scrape(server_->metrics_port()),
                HasSubstr("attnserve_build_info"))
        << "scrape " << scrape;
  }
  // The held connections are closed by the server after its request timeout
  // (5 s): a read returns 0 (or an error), never blocks past 10 s.
  for (int fd : held) {
    timeval timeout{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    char byte;
    const ssize_t n = read(fd, &byte, 1);
    EXPECT_FALSE(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        << "a held connection was still open after 10 s";
    close(fd);
  }
}

using MetricsAddressTest = ::attnserve::testing::ServerFixture;

// The local addresses ("0200007F" is 127.0.0.2) of this process's listening
// TCP sockets on `port`, from /proc/net/tcp and /proc/self/fd. A connection
// test cannot tell: another test's server may listen on 127.0.0.1 at the
// same port number, which the kernel hands out per address.
std::vector<std::string> OwnListeningAddresses(int port) {
  std::set<std::string> own_inodes;
  for (const auto& entry :
       std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code error;
    const std::string target =
        std::filesystem::read_symlink(entry.path(), error).string();
    if (!error && absl::StartsWith(target, "socket:[")) {
      own_inodes.insert(target.substr(8, target.size() - 9));
    }
  }
  std::vector<std::string> addresses;
  std::ifstream table("/proc/net/tcp");
  std::string line;
  std::getline(table, line);  // The header.
  while (std::getline(table, line)) {
    const std::vector<std::string> fields =
        absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (fields.size() < 10 || fields[3] != "0A") continue;  // LISTEN
    const std::vector<std::string> local = absl::StrSplit(fields[1], ':');
    int local_port = 0;
    if (local.size() != 2 || !absl::SimpleHexAtoi(local[1], &local_port) ||
        local_port != port) {
      continue;
    }
    if (own_inodes.count(fields[9]) > 0) addresses.push_back(local[0]);
  }
  return addresses;
}

TEST_F(MetricsAddressTest, MetricsServeOnTheirOwnAddress) {
  ServerOptions options = DefaultOptions();  // gRPC on 127.0.0.1
  options.metrics_port = 0;
  options.metrics_address = "127.0.0.2";
  StartServer(options);
  EXPECT_THAT(Scrape(server_->metrics_port(), "127.0.0.2"),
              HasSubstr("attnserve_build_info"));
  EXPECT_THAT(OwnListeningAddresses(server_->metrics_port()),
              ::testing::ElementsAre("0200007F"))
      << "metrics also answer on gRPC's address";
  EXPECT_THAT(server_->Describe(),
              HasSubstr(absl::StrCat("metrics on 127.0.0.2:",
                                     server_->metrics_port(), "/metrics")));
}

// What the endpoint answers besides a scrape: HEAD without the body, another
// path 404, another method 405; a request past 8 KiB 431.
TEST_F(MetricsTest, OnlyGetAndHeadOfMetricsAreServed) {
  const auto ask = [this](const std::string& request) {
    const int fd =
        ::attnserve::testing::ConnectTo("127.0.0.1", server_->metrics_port());
    EXPECT_GE(fd, 0);
    if (fd < 0) return std::string();
    timeval timeout{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    std::string response;
    size_t written = 0;
    while (written < request.size()) {
      const ssize_t n =
          write(fd, request.data() + written, request.size() - written);
      if (n <= 0) break;
      written += static_cast<size_t>(n);
    }
    char buffer[65536];
    ssize_t n;
    while ((n = read(fd, buffer, sizeof(buffer))) > 0)
      response.append(buffer, n);
    close(fd);
    return response;
  };
  const std::string head = ask("HEAD /metrics HTTP/1.1\r\nHost: a\r\n\r\n");
  EXPECT_THAT(head, ::testing::StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(head, HasSubstr("Content-Type: text/plain; version=0.0.4"));
  EXPECT_THAT(head, ::testing::EndsWith("\r\n\r\n"));  // No body.
  EXPECT_THAT(ask("GET /metrics?x=1 HTTP/1.1\r\n\r\n"),
              HasSubstr("attnserve_build_info"));
  EXPECT_THAT(ask("GET /other HTTP/1.1\r\n\r\n"),
              ::testing::StartsWith("HTTP/1.1 404 "));
  EXPECT_THAT(ask("GET /metricsX HTTP/1.1\r\n\r\n"),
              ::testing::StartsWith("HTTP/1.1 404 "));
  EXPECT_THAT(ask("POST /metrics HTTP/1.1\r\n\r\n"),
              ::testing::StartsWith("HTTP/1.1 405 "));
  EXPECT_THAT(ask("GET /metrics HTTP/1.1\r\nX: " + std::string(9000, 'x')),
              ::testing::StartsWith("HTTP/1.1 431 "));
}

// The endpoint listens on IPv6 addresses too (civetweb, before it, was built
// without IPv6: --address=::1 failed to start).
TEST_F(MetricsAddressTest, MetricsServeOnIpv6) {
  const int probe = socket(AF_INET6, SOCK_STREAM, 0);
  sockaddr_in6 loopback{};
  loopback.sin6_family = AF_INET6;
  loopback.sin6_addr = in6addr_loopback;
  const bool has_ipv6 =
      probe >= 0 && bind(probe, reinterpret_cast<sockaddr*>(&loopback),
                         sizeof(loopback)) == 0;
  if (probe >= 0) close(probe);
  if (!has_ipv6) GTEST_SKIP() << "this machine has no IPv6 loopback";
  ServerOptions options = DefaultOptions();
  options.metrics_port = 0;
  options.metrics_address = "::1";
  StartServer(options);
  const int fd = socket(AF_INET6, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  loopback.sin6_port = htons(static_cast<uint16_t>(server_->metrics_port()));
  ASSERT_EQ(
      connect(fd, reinterpret_cast<sockaddr*>(&loopback), sizeof(loopback)), 0);
  timeval timeout{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  const std::string request = "GET /metrics HTTP/1.1\r\n\r\n";
  ASSERT_EQ(write(fd, request.data(), request.size()),
            static_cast<ssize_t>(request.size()));
  std::string response;
  char buffer[65536];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0) response.append(buffer, n);
  close(fd);
  EXPECT_THAT(response, HasSubstr("attnserve_build_info"));
  EXPECT_THAT(server_->Describe(),
              HasSubstr(absl::StrCat(
                  "metrics on [::1]:", server_->metrics_port(), "/metrics")));
}

TEST_F(MetricsTest, ScrapeCountsAKnownMixOfCalls) {
  ASSERT_GT(server_->metrics_port(), 0);
  // 3 good Attend calls (one causal), 2 malformed, 1 MHA on the demo weights, 1
  // MHA on an unknown name, 1 ListWeights, 1 DeleteWeights of an unknown name.
  for (uint64_t seed : {1, 2})
    ASSERT_TRUE(client_->Attend(SmallAttend(seed), kTimeout).ok());
  v1::AttendRequest causal = SmallAttend(3);
  causal.mutable_options()->set_causal(true);
  ASSERT_TRUE(client_->Attend(causal, kTimeout).ok());
  v1::AttendRequest malformed = SmallAttend(4);
  malformed.clear_key();
  EXPECT_FALSE(client_->Attend(malformed, kTimeout).ok());
  EXPECT_FALSE(client_->Attend(malformed, kTimeout).ok());
  v1::MultiHeadAttentionRequest mha;
  *mha.mutable_query_input() =
      MakeFloat32Tensor({1, 3, 64}, RandomValues(192, 5));
  mha.set_weights_name("demo");
  ASSERT_TRUE(client_->MultiHeadAttention(mha, kTimeout).ok());
  mha.set_weights_name("missing");
  EXPECT_EQ(client_->MultiHeadAttention(mha, kTimeout).status().code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(client_->ListWeights(kTimeout).ok());
  EXPECT_EQ(client_->DeleteWeights("missing", kTimeout).status().code(),
            absl::StatusCode::kNotFound);

  const std::string text = Scrape(server_->metrics_port());
  ASSERT_FALSE(text.empty());
  const std::map<std::string, double> s = Samples(text);
  const auto value = [&](const std::string& key) {
    const auto it = s.find(key);
    EXPECT_NE(it, s.end()) << "no sample " << key;
    return it == s.end() ? -1.0 : it->second;
  };
  EXPECT_EQ(value(R"(attnserve_requests_total{code="OK",rpc="Attend"})"), 3);
  EXPECT_EQ(
      value(
          R"(attnserve_requests_total{code="INVALID_ARGUMENT",rpc="Attend"})"),
      2);
  EXPECT_EQ(
      value(R"(attnserve_requests_total{code="OK",rpc="MultiHeadAttention"})"),
      1);
  EXPECT_EQ(
      value(
          R"(attnserve_requests_total{code="NOT_FOUND",rpc="MultiHeadAttention"})"),
      1);
  EXPECT_EQ(value(R"(attnserve_requests_total{code="OK",rpc="ListWeights"})"),
            1);
  EXPECT_EQ(
      value(
          R"(attnserve_requests_total{code="NOT_FOUND",rpc="DeleteWeights"})"),
      1);
  EXPECT_EQ(value(R"(attnserve_requests_total{code="OK",rpc="PutWeights"})"),
            0);
  EXPECT_EQ(value(R"(attnserve_request_duration_seconds_count{rpc="Attend"})"),
            5);
  EXPECT_EQ(
      value(
          R"(attnserve_request_duration_seconds_bucket{rpc="Attend",le="+Inf"})"),
      5);
  EXPECT_EQ(value(R"(attnserve_queue_wait_seconds_count{rpc="Attend"})"), 3);
  EXPECT_EQ(value(R"(attnserve_compute_seconds_count{rpc="Attend"})"), 3);
  EXPECT_EQ(
      value(R"(attnserve_compute_seconds_count{rpc="MultiHeadAttention"})"), 1);
  EXPECT_EQ(value("attnserve_batch_size_count"), 4);
  EXPECT_EQ(value("attnserve_queue_depth"), 0);
  EXPECT_EQ(value("attnserve_requests_in_flight"), 0);
  // Attend: 2·B·H·Lq·Lk·(Dk+Dv) = 2·1·2·4·6·16 = 1536; causal (top left),
  // the rows see 1, 2, 3 and 4 of the 6 keys: 10 of 24 pairs.
  EXPECT_EQ(value(R"(attnserve_floating_point_operations_total{rpc="Attend"})"),
            1536 + 1536 + 1536 * 10 / 24);
  // MHA on demo (E=64, H=8, D=8), B=1, L=3: projections 2·3·64·64·4, attention
  // 2·8·3·3·16.
  EXPECT_EQ(
      value(
          R"(attnserve_floating_point_operations_total{rpc="MultiHeadAttention"})"),
      2.0 * 3 * 64 * 64 * 4 + 2.0 * 8 * 3 * 3 * 16);
  EXPECT_EQ(value(R"(attnserve_request_bytes_total{rpc="Attend"})"),
            2 * SmallAttend(1).ByteSizeLong() + causal.ByteSizeLong() +
                2 * malformed.ByteSizeLong());
  EXPECT_GT(value(R"(attnserve_response_bytes_total{rpc="Attend"})"),
            3 * 4 * 64);
  EXPECT_EQ(value("attnserve_weight_sets"), 1);
  EXPECT_GT(value("attnserve_weights_bytes"), 0);
  EXPECT_THAT(text, HasSubstr("attnserve_build_info{"));
  EXPECT_THAT(text, HasSubstr(R"(onednn_version="2.6.3")"));
  EXPECT_THAT(text, HasSubstr("# HELP attnserve_requests_total "));
  EXPECT_THAT(text,
              HasSubstr("# TYPE attnserve_request_duration_seconds histogram"));
}

TEST_F(MetricsTest, WeightGaugesFollowPutAndDelete) {
  v1::PutWeightsRequest put;
  put.set_name("copy");
  v1::ProjectionWeights& w = *put.mutable_weights();
  w.set_num_heads(2);
  *w.mutable_w_q() = MakeFloat32Tensor({4, 4}, RandomValues(16, 1));
  *w.mutable_w_k() = MakeFloat32Tensor({4, 4}, RandomValues(16, 2));
  *w.mutable_w_v() = MakeFloat32Tensor({4, 4}, RandomValues(16, 3));
  *w.mutable_w_o() = MakeFloat32Tensor({4, 4}, RandomValues(16, 4));
  absl::StatusOr<v1::PutWeightsResponse> response =
      client_->PutWeights(put, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  std::map<std::string, double> s = Samples(Scrape(server_->metrics_port()));
  EXPECT_EQ(s["attnserve_weight_sets"], 2);
  const double both = s["attnserve_weights_bytes"];
  ASSERT_TRUE(client_->DeleteWeights("copy", kTimeout).ok());
  s = Samples(Scrape(server_->metrics_port()));
  EXPECT_EQ(s["attnserve_weight_sets"], 1);
  EXPECT_EQ(s["attnserve_weights_bytes"],
            both - static_cast<double>(response->bytes()));
}

TEST_F(MetricsTest, BufferPoolGaugeShowsTheBytesKeptBetweenCalls) {
  // Tensors of 128 KiB (over the pool's 64 KiB floor) are kept once their call
  // ends; the gauge reads the pool as each later call is answered.
  v1::AttendRequest large;
  *large.mutable_query() =
      MakeFloat32Tensor({1, 1, 512, 64}, RandomValues(512 * 64, 1));
  *large.mutable_key() =
      MakeFloat32Tensor({1, 1, 512, 64}, RandomValues(512 * 64, 2));
  *large.mutable_value() =
      MakeFloat32Tensor({1, 1, 512, 64}, RandomValues(512 * 64, 3));
  ASSERT_TRUE(client_->Attend(large, kTimeout).ok());
  double kept = 0;
  // The call's request returns to the pool when gRPC is done with the call,
  // which may be just after its answer arrives: a few small calls, bounded.
  for (int i = 0; i < 50 && kept == 0; ++i) {
    ASSERT_TRUE(client_->Attend(SmallAttend(10 + i), kTimeout).ok());
    kept =
        Samples(Scrape(server_->metrics_port()))["attnserve_buffer_pool_bytes"];
  }
  EXPECT_GE(kept, 3 * 512 * 64 * 4);
  EXPECT_LE(kept, 256 << 20);  // --buffer_pool_bytes' default.
}

class InflightMetricsTest : public ::attnserve::testing::ServerFixture {
 protected:
  // A budget of 64 MiB gives calls 48 MiB (a quarter goes to gRPC's
  // buffers), and one connection half of that.
  void SetUp() override {
    ServerOptions options = DefaultOptions();
    options.metrics_port = 0;
    options.transport.max_message_bytes = 64 << 20;
    options.memory.max_inflight_bytes = int64_t{64} << 20;
    StartServer(options);
  }
};

TEST_F(InflightMetricsTest, BudgetGaugesShowTheLimitAndRefusals) {
  // The limit is there from the first scrape, before the first sample.
  EXPECT_EQ(Samples(Scrape(
                server_->metrics_port()))["attnserve_inflight_limit_bytes"],
            48 << 20);
  // A 3 MiB request whose 32 MiB of PER_HEAD weights take its compute past
  // the 24 MiB one connection may hold.
  v1::AttendRequest large;
  *large.mutable_query() =
      MakeFloat32Tensor({1, 8, 1024, 32}, RandomValues(8 * 1024 * 32, 1));
  *large.mutable_key() = large.query();
  *large.mutable_value() = large.query();
  large.mutable_options()->set_return_weights(v1::AttentionOptions::PER_HEAD);
  const absl::StatusOr<v1::AttendResponse> refused =
      client_->Attend(large, kTimeout);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("max_inflight_bytes"));
  ASSERT_TRUE(client_->Attend(SmallAttend(1), kTimeout).ok());
  // The gauges are sampled once a second.
  std::map<std::string, double> samples;
  for (int i = 0; i < 40 && samples["attnserve_inflight_refused_total"] < 1;
       ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    samples = Samples(Scrape(server_->metrics_port()));
  }
  EXPECT_EQ(samples["attnserve_inflight_refused_total"], 1);
  EXPECT_EQ(samples["attnserve_inflight_limit_bytes"], 48 << 20);
  EXPECT_GE(samples["attnserve_inflight_bytes"], 0);
  EXPECT_LT(samples["attnserve_inflight_bytes"], 1 << 20);
  EXPECT_EQ(samples["attnserve_reset_connections_closed_total"], 0);
  EXPECT_EQ(samples.count("attnserve_io_standby_events_total"), 1u);
}

// A ModelInfer's typed contents are packed into a copy beside them, which is
// charged as its message was: a 6 MiB QUERY whose 12 MiB output fits the 24
// MiB one connection may hold when it travels in raw_input_contents (moved,
// not copied) takes the call past it in fp32_contents.
TEST_F(InflightMetricsTest, TypedContentsArePackedWithinTheBudget) {
  const auto request = [](bool raw) {
    inference::ModelInferRequest infer;
    infer.set_model_name("sdpa");
    const std::vector<std::pair<const char*, std::vector<int64_t>>> inputs = {
        {"QUERY", {1, 1, 24576, 64}},
        {"KEY", {1, 1, 1, 64}},
        {"VALUE", {1, 1, 1, 128}}};
    for (const auto& [name, shape] : inputs) {
      auto* input = infer.add_inputs();
      input->set_name(name);
      input->set_datatype("FP32");
      int64_t elements = 1;
      for (const int64_t d : shape) {
        input->add_shape(d);
        elements *= d;
      }
      if (raw) {
        infer.add_raw_input_contents(
            std::string(static_cast<size_t>(4 * elements), '\0'));
      } else {
        input->mutable_contents()->mutable_fp32_contents()->Resize(
            static_cast<int>(elements), 0.5f);
      }
    }
    return infer;
  };
  const std::unique_ptr<inference::GRPCInferenceService::Stub> stub =
      inference::GRPCInferenceService::NewStub(client_->channel());
  const auto infer = [&stub, &request](bool raw) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + kTimeout));
    inference::ModelInferResponse response;
    return stub->ModelInfer(&context, request(raw), &response);
  };
  // The typed one first, on a server with nothing held: the copy is what
  // passes the budget.
  const grpc::Status typed = infer(false);
  EXPECT_EQ(typed.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << typed.error_message();
  EXPECT_THAT(typed.error_message(), HasSubstr("max_inflight_bytes"));
  // gRPC may still hold the first message's buffers for a moment, and then
  // resets the next stream (ENHANCE_YOUR_CALM) before attnserve sees it.
  grpc::Status raw = infer(true);
  for (int i = 0; i < 50 && !raw.ok() &&
                  absl::StrContains(raw.error_message(), "RST_STREAM");
       ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    raw = infer(true);
  }
  EXPECT_TRUE(raw.ok()) << raw.error_message();
}

}  // namespace
}  // namespace attnserve
