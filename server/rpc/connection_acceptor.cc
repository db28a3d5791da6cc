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
                                                const std::string& address,
                                                std::string* displaced) {
  struct stat status {};
  fstat(fd, &status);  // A socket just accepted: nothing to fail.
  absl::MutexLock lock(&mutex_);
  // A descriptor number taken again was closed since.
  if (connections_.contains(fd)) Forget(fd);
  Verdict verdict = Judge(address);
  if (verdict != Verdict::kAdmitted) {
    const absl::Time now = absl::Now();
    if (now - swept_ >= sweep_interval_) {
      swept_ = now;
      SweepLocked();
      verdict = Judge(address);
    }
  }
  if (verdict != Verdict::kAdmitted && Displace(address, displaced)) {
    verdict = Verdict::kDisplaced;
  }
  switch (verdict) {
    case Verdict::kAdmitted:
    case Verdict::kDisplaced:
      Add(fd, Connection{static_cast<uint64_t>(status.st_dev),
                         static_cast<uint64_t>(status.st_ino), ++admissions_,
                         address});
      break;
    case Verdict::kFull:
      ++full_;
      break;
    case Verdict::kAddressShare:
      ++address_share_;
      break;
  }
  return verdict;
}

ConnectionTally::Verdict ConnectionTally::Judge(
    const std::string& address) const {
  const int64_t open = static_cast<int64_t>(connections_.size());
  if (open >= max_connections_) return Verdict::kFull;
  if (OpenFrom(address) > max_connections_ / 16 &&
      open >= max_connections_ - max_connections_ / 8) {
    return Verdict::kAddressShare;
  }
  return Verdict::kAdmitted;
}

int64_t ConnectionTally::OpenFrom(const std::string& address) const {
  const auto found = addresses_.find(address);
  return found == addresses_.end() ? 0
                                   : static_cast<int64_t>(found->second.size());
}

bool ConnectionTally::Displace(const std::string& address,
                               std::string* displaced) {
  const int64_t own = OpenFrom(address);
  while (!by_count_.empty()) {
    const auto& [most, heaviest] = *by_count_.rbegin();
    if (heaviest == address || most < own + 2) return false;
    if (displaced != nullptr) *displaced = heaviest;
    const int fd = addresses_.at(heaviest).rbegin()->second;
    const Connection& newest = connections_.at(fd);
    struct stat status {};
    const bool open = fstat(fd, &status) == 0 &&
                      static_cast<uint64_t>(status.st_dev) == newest.device &&
                      static_cast<uint64_t>(status.st_ino) == newest.inode;
    // gRPC sees the socket end, as if its peer had gone, and closes it.
    if (open) shutdown(fd, SHUT_RDWR);
    Forget(fd);
    if (open) {
      ++displaced_;
      return true;
    }
  }
  return false;
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

void ConnectionTally::Add(int fd, Connection connection) {
  Admissions& admissions = addresses_[connection.address];
  const int64_t before = static_cast<int64_t>(admissions.size());
  if (before > 0) by_count_.erase({before, connection.address});
  by_count_.insert({before + 1, connection.address});
  admissions.emplace(connection.admitted, fd);
  connections_.emplace(fd, std::move(connection));
}

void ConnectionTally::Forget(int fd) {
  const auto found = connections_.find(fd);
  if (found == connections_.end()) return;
  const std::string& address = found->second.address;
  const auto admissions = addresses_.find(address);
  if (admissions != addresses_.end()) {
    const int64_t before = static_cast<int64_t>(admissions->second.size());
    by_count_.erase({before, address});
    admissions->second.erase(found->second.admitted);
    if (before > 1) {
      by_count_.insert({before - 1, address});
    } else {
      addresses_.erase(admissions);
    }
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

int64_t ConnectionTally::count(Verdict verdict) const {
  absl::MutexLock lock(&mutex_);
  switch (verdict) {
    case Verdict::kDisplaced:
      return displaced_;
    case Verdict::kFull:
      return full_;
    case Verdict::kAddressShare:
      return address_share_;
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
    std::string displaced;
    const ConnectionTally::Verdict verdict =
        tally_.Admit(fd, address, &displaced);
    if (verdict == ConnectionTally::Verdict::kFull ||
        verdict == ConnectionTally::Verdict::kAddressShare) {
      close(fd);
      LogRefusal(verdict, address, displaced);
      continue;
    }
    if (verdict == ConnectionTally::Verdict::kDisplaced) {
      LogRefusal(verdict, address, displaced);
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
                                    const std::string& address,
                                    const std::string& displaced) {
  ++refusals_unlogged_;
  const absl::Time now = absl::Now();
  if (now - refusal_logged_ < kRefusalLogPeriod) return;
  refusal_logged_ = now;
  const int64_t max = tally_.max_connections();
  std::string what;
  switch (verdict) {
    case ConnectionTally::Verdict::kDisplaced:
      what = absl::StrCat(
          "shut down the newest connection from ", displaced, " (",
          tally_.open_from(displaced), " open: the most of any address) for ",
          "a new one from ", address, " (", tally_.open_from(address),
          " open), the connections being at the limit for it");
      break;
    case ConnectionTally::Verdict::kFull:
      what = absl::StrCat("closed a connection from ", address,
                          " as soon as accepted: all ", max,
                          " connections the server takes are open, and no "
                          "address holds two more than it");
      break;
    default:
      what = absl::StrCat(
          "closed a connection from ", address,
          " as soon as accepted: the connections from it (",
          tally_.open_from(address), ") are more than a sixteenth of the ", max,
          " the server takes and seven eighths are open (the last eighth is "
          "kept for other clients), and no address holds two more than it");
      break;
  }
  Log(LogLevel::kWarning,
      absl::StrCat("attnserve: ", what, " (max_connections ", max, "); ",
                   refusals_unlogged_,
                   " connections refused or shut down so since the last such "
                   "line, this one included "
                   "(attnserve_connections_refused_total)"));
  refusals_unlogged_ = 0;
}

}  // namespace attnserve
