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
  int peer() const { return peer_; }
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
  EXPECT_EQ(tally.count(Verdict::kFull), 1);
  // Closed by its owner (gRPC), the tally notices at the next admission (no
  // address holds two more than another: none is displaced meanwhile).
  sockets[1].Close();
  EXPECT_EQ(tally.Admit(sockets[4].fd(), "ipv4:10.0.0.9"), Verdict::kAdmitted);
  EXPECT_EQ(tally.open(), 4);
  EXPECT_EQ(tally.open_from("ipv4:10.0.0.1"), 0);
  EXPECT_EQ(tally.open_from("ipv4:10.0.0.9"), 1);
  EXPECT_EQ(tally.count(Verdict::kAddressShare), 0);
}

// An address with more than a sixteenth of the connections may not take the
// count past seven eighths; another address takes the rest.
TEST(ConnectionTallyTest, OneAddressLeavesTheLastEighthToOthers) {
  ConnectionTally tally(16, absl::ZeroDuration());
  std::vector<Socket> sockets(18);
  int next = 0;
  for (; next < 14; ++next) {
    ASSERT_EQ(tally.Admit(sockets[next].fd(), "ipv6:[2001:db8::1]"),
              Verdict::kAdmitted)
        << next;
  }
  EXPECT_EQ(tally.Admit(sockets[next].fd(), "ipv6:[2001:db8::1]"),
            Verdict::kAddressShare);
  EXPECT_EQ(tally.open_from("ipv6:[2001:db8::1]"), 14);
  // Another client: its first and second (it holds not more than a
  // sixteenth) fill the tally.
  EXPECT_EQ(tally.Admit(sockets[next++].fd(), "ipv4:10.0.0.2"),
            Verdict::kAdmitted);
  EXPECT_EQ(tally.Admit(sockets[next++].fd(), "ipv4:10.0.0.2"),
            Verdict::kAdmitted);
  EXPECT_EQ(tally.open(), 16);
  EXPECT_EQ(tally.count(Verdict::kAddressShare), 1);
  EXPECT_EQ(tally.count(Verdict::kFull), 0);
  // A lone client under a small limit is not held back by rounding: 7 of 8.
  ConnectionTally small(8, absl::ZeroDuration());
  std::vector<Socket> more(8);
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ(small.Admit(more[i].fd(), "ipv4:10.0.0.4"), Verdict::kAdmitted);
  }
  EXPECT_EQ(small.Admit(more[7].fd(), "ipv4:10.0.0.4"), Verdict::kAddressShare);
}

// Full, a connection from an address holding at least two fewer than the
// address holding the most takes the place of that address's newest, which
// is shut down: three addresses filling the tally between them do not keep a
// fourth out (a health probe, say).
TEST(ConnectionTallyTest, AFullTallyShutsTheHeaviestAddresssNewestForAnother) {
  ConnectionTally tally(16, absl::ZeroDuration());
  std::vector<Socket> sockets(20);
  int next = 0;
  for (; next < 14; ++next) tally.Admit(sockets[next].fd(), "ipv4:10.0.0.1");
  for (; next < 16; ++next) tally.Admit(sockets[next].fd(), "ipv4:10.0.0.2");
  ASSERT_EQ(tally.open(), 16);
  std::string displaced;
  EXPECT_EQ(tally.Admit(sockets[16].fd(), "ipv4:10.0.0.3", &displaced),
            Verdict::kDisplaced);
  EXPECT_EQ(displaced, "ipv4:10.0.0.1");
  EXPECT_EQ(tally.open(), 16);
  EXPECT_EQ(tally.open_from("ipv4:10.0.0.1"), 13);
  EXPECT_EQ(tally.open_from("ipv4:10.0.0.3"), 1);
  EXPECT_EQ(tally.count(Verdict::kDisplaced), 1);
  // The newest of 10.0.0.1's, sockets[13], was shut down: its peer reads the
  // end; the one before it still waits.
  char byte = 0;
  EXPECT_EQ(recv(sockets[13].peer(), &byte, 1, MSG_DONTWAIT), 0);
  EXPECT_EQ(recv(sockets[12].peer(), &byte, 1, MSG_DONTWAIT), -1);
  // The heaviest asking for more is refused, not displacing itself.
  EXPECT_EQ(tally.Admit(sockets[17].fd(), "ipv4:10.0.0.1"), Verdict::kFull);
  EXPECT_EQ(tally.count(Verdict::kDisplaced), 1);
  // A displaced socket gRPC has not closed yet is not counted twice: its
  // descriptor taken again is a new connection.
  sockets[13].Close();
  Socket again;
  ASSERT_EQ(tally.Admit(again.fd(), "ipv4:10.0.0.4"), Verdict::kDisplaced);
  EXPECT_EQ(tally.open(), 16);
  EXPECT_EQ(tally.open_from("ipv4:10.0.0.1"), 12);
  // Addresses one apart do not trade a place back and forth.
  ConnectionTally even(4, absl::ZeroDuration());
  std::vector<Socket> more(5);
  even.Admit(more[0].fd(), "ipv4:10.0.0.1");
  even.Admit(more[1].fd(), "ipv4:10.0.0.1");
  even.Admit(more[2].fd(), "ipv4:10.0.0.2");
  even.Admit(more[3].fd(), "ipv4:10.0.0.3");
  EXPECT_EQ(even.Admit(more[4].fd(), "ipv4:10.0.0.2"), Verdict::kFull);
  EXPECT_EQ(even.Admit(more[4].fd(), "ipv4:10.0.0.4"), Verdict::kDisplaced);
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
