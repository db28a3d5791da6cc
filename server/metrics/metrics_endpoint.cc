#include "attnserve/server/metrics/metrics_endpoint.h"

#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "attnserve/common/listen_socket.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
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
// Connections taken from one listener's queue in one turn of the loop, so
// that those taken are read (and a scrape among them answered) before a
// flood's next ones can push them out.
constexpr int kAcceptsPerTurn = 64;
// How long an answer may go unread before, at the connection cap, its
// connection gives its place to a new one.
constexpr absl::Duration kUnreadEvictable = absl::Seconds(1);
// What a connection may send after its request, read and dropped while its
// answer drains: closing a socket with unread input resets the connection,
// and the kernel drops the answer's unsent part.
constexpr int64_t kMaxDiscardedBytes = 1 << 20;

// An answer with a body (left out for HEAD), and the connection closed.
std::string Answer(absl::string_view status, absl::string_view content_type,
                   absl::string_view body, bool head,
                   absl::string_view extra_headers = "") {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\n",
                      extra_headers, "Connection: close\r\n\r\n",
                      head ? "" : body);
}

// Where a request's head ends (past its blank line), or npos. RFC 9112 lets a
// server take a bare LF as a line's end (a CR before it ignored): the head
// ends at the first LF followed by an empty line, "\n\n" or "\n\r\n".
size_t HeadEnd(absl::string_view in) {
  for (size_t at = in.find('\n'); at != absl::string_view::npos;
       at = in.find('\n', at + 1)) {
    if (in.substr(at + 1, 1) == "\n") return at + 2;
    if (in.substr(at + 1, 2) == "\r\n") return at + 3;
  }
  return absl::string_view::npos;
}

class EpollMetricsEndpoint final : public MetricsEndpoint {
 public:
  EpollMetricsEndpoint(std::vector<int> listeners, int port, int epoll,
                       int wake, std::shared_ptr<prometheus::Registry> registry,
                       const Options& options)
      : listeners_(std::move(listeners)),
        port_(port),
        epoll_(epoll),
        wake_(wake),
        registry_(std::move(registry)),
        options_(options),
        dropped_(prometheus::BuildCounter()
                     .Name("attnserve_metrics_connections_dropped_total")
                     .Help("Connections to /metrics closed unanswered: "
                           "evicted (the oldest still sending a request when "
                           "a new one needed its place), refused (the "
                           "connection cap reached with none to evict), "
                           "timed_out (no whole request within the request "
                           "timeout, or an answer not read within the write "
                           "timeout)")
                     .Register(*registry_)),
        evicted_(dropped_.Add({{"reason", "evicted"}})),
        refused_(dropped_.Add({{"reason", "refused"}})),
        timed_out_(dropped_.Add({{"reason", "timed_out"}})) {
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
    for (const int listener : listeners_) close(listener);
    close(wake_);
    close(epoll_);
  }

  int port() const override { return port_; }

 private:
  enum class State {
    kReading,    // its request, not yet whole
    kAnswering,  // the answer, not yet all handed to the kernel
    kClosing,    // the answer handed over, sending shut: until the client
                 // closes its side (what it sends meanwhile dropped)
  };

  struct Connection {
    absl::Time accepted;
    absl::Time answering_since = absl::InfiniteFuture();
    absl::Time deadline;
    State state = State::kReading;
    std::string in;
    size_t received = 0;  // Of the request, empty lines before it included.
    std::string out;
    size_t sent = 0;
    int64_t discarded = 0;
    bool client_closed = false;
  };

  bool IsListener(int fd) const {
    return std::find(listeners_.begin(), listeners_.end(), fd) !=
           listeners_.end();
  }

  void Loop() {
    epoll_event events[64];
    while (!stopping_) {
      const int ready = epoll_wait(epoll_, events, 64, kSweepMillis);
      for (int i = 0; i < ready; ++i) {
        const int fd = events[i].data.fd;
        if (fd == wake_) return;
        if (IsListener(fd)) {
          Accept(fd);
          continue;
        }
        const auto it = connections_.find(fd);
        if (it == connections_.end()) continue;
        Connection& connection = it->second;
        if ((events[i].events & (EPOLLERR | EPOLLHUP)) != 0 &&
            (events[i].events & EPOLLIN) == 0 &&
            connection.state != State::kClosing) {
          Close(fd);
          continue;
        }
        switch (connection.state) {
          case State::kReading:
            Read(fd, connection);
            break;
          case State::kAnswering:
            Send(fd, connection);
            break;
          case State::kClosing:
            Discard(fd, connection);
            break;
        }
      }
      const absl::Time now = absl::Now();
      if (resting_ && now >= rest_until_) {
        resting_ = false;
        for (const int listener : listeners_) {
          Watch(listener, EPOLLIN, EPOLL_CTL_ADD);
        }
      }
      Sweep(now);
    }
  }

  void Accept(int listener) {
    for (int taken = 0; taken < kAcceptsPerTurn; ++taken) {
      const int fd = shedder_.Accept(listener);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
            errno == ENOMEM) {
          // Out of descriptors (even the shedder's spare) or of kernel memory
          // for sockets: the listeners stay readable, so they rest instead
          // of waking the loop at once.
          resting_ = true;
          rest_until_ = absl::Now() + kOutOfDescriptorsPause;
          for (const int other : listeners_) {
            epoll_ctl(epoll_, EPOLL_CTL_DEL, other, nullptr);
          }
        }
        return;  // EAGAIN: later.
      }
      const absl::Time now = absl::Now();
      if (static_cast<int>(connections_.size()) >= options_.max_connections &&
          !MakeRoom(now)) {
        refused_.Increment();
        close(fd);
        continue;
      }
      if (!Watch(fd, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_ADD)) {
        close(fd);
        continue;
      }
      Connection& connection = connections_[fd];
      connection.accepted = now;
      connection.deadline = now + options_.request_timeout;
      // A scraper's request is most often there already: answered now, it
      // holds no place a flood could take.
      Read(fd, connection);
    }
  }

  // Closes one connection for a new one at the cap: one whose answer the
  // client has all of (the kernel holds none of it unacknowledged), else the
  // oldest still sending its request (each is read as soon as accepted, and
  // a scraper sends its request at once), else the one whose answer has gone
  // unread longest, past kUnreadEvictable (reset: a scraper reads its answer
  // within milliseconds). False if none may go.
  bool MakeRoom(absl::Time now) {
    int reading = -1, unread = -1;
    absl::Time reading_since = absl::InfiniteFuture();
    absl::Time unread_since = now - kUnreadEvictable;
    for (const auto& [fd, connection] : connections_) {
      if (connection.state == State::kReading) {
        if (connection.accepted < reading_since) {
          reading = fd;
          reading_since = connection.accepted;
        }
        continue;
      }
      const int held = connection.state == State::kClosing
                           ? Unacknowledged(fd)
                           : std::numeric_limits<int>::max();
      if (held == 0) {
        Close(fd);
        return true;
      }
      if (connection.answering_since < unread_since) {
        unread = fd;
        unread_since = connection.answering_since;
      }
    }
    if (reading >= 0) {
      evicted_.Increment();
      Close(reading);
      return true;
    }
    if (unread >= 0) {
      evicted_.Increment();
      Close(unread, /*reset=*/true);
      return true;
    }
    return false;
  }

  void Read(int fd, Connection& connection) {
    char buffer[4096];
    while (true) {
      // Every byte counts, the empty lines passed over too: a client
      // streaming those kept this loop (the endpoint's one thread) reading
      // for as long as it sent, an audit found.
      const size_t room =
          static_cast<size_t>(options_.max_request_bytes) - connection.received;
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
      connection.received += static_cast<size_t>(n);
      connection.in.append(buffer, static_cast<size_t>(n));
      // Empty lines before the request line are passed over (RFC 9112).
      const size_t first = connection.in.find_first_not_of("\r\n");
      connection.in.erase(0, std::min(first, connection.in.size()));
      if (HeadEnd(connection.in) != std::string::npos) {
        Respond(fd, connection);
        return;
      }
      if (connection.received >=
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
    absl::string_view line = request.substr(0, request.find('\n'));
    absl::ConsumeSuffix(&line, "\r");
    // METHOD SP target SP HTTP-version, nothing more.
    const std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
    const bool head = !parts.empty() && parts[0] == "HEAD";
    if (parts.size() != 3 || parts[0].empty() || parts[1].empty() ||
        !absl::StartsWith(parts[2], "HTTP/")) {
      connection.out = Answer("400 Bad Request", "text/plain",
                              "expected GET /metrics HTTP/1.1\n", false);
    } else if (parts[2] != "HTTP/1.1" && parts[2] != "HTTP/1.0") {
      connection.out = Answer("505 HTTP Version Not Supported", "text/plain",
                              "HTTP/1.1 or HTTP/1.0\n", head);
    } else {
      absl::string_view path = parts[1];
      // The absolute form a proxy sends: http://host:port/metrics.
      // Its scheme in any case (RFC 3986).
      const size_t scheme_end = path.find("://");
      if (scheme_end != absl::string_view::npos &&
          (absl::EqualsIgnoreCase(path.substr(0, scheme_end), "http") ||
           absl::EqualsIgnoreCase(path.substr(0, scheme_end), "https"))) {
        path.remove_prefix(scheme_end + 3);
        const size_t slash = path.find('/');
        path = slash == absl::string_view::npos ? "/" : path.substr(slash);
      }
      path = path.substr(0, path.find('?'));
      if (path != "/metrics") {
        connection.out = Answer("404 Not Found", "text/plain",
                                "attnserve serves /metrics only\n", head);
      } else if (parts[0] != "GET" && !head) {
        connection.out = Answer("405 Method Not Allowed", "text/plain",
                                "GET or HEAD\n", false, "Allow: GET, HEAD\r\n");
      } else {
        const std::string body =
            prometheus::TextSerializer().Serialize(registry_->Collect());
        connection.out = Answer(
            "200 OK", "text/plain; version=0.0.4; charset=utf-8", body, head);
      }
    }
    StartSending(fd, connection);
  }

  void StartSending(int fd, Connection& connection) {
    connection.in.clear();
    connection.in.shrink_to_fit();
    connection.state = State::kAnswering;
    connection.answering_since = absl::Now();
    connection.deadline = connection.answering_since + options_.write_timeout;
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
        Close(fd);
        return;
      }
      connection.sent += static_cast<size_t>(n);
    }
    // All handed over: the FIN follows it. The connection stays until the
    // client closes its side, or the write timeout.
    connection.out.clear();
    connection.out.shrink_to_fit();
    shutdown(fd, SHUT_WR);
    connection.state = State::kClosing;
    Watch(fd, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_MOD);
    Discard(fd, connection);
  }

  // Reads and drops what the client sends after its request (a body, more
  // requests), until it closes its side.
  void Discard(int fd, Connection& connection) {
    char buffer[4096];
    while (!connection.client_closed) {
      const ssize_t n = recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n < 0) {
        Close(fd);
        return;
      }
      if (n == 0) {
        connection.client_closed = true;
        break;
      }
      connection.discarded += n;
      if (connection.discarded > kMaxDiscardedBytes) {
        Close(fd, /*reset=*/true);
        return;
      }
    }
    // Closed its side: nothing more to read, and epoll would report the end
    // (and, both sides shut, a hang-up) at every wait. The sweep closes it
    // once the answer is acknowledged, or resets it at the write timeout.
    epoll_ctl(epoll_, EPOLL_CTL_DEL, fd, nullptr);
    if (Unacknowledged(fd) == 0) Close(fd);
  }

  // Bytes of the answer the kernel still holds, unsent or unacknowledged; 0
  // once the connection is reset (in CLOSE the kernel still counts them, but
  // will never send them).
  static int Unacknowledged(int fd) {
    tcp_info info{};
    socklen_t length = sizeof(info);
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &length) == 0 &&
        info.tcpi_state == TCP_CLOSE) {
      return 0;
    }
    int bytes = 0;
    if (ioctl(fd, SIOCOUTQ, &bytes) != 0) return 0;
    return bytes;
  }

  void Sweep(absl::Time now) {
    struct Done {
      int fd;
      bool reset;  // the answer not all read: dropped by the kernel now
      bool timed_out;
    };
    std::vector<Done> done;
    for (const auto& [fd, connection] : connections_) {
      const bool late = connection.deadline < now;
      const bool closing = connection.state == State::kClosing;
      if (!late && !(closing && connection.client_closed)) continue;
      const int held = closing ? Unacknowledged(fd) : 0;
      if (!late && held > 0) continue;  // Its client still reading.
      // An answer still held past its time is reset, so that the kernel
      // drops it now instead of probing a client that never reads for
      // minutes. One the client has read, but whose connection it holds
      // open, ends with a plain close.
      const bool unread = connection.state == State::kAnswering || held > 0;
      done.push_back({fd, unread,
                      late && (connection.state == State::kReading || unread)});
    }
    for (const Done& d : done) {
      if (d.timed_out) timed_out_.Increment();
      Close(d.fd, d.reset);
    }
  }

  bool Watch(int fd, uint32_t events, int operation) {
    epoll_event event{};
    event.events = events;
    event.data.fd = fd;
    return epoll_ctl(epoll_, operation, fd, &event) == 0;
  }

  void Close(int fd, bool reset = false) {
    epoll_ctl(epoll_, EPOLL_CTL_DEL, fd, nullptr);
    if (reset) {
      const linger now{1, 0};
      setsockopt(fd, SOL_SOCKET, SO_LINGER, &now, sizeof(now));
    }
    close(fd);
    connections_.erase(fd);
  }

  const std::vector<int> listeners_;
  const int port_;
  const int epoll_;
  const int wake_;
  const std::shared_ptr<prometheus::Registry> registry_;
  const Options options_;
  prometheus::Family<prometheus::Counter>& dropped_;
  prometheus::Counter& evicted_;
  prometheus::Counter& refused_;
  prometheus::Counter& timed_out_;
  // The loop's thread only.
  std::map<int, Connection> connections_;
  ConnectionShedder shedder_{kDescriptorReserve};
  bool resting_ = false;  // The listeners are out of epoll_ till rest_until_.
  absl::Time rest_until_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const std::string& host, int port,
    std::shared_ptr<prometheus::Registry> registry, const Options& options) {
  // Every address the host has, as gRPC's port does (localhost: 127.0.0.1
  // and ::1).
  absl::StatusOr<std::vector<int>> listeners = ListenTcpAll(host, port);
  if (!listeners.ok()) return listeners.status();
  const int bound_port = BoundPort(listeners->front());
  const int epoll = epoll_create1(EPOLL_CLOEXEC);
  const int wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epoll < 0 || wake < 0) {
    const std::string why = std::strerror(errno);
    for (const int listener : *listeners) close(listener);
    if (epoll >= 0) close(epoll);
    if (wake >= 0) close(wake);
    return absl::UnavailableError(why);
  }
  std::vector<int> watched = *listeners;
  watched.push_back(wake);
  for (const int fd : watched) {
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.fd = fd;
    epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &event);
  }
  return std::unique_ptr<MetricsEndpoint>(
      new EpollMetricsEndpoint(*std::move(listeners), bound_port, epoll, wake,
                               std::move(registry), options));
}

}  // namespace attnserve
