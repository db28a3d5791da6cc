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

namespace attnserve {
namespace {

// How long the listener rests when the process is out of descriptors, even
// the shedder's spare: it stays readable meanwhile.
constexpr int kOutOfDescriptorsPauseMillis = 100;

}  // namespace

absl::StatusOr<std::unique_ptr<ConnectionAcceptor>> ConnectionAcceptor::Listen(
    const std::string& host, int port) {
  absl::StatusOr<int> listener = ListenTcp(host, port);
  if (!listener.ok()) return listener.status();
  const int wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  const int epoll = epoll_create1(EPOLL_CLOEXEC);
  if (wake < 0 || epoll < 0) {
    const std::string why = std::strerror(errno);
    close(*listener);
    if (wake >= 0) close(wake);
    if (epoll >= 0) close(epoll);
    return absl::UnavailableError(why);
  }
  return std::unique_ptr<ConnectionAcceptor>(
      new ConnectionAcceptor(*listener, wake, epoll));
}

ConnectionAcceptor::ConnectionAcceptor(int listener, int wake, int epoll)
    : port_(BoundPort(listener)),
      listener_(listener),
      wake_(wake),
      epoll_(epoll) {
  for (const int fd : {listener_, wake_}) {
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.fd = fd;
    epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &event);
  }
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
  close(listener_);
  listener_ = -1;
}

void ConnectionAcceptor::Loop(
    grpc::experimental::ExternalConnectionAcceptor* server) {
  int timeout = -1;
  while (true) {
    epoll_event events[2];
    const int ready = epoll_wait(epoll_, events, 2, timeout);
    if (ready < 0 && errno != EINTR) return;
    bool accept = timeout >= 0;  // A rest has ended.
    for (int i = 0; i < ready; ++i) {
      if (events[i].data.fd == wake_) return;
      accept = true;
    }
    if (timeout >= 0) {
      timeout = -1;
      epoll_event event{};
      event.events = EPOLLIN;
      event.data.fd = listener_;
      epoll_ctl(epoll_, EPOLL_CTL_ADD, listener_, &event);
    }
    while (accept) {
      const int fd = shedder_.Accept(listener_);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) {
          epoll_ctl(epoll_, EPOLL_CTL_DEL, listener_, nullptr);
          timeout = kOutOfDescriptorsPauseMillis;
        }
        break;
      }
      // gRPC's own listener sets this on its connections.
      const int on = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
      grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters
          connection;
      connection.listener_fd = listener_;
      connection.fd = fd;
      server->HandleNewConnection(&connection);  // It owns fd now.
    }
  }
}

}  // namespace attnserve
