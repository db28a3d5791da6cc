// The /metrics endpoint: Prometheus's text format over HTTP/1.1, on one
// thread that polls every connection (epoll), so that connections held open
// idle or half-sent cost a slot each, never a thread, and cannot starve a
// scrape.
//
// Each connection may send one request (GET or HEAD of /metrics, answered
// with the registry's samples); what it sends after it is read and dropped
// until it closes its side, so that its answer is never cut short by a reset.
// One whose request has not fully arrived within the request timeout is
// closed, and one whose answer is not read within the write timeout reset.
// Each connection is read as soon as it is accepted; past the connection cap
// a new one takes the place of one whose answer its client has whole, else of
// the oldest still sending its request, else it is closed. Scrapes need no
// token: anyone who reaches the port may connect, so nothing a connection
// sends is held past max_request_bytes. The endpoint counts the connections
// it drops in the registry (attnserve_metrics_connections_dropped_total).
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

  // Serves `registry` on `host` (an IPv4 or IPv6 literal, or a name: each of
  // its addresses) and `port` (0: any free port). UNAVAILABLE saying why if it
  // cannot listen there (the address unknown, or in use).
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
