// A loopback port for a test to listen on.
#ifndef ATTNSERVE_TESTS_SERVER_FREE_PORT_H_
#define ATTNSERVE_TESTS_SERVER_FREE_PORT_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace attnserve::testing {

// A loopback port that was free a moment ago (the kernel's pick for port 0),
// or 0 if none could be had. Nothing holds it: bind it soon.
inline int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  close(fd);
  return port;
}

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_SERVER_FREE_PORT_H_
