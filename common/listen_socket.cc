#include "attnserve/common/listen_socket.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

namespace attnserve {
namespace {

// What the kernel queues before accept4 takes them (gRPC's default too).
constexpr int kBacklog = 4096;

// The number past which a new descriptor leaves fewer than `reserve` free (an
// eighth of the soft limit at most, for small limits); none when the soft
// limit is unlimited.
int64_t Ceiling(int reserve) {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 ||
      limit.rlim_cur == RLIM_INFINITY) {
    return INT64_MAX;
  }
  const auto soft = static_cast<int64_t>(limit.rlim_cur);
  return soft - std::min<int64_t>(reserve, soft / 8);
}

}  // namespace

absl::StatusOr<int> ListenTcp(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int resolved = getaddrinfo(host.empty() ? nullptr : host.c_str(),
                                   service.c_str(), &hints, &found);
  if (resolved != 0) {
    return absl::UnavailableError(gai_strerror(resolved));
  }
  std::string why = "no address";
  int listener = -1;
  for (const addrinfo* at = found; at != nullptr && listener < 0;
       at = at->ai_next) {
    const int fd =
        socket(at->ai_family, at->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
               at->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    const int on = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    if (bind(fd, at->ai_addr, at->ai_addrlen) != 0 ||
        listen(fd, kBacklog) != 0) {
      why = std::strerror(errno);
      close(fd);
      continue;
    }
    listener = fd;
  }
  freeaddrinfo(found);
  if (listener < 0) {
    return absl::UnavailableError(why);
  }
  return listener;
}

int BoundPort(int socket) {
  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  if (getsockname(socket, reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
    return 0;
  }
  return bound.ss_family == AF_INET6
             ? ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port)
             : ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
}

int64_t RaiseDescriptorLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return 0;
  if (limit.rlim_cur != limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  return limit.rlim_cur == RLIM_INFINITY ? -1
                                         : static_cast<int64_t>(limit.rlim_cur);
}

ConnectionShedder::ConnectionShedder(int reserve)
    : reserve_(reserve), spare_(open("/dev/null", O_RDONLY | O_CLOEXEC)) {}

ConnectionShedder::~ConnectionShedder() {
  if (spare_ >= 0) close(spare_);
}

int ConnectionShedder::Accept(int listener) {
  while (true) {
    const int fd =
        accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      if (fd < Ceiling(reserve_)) return fd;
      close(fd);
      shed_.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    switch (errno) {
      case EINTR:
      case ECONNABORTED:
      // Linux passes the new connection's network errors on to accept4.
      case EPROTO:
      case ENETDOWN:
      case ENOPROTOOPT:
      case EHOSTDOWN:
      case ENONET:
      case EHOSTUNREACH:
      case ENETUNREACH:
        continue;
      case EMFILE:
      case ENFILE:
        if (ShedWithSpare(listener)) continue;
        return -1;
      default:
        return -1;
    }
  }
}

bool ConnectionShedder::ShedWithSpare(int listener) {
  const int error = errno;
  if (spare_ >= 0) {
    close(spare_);
    spare_ = -1;
  }
  const int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd >= 0) {
    close(fd);
    shed_.fetch_add(1, std::memory_order_relaxed);
  }
  spare_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  errno = error;
  return fd >= 0;
}

}  // namespace attnserve
