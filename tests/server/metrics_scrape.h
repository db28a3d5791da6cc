// Scraping attnserve's /metrics over HTTP in tests.
#ifndef ATTNSERVE_TESTS_SERVER_METRICS_SCRAPE_H_
#define ATTNSERVE_TESTS_SERVER_METRICS_SCRAPE_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace attnserve::testing {

// A TCP connection to host:port (IPv4), or -1.
inline int ConnectTo(const char* host, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, host, &address.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) !=
      0) {
    close(fd);
    return -1;
  }
  return fd;
}

// GET http://host:port/metrics (host an IPv4 address); the body, or "" on
// failure or after 10 s.
inline std::string Scrape(int port, const char* host = "127.0.0.1") {
  const int fd = ConnectTo(host, port);
  if (fd < 0) return "";
  timeval timeout{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  std::string response;
  {
    const std::string request =
        "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(fd, request.data(), request.size()) ==
        static_cast<ssize_t>(request.size())) {
      char buffer[65536];
      ssize_t n;
      while ((n = read(fd, buffer, sizeof(buffer))) > 0)
        response.append(buffer, n);
    }
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

// Every sample line "name{labels} value" of a text exposition, keyed by
// "name{labels}".
inline std::map<std::string, double> Samples(const std::string& text) {
  std::map<std::string, double> samples;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    double value;
    if (space != absl::string_view::npos &&
        absl::SimpleAtod(line.substr(space + 1), &value)) {
      samples[std::string(line.substr(0, space))] = value;
    }
  }
  return samples;
}

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_SERVER_METRICS_SCRAPE_H_
