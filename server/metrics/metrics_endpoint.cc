#include "attnserve/server/metrics/metrics_endpoint.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "attnserve/common/listen_socket.h"
#include "prometheus/text_serializer.h"

namespace attnserve {
namespace {

// How often the loop wakes to close connections past their time.
constexpr int kSweepMillis = 100;
// Descriptors a scrape may not take: left for the process's files.
constexpr int kDescriptorReserve = 16;
// How long the listener rests when the process is out of descriptors or the
// kernel of memory for sockets.
constexpr absl::Duration kOutOfDescriptorsPause = absl::Milliseconds(100);

// An answer with a body (left out for HEAD), and the connection closed.
std::string Answer(absl::string_view status, absl::string_view content_type,
                   absl::string_view body, bool head,
                   absl::string_view extra_headers = "") {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\n",
                      extra_headers, "Connection: close\r\n\r\n",
                      head ? "" : body);
}

class EpollMetricsEndpoint final : public MetricsEndpoint {
 public:
  EpollMetricsEndpoint(int listener, int port, int epoll, int wake,
                       std::shared_ptr<prometheus::Registry> registry,
                       const Options& options)
      : listener_(listener),
        port_(port),
        epoll_(epoll),
        wake_(wake),
        registry_(std::move(registry)),
        options_(options) {
    thread_ = std::thread([this] { Loop(); });
  }

  ~EpollMetricsEndpoint() override {
    const uint64_t one = 1;
    if (write(wake_, &one, sizeof(one)) < 0) {
      // The loop also ends at its next sweep once stopping_ is seen.
    }
    stopping_ = true;
    thread_.join();
    for (auto& [fd, connection] : connections_) close(fd);
    close(listener_);
    close(wake_);
    close(epoll_);
  }

  int port() const override { return port_; }

 private:
  struct Connection {
    absl::Time accepted;
    absl::Time deadline;
    std::string in;
    std::string out;
    size_t sent = 0;
    bool answering = false;
  };

  void Loop() {
    epoll_event events[64];
    while (!stopping_) {
      const int ready = epoll_wait(epoll_, events, 64, kSweepMillis);
      for (int i = 0; i < ready; ++i) {
        const int fd = events[i].data.fd;
        if (fd == wake_) return;
        if (fd == listener_) {
          Accept();
          continue;
        }
        const auto it = connections_.find(fd);
        if (it == connections_.end()) continue;
        if ((events[i].events & (EPOLLERR | EPOLLHUP)) != 0 &&
            (events[i].events & EPOLLIN) == 0) {
          Close(fd);
          continue;
        }
        if (it->second.answering) {
          Send(fd, it->second);
        } else {
          Read(fd, it->second);
        }
      }
      const absl::Time now = absl::Now();
      if (resting_ && now >= rest_until_) {
        resting_ = false;
        Watch(listener_, EPOLLIN, EPOLL_CTL_ADD);
      }
      Sweep(now);
    }
  }

  void Accept() {
    while (true) {
      const int fd = shedder_.Accept(listener_);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
            errno == ENOMEM) {
          // Out of descriptors (even the shedder's spare) or of kernel memory
          // for sockets: the listener stays readable, so it rests instead of
          // waking the loop at once.
          resting_ = true;
          rest_until_ = absl::Now() + kOutOfDescriptorsPause;
          epoll_ctl(epoll_, EPOLL_CTL_DEL, listener_, nullptr);
        }
        return;  // EAGAIN: later.
      }
      if (static_cast<int>(connections_.size()) >= options_.max_connections) {
        // The oldest still sending its request goes: a scraper sends its
        // request at once, a connection held open does not.
        int oldest = -1;
        absl::Time oldest_at = absl::InfiniteFuture();
        for (const auto& [other, connection] : connections_) {
          if (!connection.answering && connection.accepted < oldest_at) {
            oldest = other;
            oldest_at = connection.accepted;
          }
        }
        if (oldest < 0) {
          close(fd);
          continue;
        }
        Close(oldest);
      }
      if (!Watch(fd, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_ADD)) {
        close(fd);
        continue;
      }
      const absl::Time now = absl::Now();
      Connection& connection = connections_[fd];
      connection.accepted = now;
      connection.deadline = now + options_.request_timeout;
    }
  }

  void Read(int fd, Connection& connection) {
    char buffer[4096];
    while (true) {
      const size_t room = static_cast<size_t>(options_.max_request_bytes) -
                          connection.in.size();
      const ssize_t n =
          recv(fd, buffer, std::min(sizeof(buffer), room), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK &&
                     errno != EINTR)) {
        Close(fd);
        return;
      }
      if (n < 0) {
        if (errno == EINTR) continue;
        return;  // All read for now.
      }
      connection.in.append(buffer, static_cast<size_t>(n));
      if (absl::StrContains(connection.in, "\r\n\r\n")) {
        Respond(fd, connection);
        return;
      }
      if (connection.in.size() >=
          static_cast<size_t>(options_.max_request_bytes)) {
        connection.out =
            Answer("431 Request Header Fields Too Large", "text/plain",
                   absl::StrCat("a request of at most ",
                                options_.max_request_bytes, " bytes\n"),
                   false);
        StartSending(fd, connection);
        return;
      }
    }
  }

  void Respond(int fd, Connection& connection) {
    const absl::string_view request = connection.in;
    const absl::string_view line = request.substr(0, request.find("\r\n"));
    const size_t method_end = line.find(' ');
    const absl::string_view method = line.substr(0, method_end);
    absl::string_view path = method_end == absl::string_view::npos
                                 ? ""
                                 : line.substr(method_end + 1);
    path = path.substr(0, path.find(' '));
    path = path.substr(0, path.find('?'));
    const bool head = method == "HEAD";
    if (path != "/metrics") {
      connection.out = Answer("404 Not Found", "text/plain",
                              "attnserve serves /metrics only\n", head);
    } else if (method != "GET" && !head) {
      connection.out = Answer("405 Method Not Allowed", "text/plain",
                              "GET or HEAD\n", false, "Allow: GET, HEAD\r\n");
    } else {
      const std::string body =
          prometheus::TextSerializer().Serialize(registry_->Collect());
      connection.out = Answer(
          "200 OK", "text/plain; version=0.0.4; charset=utf-8", body, head);
    }
    StartSending(fd, connection);
  }

  void StartSending(int fd, Connection& connection) {
    connection.in.clear();
    connection.in.shrink_to_fit();
    connection.answering = true;
    connection.deadline = absl::Now() + options_.write_timeout;
    Watch(fd, EPOLLOUT, EPOLL_CTL_MOD);
    Send(fd, connection);
  }

  void Send(int fd, Connection& connection) {
    while (connection.sent < connection.out.size()) {
      const ssize_t n = send(fd, connection.out.data() + connection.sent,
                             connection.out.size() - connection.sent,
                             MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        break;
      }
      connection.sent += static_cast<size_t>(n);
    }
    shutdown(fd, SHUT_WR);
    Close(fd);
  }

  void Sweep(absl::Time now) {
    std::vector<int> late;
    for (const auto& [fd, connection] : connections_) {
      if (connection.deadline < now) late.push_back(fd);
    }
    for (int fd : late) Close(fd);
  }

  bool Watch(int fd, uint32_t events, int operation) {
    epoll_event event{};
    event.events = events;
    event.data.fd = fd;
    return epoll_ctl(epoll_, operation, fd, &event) == 0;
  }

  void Close(int fd) {
    epoll_ctl(epoll_, EPOLL_CTL_DEL, fd, nullptr);
    close(fd);
    connections_.erase(fd);
  }

  const int listener_;
  const int port_;
  const int epoll_;
  const int wake_;
  const std::shared_ptr<prometheus::Registry> registry_;
  const Options options_;
  // The loop's thread only.
  std::map<int, Connection> connections_;
  ConnectionShedder shedder_{kDescriptorReserve};
  bool resting_ = false;  // The listener is out of epoll_ until rest_until_.
  absl::Time rest_until_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const std::string& host, int port,
    std::shared_ptr<prometheus::Registry> registry, const Options& options) {
  absl::StatusOr<int> listener = ListenTcp(host, port);
  if (!listener.ok()) return listener.status();
  const int bound_port = BoundPort(*listener);
  const int epoll = epoll_create1(EPOLL_CLOEXEC);
  const int wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epoll < 0 || wake < 0) {
    const std::string why = std::strerror(errno);
    close(*listener);
    if (epoll >= 0) close(epoll);
    if (wake >= 0) close(wake);
    return absl::UnavailableError(why);
  }
  for (const int fd : {*listener, wake}) {
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.fd = fd;
    epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &event);
  }
  return std::unique_ptr<MetricsEndpoint>(new EpollMetricsEndpoint(
      *listener, bound_port, epoll, wake, std::move(registry), options));
}

}  // namespace attnserve
