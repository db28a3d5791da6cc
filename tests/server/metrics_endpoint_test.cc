// The /metrics endpoint against clients that are not Prometheus: ones that
// send more than a request, proxies and odd request lines, a crowd arriving
// at once, and one that never reads its answer. Run against the endpoint
// alone, with a registry whose text is larger than the socket buffers.
#include "attnserve/server/metrics/metrics_endpoint.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "server/metrics_scrape.h"

namespace attnserve {
namespace {

using ::attnserve::testing::ConnectTo;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// A registry of `gauges` gauges: about 75 bytes each, so 4,000 make an
// exposition of about 300 KB, more than a loopback connection buffers unread,
// and 1,000 one the kernel takes whole at once.
std::shared_ptr<prometheus::Registry> LargeRegistry(int gauges = 4000) {
  auto registry = std::make_shared<prometheus::Registry>();
  auto& family = prometheus::BuildGauge()
                     .Name("test_gauge")
                     .Help("A gauge per label value")
                     .Register(*registry);
  for (int i = 0; i < gauges; ++i) {
    family.Add({{"series", absl::StrCat("value_number_", i)}}).Set(i);
  }
  return registry;
}

class MetricsEndpointTest : public ::testing::Test {
 protected:
  void Start(MetricsEndpoint::Options options = {}) {
    absl::StatusOr<std::unique_ptr<MetricsEndpoint>> endpoint =
        MetricsEndpoint::Start("127.0.0.1", 0, registry_, options);
    ASSERT_TRUE(endpoint.ok()) << endpoint.status();
    endpoint_ = *std::move(endpoint);
  }

  // Sends `request` on a new connection whose receive buffer is
  // `receive_buffer` bytes (0: the default), waits `before_reading`, and
  // returns what came back until the server closed, with ", reset" after it
  // if the connection was reset.
  std::string Ask(const std::string& request, int receive_buffer = 0,
                  absl::Duration before_reading = absl::ZeroDuration()) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (receive_buffer > 0) {
      setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &receive_buffer,
                 sizeof(receive_buffer));
    }
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(endpoint_->port()));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) !=
        0) {
      close(fd);
      return "connect failed";
    }
    timeval timeout{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
        static_cast<ssize_t>(request.size())) {
      close(fd);
      return "send failed";
    }
    absl::SleepFor(before_reading);
    std::string response;
    char buffer[65536];
    ssize_t n;
    while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0) {
      response.append(buffer, static_cast<size_t>(n));
    }
    if (n < 0 && errno == ECONNRESET) response += ", reset";
    close(fd);
    return response;
  }

  // Whether `response` is a whole 200 answer: its body as long as its
  // Content-Length says.
  static bool WholeAnswer(const std::string& response) {
    if (!absl::StartsWith(response, "HTTP/1.1 200 OK\r\n")) return false;
    const size_t length_at = response.find("Content-Length: ");
    const size_t body_at = response.find("\r\n\r\n");
    if (length_at == std::string::npos || body_at == std::string::npos) {
      return false;
    }
    const size_t length_end = response.find("\r\n", length_at);
    size_t length = 0;
    return absl::SimpleAtoi(
               response.substr(length_at + 16, length_end - length_at - 16),
               &length) &&
           response.size() == body_at + 4 + length;
  }

  std::shared_ptr<prometheus::Registry> registry_ = LargeRegistry();
  std::unique_ptr<MetricsEndpoint> endpoint_;
};

// A client that sends more than its request (a body, pipelined requests,
// bytes after a pause) gets its whole answer: until 2026-12-07 the endpoint
// closed with that input unread, the kernel reset the connection, and the
// answer's unsent part was lost (12 KB of 90 KB, an audit found).
TEST_F(MetricsEndpointTest, AClientSendingMoreGetsItsWholeAnswer) {
  Start();
  const std::string get = "GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n";
  std::string pipelined;
  for (int i = 0; i < 200; ++i) pipelined += get;
  for (const std::string& request :
       {"GET /metrics HTTP/1.1\r\nHost: a\r\nContent-Length: 10000\r\n\r\n" +
            std::string(10000, 'x'),
        pipelined}) {
    const std::string response = Ask(request, 8192, absl::Milliseconds(200));
    EXPECT_TRUE(WholeAnswer(response))
        << response.substr(0, 64) << " ... " << response.size() << " bytes"
        << (absl::EndsWith(response, ", reset") ? ", reset" : "");
  }
}

// Request lines as proxies and other clients write them: the absolute form,
// an empty line first, bare LF line ends; and what is no HTTP/1.x request.
TEST_F(MetricsEndpointTest, ProxiesAndOddRequestLinesAreAnsweredByTheRfc) {
  Start();
  for (const char* request :
       {"GET http://127.0.0.1:9090/metrics HTTP/1.1\r\nHost: a\r\n\r\n",
        "\r\nGET /metrics HTTP/1.1\r\nHost: a\r\n\r\n",
        "GET /metrics HTTP/1.0\nHost: a\n\n",
        "GET /metrics HTTP/1.1\nHost: a\n\r\n",
        "GET HTTP://127.0.0.1:9090/metrics HTTP/1.1\r\n\r\n"}) {
    EXPECT_TRUE(WholeAnswer(Ask(request))) << request;
  }
  EXPECT_THAT(Ask("FOO/9\r\n\r\n"), StartsWith("HTTP/1.1 400 "));
  EXPECT_THAT(Ask("GET /metrics FOO/9\r\n\r\n"), StartsWith("HTTP/1.1 400 "));
  EXPECT_THAT(Ask("GET  /metrics HTTP/1.1\r\n\r\n"),
              StartsWith("HTTP/1.1 400 "));
  EXPECT_THAT(Ask("GET /metrics HTTP/2.0\r\n\r\n"),
              StartsWith("HTTP/1.1 505 "));
}

// 600 scrapers at once, over the cap of 256, each sending its request as it
// connects and reading only later: every one is answered whole. Until
// 2026-12-07 the endpoint took the whole backlog before reading any, and at
// the cap closed connections whose requests it had not read: a third or
// more were reset.
TEST_F(MetricsEndpointTest, ACrowdOfScrapersIsAnsweredWhole) {
  Start();
  std::vector<int> clients;
  const std::string get = "GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n";
  for (int i = 0; i < 600; ++i) {
    const int fd = ConnectTo("127.0.0.1", endpoint_->port());
    ASSERT_GE(fd, 0);
    ASSERT_EQ(send(fd, get.data(), get.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(get.size()));
    clients.push_back(fd);
  }
  int whole = 0;
  for (const int fd : clients) {
    timeval timeout{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    std::string response;
    char buffer[65536];
    ssize_t n;
    while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0) {
      response.append(buffer, static_cast<size_t>(n));
    }
    whole += WholeAnswer(response) ? 1 : 0;
    close(fd);
  }
  EXPECT_EQ(whole, 600);
}

// A client that never reads its answer holds it only until the write timeout:
// then the connection is reset and the kernel drops what it still held.
// Until 2026-12-07 the endpoint closed the socket once the kernel had taken
// the answer, and the kernel kept it, unacknowledged, for minutes (an audit
// held 28 MB so with 316 connections, none of them counted).
TEST_F(MetricsEndpointTest, AnAnswerNobodyReadsIsDroppedAtTheWriteTimeout) {
  MetricsEndpoint::Options options;
  options.write_timeout = absl::Seconds(1);
  Start(options);
  const absl::Time start = absl::Now();
  const std::string response =
      Ask("GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n", 1024, absl::Seconds(2));
  EXPECT_THAT(response, HasSubstr(", reset"));
  EXPECT_FALSE(WholeAnswer(response));
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));
  // Counted: the registry serves the endpoint's own counter.
  EXPECT_THAT(Ask("GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n"),
              HasSubstr("attnserve_metrics_connections_dropped_total{reason="
                        "\"timed_out\"} 1"));
}

// A connection that opens with empty lines and never ends them is answered
// 431 at max_request_bytes like any other: they were passed over uncounted,
// and a client streaming them held the endpoint's one thread (every scrape)
// for as long as it sent, an audit found.
TEST_F(MetricsEndpointTest, EmptyLinesWithoutEndCountAgainstTheRequestLimit) {
  Start();
  std::string blank_lines;
  for (int i = 0; i < 8192; ++i) blank_lines += "\r\n";
  EXPECT_THAT(Ask(blank_lines), StartsWith("HTTP/1.1 431 "));
}

// Clients that shut their side, then reset, leave nothing behind: the kernel
// kept counting their answers as unacknowledged, so until 2026-12-07 each
// held its place until the write timeout and 256 of them refused every
// scrape for 10 s while the attacker held nothing. And 256 that never read
// their answers give their places, one per new connection, once those
// answers have waited a second: until then they refused every scrape.
TEST_F(MetricsEndpointTest, ResetAndUnreadAnswersGiveTheirPlaces) {
  // Answers the kernel takes whole, so that the endpoint is past sending
  // them when the resets come.
  registry_ = LargeRegistry(1000);
  Start();
  const std::string get = "GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n";
  const auto connect_small = [&] {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    const int small = 2048;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(endpoint_->port()));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(
        connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    EXPECT_EQ(send(fd, get.data(), get.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(get.size()));
    return fd;
  };
  std::vector<int> resetting;
  for (int i = 0; i < 270; ++i) {
    resetting.push_back(connect_small());
    shutdown(resetting.back(), SHUT_WR);
  }
  absl::SleepFor(absl::Milliseconds(500));
  for (const int fd : resetting) {
    const linger now{1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &now, sizeof(now));
    close(fd);
  }
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_TRUE(WholeAnswer(Ask(get)));

  std::vector<int> unread;
  for (int i = 0; i < 256; ++i) unread.push_back(connect_small());
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_TRUE(WholeAnswer(Ask(get)));
  for (const int fd : unread) close(fd);
}

// A name with several addresses is served on each, as gRPC's port is: until
// 2026-12-07 /metrics took the first (localhost: ::1 alone on Debian's
// /etc/hosts, and a scrape of 127.0.0.1 was refused).
TEST_F(MetricsEndpointTest, EveryAddressOfTheNameIsServed) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  ASSERT_EQ(getaddrinfo("localhost", "1", &hints, &found), 0);
  int addresses = 0;
  bool has_v4 = false;
  for (const addrinfo* at = found; at != nullptr; at = at->ai_next) {
    ++addresses;
    has_v4 = has_v4 || at->ai_family == AF_INET;
  }
  freeaddrinfo(found);
  if (addresses < 2 || !has_v4) {
    GTEST_SKIP() << "localhost has one address here: nothing to compare";
  }
  absl::StatusOr<std::unique_ptr<MetricsEndpoint>> endpoint =
      MetricsEndpoint::Start("localhost", 0, registry_, {});
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  endpoint_ = *std::move(endpoint);
  EXPECT_TRUE(WholeAnswer(Ask("GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n")));
}

}  // namespace
}  // namespace attnserve
