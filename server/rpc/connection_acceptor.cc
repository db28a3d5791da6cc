#include "attnserve/server/rpc/connection_acceptor.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
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

}  // namespace

absl::StatusOr<std::unique_ptr<ConnectionAcceptor>> ConnectionAcceptor::Listen(
    const std::string& host, int port) {
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
  return std::unique_ptr<ConnectionAcceptor>(
      new ConnectionAcceptor(*std::move(listeners), wake, epoll));
}

ConnectionAcceptor::ConnectionAcceptor(std::vector<int> listeners, int wake,
                                       int epoll)
    : port_(BoundPort(listeners.front())),
      listeners_(std::move(listeners)),
      wake_(wake),
      epoll_(epoll) {
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

}  // namespace attnserve
