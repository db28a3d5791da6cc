// The /metrics endpoint: Prometheus's text format over HTTP/1.1, on one
// thread that polls every connection (epoll), so that connections held open
// idle or half-sent cost a slot each, never a thread, and cannot starve a
// scrape.
//
// Each connection may send one request (GET or HEAD of /metrics, answered
// with the registry's samples, and closed); one whose request has not fully
// arrived within the request timeout is closed, and past the connection cap
// the oldest still sending is closed for the new one. Scrapes need no token:
// anyone who reaches the port may connect, so nothing a connection sends is
// held past max_request_bytes.
#ifndef ATTNSERVE_SERVER_METRICS_METRICS_ENDPOINT_H_
#define ATTNSERVE_SERVER_METRICS_METRICS_ENDPOINT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "prometheus/registry.h"

namespace attnserve {

class MetricsEndpoint {
 public:
  struct Options {
    int max_connections = 256;
    absl::Duration request_timeout = absl::Seconds(5);
    // How long an answer may take to be read by its client.
    absl::Duration write_timeout = absl::Seconds(10);
    int64_t max_request_bytes = 8192;
  };

  // Serves `registry` on `host` (an IPv4 or IPv6 literal, or a name) and
  // `port` (0: any free port). UNAVAILABLE saying why if it cannot listen
  // there (the address unknown, or in use).
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const std::string& host, int port,
      std::shared_ptr<prometheus::Registry> registry, const Options& options);

  virtual ~MetricsEndpoint() = default;

  // The port it listens on.
  virtual int port() const = 0;

 protected:
  MetricsEndpoint() = default;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_METRICS_METRICS_ENDPOINT_H_
