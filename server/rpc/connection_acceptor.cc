#include "attnserve/server/rpc/connection_acceptor.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnserve/common/log.h"

namespace attnserve {
namespace {

// How long the listeners rest when the process is out of descriptors (even
// the shedder's spare) or the kernel out of memory for sockets.
constexpr int kRestMillis = 100;

// How often a connection refused for ConnectionTally's rule is logged at most.
constexpr absl::Duration kRefusalLogPeriod = absl::Seconds(10);

}  // namespace

ConnectionTally::ConnectionTally(int64_t max_connections,
                                 absl::Duration sweep_interval)
    : max_connections_(max_connections), sweep_interval_(sweep_interval) {}

ConnectionTally::Verdict ConnectionTally::Admit(int fd,
                                                const std::string& address) {
  struct stat status {};
  fstat(fd, &status);  // A socket just accepted: nothing to fail.
  absl::MutexLock lock(&mutex_);
  // A descriptor number taken again was closed since.
  Forget(fd);
  Verdict verdict = Judge(address);
  if (verdict != Verdict::kAdmitted) {
    const absl::Time now = absl::Now();
    if (now - swept_ >= sweep_interval_) {
      swept_ = now;
      SweepLocked();
      verdict = Judge(address);
    }
  }
  switch (verdict) {
    case Verdict::kAdmitted:
      connections_[fd] =
          Connection{static_cast<uint64_t>(status.st_dev),
                     static_cast<uint64_t>(status.st_ino), address};
      ++addresses_[address];
      break;
    case Verdict::kFull:
      ++refused_full_;
      break;
    case Verdict::kAddressShare:
      ++refused_share_;
      break;
  }
  return verdict;
}

ConnectionTally::Verdict ConnectionTally::Judge(
    const std::string& address) const {
  const int64_t open = static_cast<int64_t>(connections_.size());
  if (open >= max_connections_) return Verdict::kFull;
  if (open < max_connections_ - max_connections_ / 8) {
    return Verdict::kAdmitted;
  }
  // own < 4 F² / max, in doubles: own × max may pass 2^63 for huge limits.
  const double free = static_cast<double>(max_connections_ - open);
  return static_cast<double>(OpenFrom(address)) *
                     static_cast<double>(max_connections_) <
                 4.0 * free * free
             ? Verdict::kAdmitted
             : Verdict::kAddressShare;
}

int64_t ConnectionTally::OpenFrom(const std::string& address) const {
  const auto found = addresses_.find(address);
  return found == addresses_.end() ? 0 : found->second;
}

void ConnectionTally::Sweep() {
  absl::MutexLock lock(&mutex_);
  swept_ = absl::Now();
  SweepLocked();
}

void ConnectionTally::SweepLocked() {
  std::vector<int> closed;
  for (const auto& [fd, connection] : connections_) {
    struct stat now {};
    const bool same = fstat(fd, &now) == 0 &&
                      static_cast<uint64_t>(now.st_dev) == connection.device &&
                      static_cast<uint64_t>(now.st_ino) == connection.inode;
    if (!same) closed.push_back(fd);
  }
  for (const int fd : closed) Forget(fd);
}

void ConnectionTally::Forget(int fd) {
  const auto found = connections_.find(fd);
  if (found == connections_.end()) return;
  const auto address = addresses_.find(found->second.address);
  if (address != addresses_.end() && --address->second <= 0) {
    addresses_.erase(address);
  }
  connections_.erase(found);
}

int64_t ConnectionTally::open() const {
  absl::MutexLock lock(&mutex_);
  return static_cast<int64_t>(connections_.size());
}

int64_t ConnectionTally::open_from(const std::string& address) const {
  absl::MutexLock lock(&mutex_);
  return OpenFrom(address);
}

int64_t ConnectionTally::refused(Verdict why) const {
  absl::MutexLock lock(&mutex_);
  switch (why) {
    case Verdict::kFull:
      return refused_full_;
    case Verdict::kAddressShare:
      return refused_share_;
    case Verdict::kAdmitted:
      break;
  }
  return 0;
}

std::string SocketPeerAddress(int fd) {
  sockaddr_storage peer{};
  socklen_t length = sizeof(peer);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &length) != 0) {
    return "unknown";
  }
  char text[INET6_ADDRSTRLEN] = {};
  if (peer.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&peer);
    if (inet_ntop(AF_INET, &v4->sin_addr, text, sizeof(text)) == nullptr) {
      return "unknown";
    }
    return absl::StrCat("ipv4:", text);
  }
  if (peer.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&peer);
    if (IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr)) {
      if (inet_ntop(AF_INET, &v6->sin6_addr.s6_addr[12], text, sizeof(text)) ==
          nullptr) {
        return "unknown";
      }
      return absl::StrCat("ipv4:", text);
    }
    if (inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof(text)) == nullptr) {
      return "unknown";
    }
    return absl::StrCat("ipv6:[", text, "]");
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<ConnectionAcceptor>> ConnectionAcceptor::Listen(
    const std::string& host, int port, int64_t max_connections) {
  absl::StatusOr<std::vector<int>> listeners = ListenTcpAll(host, port);
  if (!listeners.ok()) return listeners.status();
  const int wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  const int epoll = epoll_create1(EPOLL_CLOEXEC);
  if (wake < 0 || epoll < 0) {
    const std::string why = std::strerror(errno);
    for (const int fd : *listeners) close(fd);
    if (wake >= 0) close(wake);
    if (epoll >= 0) close(epoll);
    return absl::UnavailableError(why);
  }
  return std::unique_ptr<ConnectionAcceptor>(new ConnectionAcceptor(
      *std::move(listeners), wake, epoll, max_connections));
}

ConnectionAcceptor::ConnectionAcceptor(std::vector<int> listeners, int wake,
                                       int epoll, int64_t max_connections)
    : port_(BoundPort(listeners.front())),
      listeners_(std::move(listeners)),
      wake_(wake),
      epoll_(epoll),
      tally_(max_connections) {
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.fd = wake_;
  epoll_ctl(epoll_, EPOLL_CTL_ADD, wake_, &event);
  WatchListeners(EPOLL_CTL_ADD);
}

ConnectionAcceptor::~ConnectionAcceptor() {
  Stop();
  close(wake_);
  close(epoll_);
}

void ConnectionAcceptor::Start(
    grpc::experimental::ExternalConnectionAcceptor* server) {
  absl::MutexLock lock(&mutex_);
  if (stopped_ || thread_.joinable()) return;
  thread_ = std::thread([this, server] { Loop(server); });
}

void ConnectionAcceptor::Stop() {
  {
    absl::MutexLock lock(&mutex_);
    if (stopped_) return;
    stopped_ = true;
  }
  const uint64_t one = 1;
  if (write(wake_, &one, sizeof(one)) < 0) {
    // An eventfd's counter cannot overflow from one write; nothing to do.
  }
  if (thread_.joinable()) thread_.join();
  for (const int fd : listeners_) close(fd);
  listeners_.clear();
}

void ConnectionAcceptor::WatchListeners(int operation) {
  for (const int fd : listeners_) {
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.fd = fd;
    epoll_ctl(epoll_, operation, fd, &event);
  }
}

void ConnectionAcceptor::Loop(
    grpc::experimental::ExternalConnectionAcceptor* server) {
  int timeout = -1;  // Resting: the listeners' wait, out of epoll_.
  std::vector<int> readable;
  while (true) {
    epoll_event events[8];
    const int ready = epoll_wait(epoll_, events, 8, timeout);
    if (ready < 0) {
      if (errno == EINTR) continue;
      // Only a bad epoll descriptor does this; the port would go deaf.
      Log(LogLevel::kError,
          absl::StrCat("attnserve: the gRPC port's listener stopped: "
                       "epoll_wait: ",
                       std::strerror(errno)));
      return;
    }
    readable.clear();
    if (ready == 0 && timeout >= 0) {
      // The rest is over: every listener is tried again.
      timeout = -1;
      WatchListeners(EPOLL_CTL_ADD);
      readable = listeners_;
    }
    for (int i = 0; i < ready; ++i) {
      if (events[i].data.fd == wake_) return;
      readable.push_back(events[i].data.fd);
    }
    for (const int listener : readable) {
      if (!AcceptFrom(listener, server)) {
        // Out of descriptors or kernel memory: the listeners stay readable,
        // so they rest rather than wake the loop at once.
        WatchListeners(EPOLL_CTL_DEL);
        timeout = kRestMillis;
        break;
      }
    }
  }
}

bool ConnectionAcceptor::AcceptFrom(
    int listener, grpc::experimental::ExternalConnectionAcceptor* server) {
  while (true) {
    const int fd = shedder_.Accept(listener);
    if (fd < 0) {
      return errno != EMFILE && errno != ENFILE && errno != ENOBUFS &&
             errno != ENOMEM;
    }
    const std::string address = SocketPeerAddress(fd);
    const ConnectionTally::Verdict verdict = tally_.Admit(fd, address);
    if (verdict != ConnectionTally::Verdict::kAdmitted) {
      close(fd);
      LogRefusal(verdict, address);
      continue;
    }
    // gRPC's own listener sets this on its connections.
    const int on = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
    grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters
        connection;
    connection.listener_fd = listener;
    connection.fd = fd;
    server->HandleNewConnection(&connection);  // It owns fd now.
  }
}

void ConnectionAcceptor::LogRefusal(ConnectionTally::Verdict verdict,
                                    const std::string& address) {
  ++refusals_unlogged_;
  const absl::Time now = absl::Now();
  if (now - refusal_logged_ < kRefusalLogPeriod) return;
  refusal_logged_ = now;
  const int64_t max = tally_.max_connections();
  const int64_t open = tally_.open();
  const std::string why =
      verdict == ConnectionTally::Verdict::kFull
          ? absl::StrCat("all ", max, " connections the server takes are open")
          : absl::StrCat(
                open, " of the ", max,
                " connections the server takes are open, past seven eighths, "
                "and the connections from that address (",
                tally_.open_from(address),
                ") are too many for the places left: an address may hold "
                "fewer than 4 F^2 / ",
                max,
                " with F places free, so that the last are kept for "
                "clients holding few");
  Log(LogLevel::kWarning,
      absl::StrCat("attnserve: closed a connection from ", address,
                   " as soon as accepted: ", why, " (max_connections); ",
                   refusals_unlogged_,
                   " closed so since the last such line, this one included "
                   "(attnserve_connections_refused_total)"));
  refusals_unlogged_ = 0;
}

}  // namespace attnserve
