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
#include <set>
#include <string>
#include <vector>

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

// A listening socket of `family` bound to `address`, or -1 with errno.
int ListenOn(int family, const sockaddr* address, socklen_t length,
             bool dual_stack) {
  const int fd = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const int on = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  if (family == AF_INET6) {
    // IPv4 too on the wildcard, whatever net.ipv6.bindv6only says; a named
    // IPv6 address only itself.
    const int v6only = dual_stack ? 0 : 1;
    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof(v6only));
  }
  if (bind(fd, address, length) != 0 || listen(fd, kBacklog) != 0) {
    const int error = errno;
    close(fd);
    errno = error;
    return -1;
  }
  return fd;
}

bool IsWildcard(const std::string& host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]";
}

}  // namespace

absl::StatusOr<std::vector<int>> ListenTcpAll(const std::string& host,
                                              int port) {
  if (IsWildcard(host)) {
    // As gRPC binds its wildcard: one IPv6 socket that takes IPv4 too, or
    // IPv4 alone on a machine without IPv6.
    sockaddr_in6 any6{};
    any6.sin6_family = AF_INET6;
    any6.sin6_addr = in6addr_any;
    any6.sin6_port = htons(static_cast<uint16_t>(port));
    int fd = ListenOn(AF_INET6, reinterpret_cast<const sockaddr*>(&any6),
                      sizeof(any6), /*dual_stack=*/true);
    if (fd < 0 && errno != EADDRINUSE) {
      sockaddr_in any4{};
      any4.sin_family = AF_INET;
      any4.sin_addr.s_addr = htonl(INADDR_ANY);
      any4.sin_port = htons(static_cast<uint16_t>(port));
      fd = ListenOn(AF_INET, reinterpret_cast<const sockaddr*>(&any4),
                    sizeof(any4), /*dual_stack=*/false);
    }
    if (fd < 0) return absl::UnavailableError(std::strerror(errno));
    return std::vector<int>{fd};
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int resolved =
      getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (resolved != 0) {
    return absl::UnavailableError(gai_strerror(resolved));
  }
  // Every address the name has (localhost: ::1 and 127.0.0.1), on one port:
  // with port 0, the one the first bind got.
  std::vector<int> listeners;
  std::string why = "no address";
  bool busy = false;
  // An address the resolver gives twice (the same line twice in /etc/hosts)
  // is bound once: its second bind would find it busy.
  std::set<std::string> bound;
  for (const addrinfo* at = found; at != nullptr && !busy; at = at->ai_next) {
    if (!bound
             .insert(std::string(reinterpret_cast<const char*>(at->ai_addr),
                                 at->ai_addrlen))
             .second) {
      continue;
    }
    sockaddr_storage address{};
    std::memcpy(&address, at->ai_addr, at->ai_addrlen);
    if (!listeners.empty()) {
      const auto chosen =
          htons(static_cast<uint16_t>(BoundPort(listeners.front())));
      if (address.ss_family == AF_INET6) {
        reinterpret_cast<sockaddr_in6*>(&address)->sin6_port = chosen;
      } else {
        reinterpret_cast<sockaddr_in*>(&address)->sin_port = chosen;
      }
    }
    const int fd =
        ListenOn(at->ai_family, reinterpret_cast<const sockaddr*>(&address),
                 at->ai_addrlen, /*dual_stack=*/false);
    if (fd >= 0) {
      listeners.push_back(fd);
      continue;
    }
    // An address not on this machine is passed over; a busy port fails
    // start-up, as gRPC's does.
    why = std::strerror(errno);
    busy = errno == EADDRINUSE;
  }
  freeaddrinfo(found);
  if (listeners.empty() || busy) {
    for (const int fd : listeners) close(fd);
    return absl::UnavailableError(why);
  }
  return listeners;
}

absl::StatusOr<int> ListenTcp(const std::string& host, int port) {
  absl::StatusOr<std::vector<int>> listeners = ListenTcpAll(host, port);
  if (!listeners.ok()) return listeners.status();
  for (size_t i = 1; i < listeners->size(); ++i) close((*listeners)[i]);
  return listeners->front();
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
    : ceiling_(Ceiling(reserve)),
      spare_(open("/dev/null", O_RDONLY | O_CLOEXEC)) {}

ConnectionShedder::~ConnectionShedder() {
  if (spare_ >= 0) close(spare_);
}

int ConnectionShedder::Accept(int listener) {
  while (true) {
    const int fd =
        accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      if (fd < ceiling_) return fd;
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
