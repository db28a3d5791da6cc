#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "attnserve/server/rpc/connection_acceptor.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using Verdict = ConnectionTally::Verdict;

// An open socket of this process's, closed at the end.
class Socket {
 public:
  Socket() {
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0) {
      fd_ = pair[0];
      peer_ = pair[1];
    }
  }
  ~Socket() { Close(); }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  void Close() {
    if (fd_ >= 0) close(fd_);
    if (peer_ >= 0) close(peer_);
    fd_ = peer_ = -1;
  }

 private:
  int fd_ = -1;
  int peer_ = -1;
};

TEST(ConnectionTallyTest, RefusesPastMaxConnectionsUntilOneCloses) {
  ConnectionTally tally(4, absl::ZeroDuration());
  // One address per connection: the address rule stays out of the way.
  std::vector<Socket> sockets(5);
  for (int i = 0; i < 4; ++i) {
    ASSERT_GE(sockets[i].fd(), 0);
    EXPECT_EQ(tally.Admit(sockets[i].fd(), "ipv4:10.0.0." + std::to_string(i)),
              Verdict::kAdmitted);
  }
  EXPECT_EQ(tally.Admit(sockets[4].fd(), "ipv4:10.0.0.9"), Verdict::kFull);
  EXPECT_EQ(tally.open(), 4);
  EXPECT_EQ(tally.refused(Verdict::kFull), 1);
  // Closed by its owner (gRPC), the tally notices at the next admission.
  sockets[1].Close();
  EXPECT_EQ(tally.Admit(sockets[4].fd(), "ipv4:10.0.0.9"), Verdict::kAdmitted);
  EXPECT_EQ(tally.open(), 4);
  EXPECT_EQ(tally.open_from("ipv4:10.0.0.1"), 0);
  EXPECT_EQ(tally.open_from("ipv4:10.0.0.9"), 1);
  EXPECT_EQ(tally.refused(Verdict::kAddressShare), 0);
}

// Up to seven eighths open, any address takes a place; past it an address
// holds fewer than 4 F² / max with F places free, so the last places go to
// addresses holding none.
TEST(ConnectionTallyTest, PastSevenEighthsAnAddressHoldsLessAsPlacesRunOut) {
  ConnectionTally tally(16, absl::ZeroDuration());
  std::vector<Socket> sockets(18);
  int next = 0;
  for (; next < 14; ++next) {
    ASSERT_EQ(tally.Admit(sockets[next].fd(), "ipv6:[2001:db8::1]"),
              Verdict::kAdmitted)
        << next;
  }
  // F = 2: fewer than 4 · 4 / 16 = 1.
  EXPECT_EQ(tally.Admit(sockets[next].fd(), "ipv6:[2001:db8::1]"),
            Verdict::kAddressShare);
  EXPECT_EQ(tally.open_from("ipv6:[2001:db8::1]"), 14);
  EXPECT_EQ(tally.Admit(sockets[next++].fd(), "ipv4:10.0.0.2"),
            Verdict::kAdmitted);
  // F = 1: only an address holding none.
  EXPECT_EQ(tally.Admit(sockets[next].fd(), "ipv4:10.0.0.2"),
            Verdict::kAddressShare);
  EXPECT_EQ(tally.Admit(sockets[next++].fd(), "ipv4:10.0.0.3"),
            Verdict::kAdmitted);
  EXPECT_EQ(tally.Admit(sockets[next].fd(), "ipv4:10.0.0.4"), Verdict::kFull);
  EXPECT_EQ(tally.open(), 16);
  EXPECT_EQ(tally.refused(Verdict::kAddressShare), 2);
  EXPECT_EQ(tally.refused(Verdict::kFull), 1);
  // A lone client under a small limit is not held back by rounding: 7 of 8.
  ConnectionTally small(8, absl::ZeroDuration());
  std::vector<Socket> more(8);
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ(small.Admit(more[i].fd(), "ipv4:10.0.0.4"), Verdict::kAdmitted);
  }
  EXPECT_EQ(small.Admit(more[7].fd(), "ipv4:10.0.0.4"), Verdict::kAddressShare);
}

// A flat share of a sixteenth past seven eighths let three addresses fill the
// limit, and then every new client was closed, a health probe's included (a
// review of 2026-12-07): now, each address filling as much as it can, it
// takes about the square root of the limit of them, and until the last place
// an address holding none is let in.
TEST(ConnectionTallyTest, FillingTheLimitTakesAboutItsSquareRootInAddresses) {
  constexpr int kMax = 2048;
  ConnectionTally tally(kMax, absl::Hours(1));
  // Admit does not sweep within the hour: numbers that name no descriptor
  // stand for connections here.
  tally.Sweep();
  int fd = 1 << 20;
  int addresses = 0;
  while (tally.open() < kMax) {
    const std::string address = "ipv4:10.0." + std::to_string(addresses / 256) +
                                "." + std::to_string(addresses % 256);
    ++addresses;
    ASSERT_EQ(tally.Admit(fd++, address), Verdict::kAdmitted)
        << "an address holding none, with " << tally.open() << " open";
    while (tally.Admit(fd, address) == Verdict::kAdmitted) ++fd;
  }
  EXPECT_GE(addresses, 40);
  EXPECT_LE(addresses, 100);
  EXPECT_EQ(tally.open_from("ipv4:10.0.0.0"), kMax - kMax / 8);
  EXPECT_EQ(tally.Admit(fd, "ipv4:10.1.0.0"), Verdict::kFull);
  std::cout << addresses << " addresses filled " << kMax << " places\n";
}

// A descriptor is a connection only while it names the socket admitted: the
// same number taken again, or another file behind it, ends the old one.
TEST(ConnectionTallyTest, ForgetsADescriptorClosedAndTakenAgain) {
  ConnectionTally tally(8, absl::Hours(1));  // Admit never sweeps here.
  auto first = std::make_unique<Socket>();
  const int fd = first->fd();
  ASSERT_EQ(tally.Admit(fd, "ipv4:10.0.0.1"), Verdict::kAdmitted);
  first->Close();
  Socket second;  // The lowest free descriptor: fd again.
  ASSERT_EQ(second.fd(), fd);
  ASSERT_EQ(tally.Admit(second.fd(), "ipv4:10.0.0.2"), Verdict::kAdmitted);
  EXPECT_EQ(tally.open(), 1);
  EXPECT_EQ(tally.open_from("ipv4:10.0.0.1"), 0);
  // Closed, its number taken by a file: not the socket, so forgotten.
  second.Close();
  const int file = open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_EQ(file, fd);
  EXPECT_EQ(tally.open(), 1);  // Not swept yet.
  tally.Sweep();
  EXPECT_EQ(tally.open(), 0);
  EXPECT_EQ(tally.open_from("ipv4:10.0.0.2"), 0);
  close(file);
}

// Admit sweeps when its counts would refuse, at most once per interval.
TEST(ConnectionTallyTest, SweepsAtMostOncePerInterval) {
  ConnectionTally tally(1, absl::Hours(1));
  Socket a, b, c;
  ASSERT_EQ(tally.Admit(a.fd(), "ipv4:10.0.0.1"), Verdict::kAdmitted);
  a.Close();
  // The first refusal sweeps (none before): a is found closed.
  EXPECT_EQ(tally.Admit(b.fd(), "ipv4:10.0.0.1"), Verdict::kAdmitted);
  b.Close();
  // Within the hour, no sweep: b still counts.
  EXPECT_EQ(tally.Admit(c.fd(), "ipv4:10.0.0.1"), Verdict::kFull);
  tally.Sweep();
  EXPECT_EQ(tally.Admit(c.fd(), "ipv4:10.0.0.1"), Verdict::kAdmitted);
}

// A TCP connection from `from` to a listener on `listen_address`, accepted:
// the accepted descriptor, or -1 (the test skips) where that address is not
// this machine's.
int Accepted(int family, const char* listen_address, const char* from,
             bool v6_only, int* client) {
  *client = -1;
  const int listener = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) return -1;
  sockaddr_storage address{};
  socklen_t length = 0;
  if (family == AF_INET) {
    auto* v4 = reinterpret_cast<sockaddr_in*>(&address);
    v4->sin_family = AF_INET;
    inet_pton(AF_INET, listen_address, &v4->sin_addr);
    length = sizeof(*v4);
  } else {
    const int v6only = v6_only ? 1 : 0;
    setsockopt(listener, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof(v6only));
    auto* v6 = reinterpret_cast<sockaddr_in6*>(&address);
    v6->sin6_family = AF_INET6;
    inet_pton(AF_INET6, listen_address, &v6->sin6_addr);
    length = sizeof(*v6);
  }
  if (bind(listener, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
      listen(listener, 4) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) !=
          0) {
    close(listener);
    return -1;
  }
  const bool to_v4 = strchr(from, ':') == nullptr;
  sockaddr_storage target{};
  socklen_t target_length = 0;
  sockaddr_storage source{};
  if (to_v4) {
    auto* v4 = reinterpret_cast<sockaddr_in*>(&target);
    v4->sin_family = AF_INET;
    v4->sin_port = family == AF_INET
                       ? reinterpret_cast<sockaddr_in*>(&address)->sin_port
                       : reinterpret_cast<sockaddr_in6*>(&address)->sin6_port;
    inet_pton(AF_INET, "127.0.0.1", &v4->sin_addr);
    target_length = sizeof(*v4);
    auto* bound = reinterpret_cast<sockaddr_in*>(&source);
    bound->sin_family = AF_INET;
    inet_pton(AF_INET, from, &bound->sin_addr);
  } else {
    auto* v6 = reinterpret_cast<sockaddr_in6*>(&target);
    v6->sin6_family = AF_INET6;
    v6->sin6_port = reinterpret_cast<sockaddr_in6*>(&address)->sin6_port;
    inet_pton(AF_INET6, "::1", &v6->sin6_addr);
    target_length = sizeof(*v6);
    auto* bound = reinterpret_cast<sockaddr_in6*>(&source);
    bound->sin6_family = AF_INET6;
    inet_pton(AF_INET6, from, &bound->sin6_addr);
  }
  *client = socket(to_v4 ? AF_INET : AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (*client < 0 ||
      bind(*client, reinterpret_cast<sockaddr*>(&source),
           to_v4 ? sizeof(sockaddr_in) : sizeof(sockaddr_in6)) != 0 ||
      connect(*client, reinterpret_cast<sockaddr*>(&target), target_length) !=
          0) {
    if (*client >= 0) close(*client);
    *client = -1;
    close(listener);
    return -1;
  }
  const int accepted = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  close(listener);
  return accepted;
}

TEST(SocketPeerAddressTest, NamesTheClientAsGrpcDoesWithoutThePort) {
  int client = -1;
  int fd = Accepted(AF_INET, "127.0.0.1", "127.0.0.2", false, &client);
  ASSERT_GE(fd, 0) << "loopback 127.0.0.2 is this machine's on Linux";
  EXPECT_EQ(SocketPeerAddress(fd), "ipv4:127.0.0.2");
  close(fd);
  close(client);
  // IPv4 on a dual-stack IPv6 listener: mapped, named as IPv4.
  fd = Accepted(AF_INET6, "::", "127.0.0.3", false, &client);
  if (fd >= 0) {
    EXPECT_EQ(SocketPeerAddress(fd), "ipv4:127.0.0.3");
    close(fd);
    close(client);
  }
  fd = Accepted(AF_INET6, "::1", "::1", true, &client);
  if (fd >= 0) {
    EXPECT_EQ(SocketPeerAddress(fd), "ipv6:[::1]");
    close(fd);
    close(client);
  } else {
    std::cout << "no IPv6 loopback here: its case not run\n";
  }
  Socket local;
  EXPECT_EQ(SocketPeerAddress(local.fd()), "unknown");
  EXPECT_EQ(SocketPeerAddress(-1), "unknown");
}

}  // namespace
}  // namespace attnserve
