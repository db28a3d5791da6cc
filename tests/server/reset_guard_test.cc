#include "attnserve/server/rpc/reset_guard.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

// A loopback TCP connection: the accepting end is this process's server side.
struct Connection {
  int listener = -1, client = -1, server = -1;
  std::string peer;  // The client's end, as gRPC names a peer.

  explicit Connection(bool ipv6) {
    const int family = ipv6 ? AF_INET6 : AF_INET;
    listener = socket(family, SOCK_STREAM, 0);
    sockaddr_storage address{};
    socklen_t length;
    if (ipv6) {
      auto* in6 = reinterpret_cast<sockaddr_in6*>(&address);
      in6->sin6_family = AF_INET6;
      in6->sin6_addr = in6addr_loopback;
      length = sizeof(sockaddr_in6);
    } else {
      auto* in4 = reinterpret_cast<sockaddr_in*>(&address);
      in4->sin_family = AF_INET;
      in4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      length = sizeof(sockaddr_in);
    }
    auto* any = reinterpret_cast<sockaddr*>(&address);
    EXPECT_EQ(bind(listener, any, length), 0);
    EXPECT_EQ(listen(listener, 1), 0);
    EXPECT_EQ(getsockname(listener, any, &length), 0);
    client = socket(family, SOCK_STREAM, 0);
    EXPECT_EQ(connect(client, any, length), 0);
    server = accept(listener, nullptr, nullptr);
    sockaddr_storage local{};
    socklen_t local_length = sizeof(local);
    getsockname(client, reinterpret_cast<sockaddr*>(&local), &local_length);
    const int client_port =
        ntohs(ipv6 ? reinterpret_cast<sockaddr_in6*>(&local)->sin6_port
                   : reinterpret_cast<sockaddr_in*>(&local)->sin_port);
    peer = ipv6 ? absl::StrCat("ipv6:[::1]:", client_port)
                : absl::StrCat("ipv4:127.0.0.1:", client_port);
  }
  ~Connection() {
    close(client);
    close(server);
    close(listener);
  }
  // Whether the client sees the server end the connection.
  bool ClientSeesTheEnd() const {
    char byte;
    return recv(client, &byte, 1, MSG_DONTWAIT) == 0;
  }
};

TEST(ShutDownConnectionTest, EndsTheSocketWhoseRemoteEndIsThePeer) {
  for (const bool ipv6 : {false, true}) {
    Connection connection(ipv6);
    ASSERT_GE(connection.server, 0);
    EXPECT_FALSE(connection.ClientSeesTheEnd());
    const std::string& peer = connection.peer;
    ASSERT_TRUE(ShutDownConnection(peer).ok()) << peer;
    EXPECT_TRUE(connection.ClientSeesTheEnd()) << peer;
  }
}

TEST(ShutDownConnectionTest, SaysWhatItCouldNotFind) {
  EXPECT_EQ(ShutDownConnection("ipv4:127.0.0.1:1").code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ShutDownConnection("unix:/tmp/socket").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShutDownConnection("ipv4:not-an-address:80").code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ResetGuardTest, ClosesAConnectionPastItsCancellationsInASecond) {
  Connection connection(false);
  const std::string& peer = connection.peer;
  ResetGuard guard(3);
  const absl::Time start = absl::FromUnixSeconds(1000);
  // Three a second are allowed, second after second.
  for (int second = 0; second < 3; ++second) {
    for (int i = 0; i < 3; ++i) {
      EXPECT_FALSE(guard.ClientCancelled(
          peer, start + absl::Seconds(second) + absl::Milliseconds(10 * i)));
    }
  }
  EXPECT_FALSE(connection.ClientSeesTheEnd());
  // Another connection's cancellations do not count against this one.
  EXPECT_FALSE(guard.ClientCancelled("ipv4:127.0.0.1:1", start));
  const absl::Time later = start + absl::Seconds(10);
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(guard.ClientCancelled(peer, later));
  EXPECT_TRUE(guard.ClientCancelled(peer, later));
  EXPECT_FALSE(guard.ClientCancelled(peer, later));  // closed once
  EXPECT_TRUE(connection.ClientSeesTheEnd());
  EXPECT_EQ(guard.closed(), 1);
}

// A client answered in a second (hedged requests, streams closed early) may
// cancel the cap plus its answers, at most four times the cap; answers count
// from its first cancellation in the second, and only in that second.
TEST(ResetGuardTest, AConnectionMayCancelTheCapPlusItsAnswersUpToFourTimesIt) {
  const absl::Time start = absl::FromUnixSeconds(1000);
  {
    Connection connection(false);
    const std::string& peer = connection.peer;
    ResetGuard guard(3);
    // Answers before any cancellation need no count.
    for (int i = 0; i < 100; ++i) guard.Answered(peer, start);
    EXPECT_FALSE(guard.ClientCancelled(peer, start));
    for (int i = 0; i < 2; ++i) {
      guard.Answered(peer, start + absl::Milliseconds(i));
    }
    // Another connection's answers do not count for this one.
    EXPECT_FALSE(guard.ClientCancelled("ipv4:127.0.0.1:1", start));
    for (int i = 0; i < 10; ++i) guard.Answered("ipv4:127.0.0.1:1", start);
    // 3 + 2 = 5 cancellations in all are allowed; the sixth is not.
    for (int i = 0; i < 4; ++i) {
      EXPECT_FALSE(
          guard.ClientCancelled(peer, start + absl::Milliseconds(100 + i)));
    }
    EXPECT_FALSE(connection.ClientSeesTheEnd());
    EXPECT_TRUE(guard.ClientCancelled(peer, start + absl::Milliseconds(200)));
    EXPECT_TRUE(connection.ClientSeesTheEnd());
    EXPECT_EQ(guard.closed(), 1);
  }
  {
    // However many answers, four times the cap is the most.
    Connection connection(false);
    const std::string& peer = connection.peer;
    ResetGuard guard(3);
    EXPECT_FALSE(guard.ClientCancelled(peer, start));
    for (int i = 0; i < 1000; ++i) guard.Answered(peer, start);
    for (int i = 0; i < 11; ++i)
      EXPECT_FALSE(guard.ClientCancelled(peer, start));
    EXPECT_FALSE(connection.ClientSeesTheEnd());
    EXPECT_TRUE(guard.ClientCancelled(peer, start));
    EXPECT_TRUE(connection.ClientSeesTheEnd());
  }
  {
    // The next second starts from nothing: the answers of the last one are
    // gone, and so are answers a second after the window opened.
    Connection next(false);
    const std::string& next_peer = next.peer;
    ResetGuard guard(3);
    EXPECT_FALSE(guard.ClientCancelled(next_peer, start));
    for (int i = 0; i < 10; ++i) guard.Answered(next_peer, start);
    for (int i = 0; i < 10; ++i) {
      guard.Answered(next_peer, start + absl::Milliseconds(1500));
    }
    for (int i = 0; i < 3; ++i) {
      EXPECT_FALSE(
          guard.ClientCancelled(next_peer, start + absl::Milliseconds(1600)));
    }
    EXPECT_TRUE(
        guard.ClientCancelled(next_peer, start + absl::Milliseconds(1600)));
    EXPECT_TRUE(next.ClientSeesTheEnd());
  }
}

TEST(ResetGuardTest, ZeroTurnsItOff) {
  ResetGuard guard(0);
  for (int i = 0; i < 1000; ++i) {
    EXPECT_FALSE(guard.ClientCancelled("ipv4:127.0.0.1:1"));
  }
  EXPECT_EQ(guard.closed(), 0);
}

}  // namespace
}  // namespace attnserve
