// ConnectionShedder and ListenTcp: a listener that goes on accepting when the
// process is out of file descriptors. Each case runs in a child process, whose
// descriptor limit it lowers and fills; the parent is the client.
#include "attnserve/common/listen_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <functional>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

// A client connection to 127.0.0.1:`port`, or -1.
int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address),
              sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Whether the server closed `fd` within 5 s (a read sees the end or a reset).
bool ClosedByServer(int fd) {
  timeval timeout{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  char byte = 0;
  const ssize_t n = recv(fd, &byte, 1, 0);
  return n == 0 || (n < 0 && errno == ECONNRESET);
}

// Opens /dev/null until the process is out of descriptors; returns them.
std::vector<int> FillDescriptors() {
  std::vector<int> taken;
  while (true) {
    const int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return taken;
    taken.push_back(fd);
  }
}

// The next connection on non-blocking `listener` within 5 s, served with one
// byte: 0, or an error code.
int ServeNext(ConnectionShedder& shedder, int listener) {
  pollfd waiting{listener, POLLIN, 0};
  if (poll(&waiting, 1, 5000) != 1) return 10;
  const int fd = shedder.Accept(listener);
  if (fd < 0) return 11;
  return send(fd, "x", 1, MSG_NOSIGNAL) == 1 ? 0 : 12;
}

// Closes the last `count` of `taken` (the highest numbers).
void CloseLast(std::vector<int>& taken, int count) {
  for (int i = 0; i < count && !taken.empty(); ++i) {
    close(taken.back());
    taken.pop_back();
  }
}

// Whether the server sent its one byte on `fd` within 5 s.
bool Served(int fd) {
  timeval timeout{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  char byte = 0;
  return recv(fd, &byte, 1, 0) == 1 && byte == 'x';
}

// Each of `shed` is closed by the server; once the child is `wait`ed for, a
// new connection to `port` is served.
void ExpectShedThenNextServed(const std::vector<int>& shed, int port,
                              const std::function<void()>& wait) {
  for (const int fd : shed) {
    EXPECT_TRUE(ClosedByServer(fd));
    close(fd);
  }
  wait();
  const int next = Connect(port);
  EXPECT_TRUE(Served(next));
  close(next);
}

// A listener on 127.0.0.1 whose connections `server(listener, ready)` takes
// in a child limited to 64 descriptors, and `client(port)` makes: the child
// starts once `client` has returned, and `checks(port, wait)` goes on while
// the child runs, with the listener still open, so that a connection the
// child did not take is not closed by the parent's end. The child calls
// `ready` when it will take one more connection; `wait` returns once it has.
// `client`'s result and the child's must be 0.
void RunCase(
    const std::function<int(int listener, const std::function<void()>& ready)>&
        server,
    const std::function<int(int port)>& client,
    const std::function<void(int port, const std::function<void()>& wait)>&
        checks) {
  absl::StatusOr<int> listener = ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok()) << listener.status();
  const int port = BoundPort(*listener);
  ASSERT_GT(port, 0);
  int go[2];
  int next[2];
  ASSERT_EQ(pipe(go), 0);
  ASSERT_EQ(pipe(next), 0);
  const pid_t child = fork();
  if (child == 0) {
    close(go[1]);
    close(next[0]);
    rlimit limit{64, 64};
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) _exit(90);
    char byte = 0;
    if (read(go[0], &byte, 1) != 1) _exit(91);
    const int write_end = next[1];
    _exit(server(*listener, [write_end] {
      if (write(write_end, "n", 1) != 1) _exit(92);
    }));
  }
  close(go[0]);
  close(next[1]);
  EXPECT_EQ(client(port), 0);
  ASSERT_EQ(write(go[1], "g", 1), 1);
  close(go[1]);
  const int read_end = next[0];
  checks(port, [read_end] {
    pollfd readable{read_end, POLLIN, 0};
    char byte = 0;
    ASSERT_EQ(poll(&readable, 1, 5000), 1);
    ASSERT_EQ(read(read_end, &byte, 1), 1);
  });
  close(next[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  close(*listener);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(ConnectionShedderTest, AtTheLimitTheSpareDescriptorShedsTheConnection) {
  std::vector<int> clients;
  RunCase(
      [](int listener, const std::function<void()>& ready) {
        ConnectionShedder shedder(0);
        std::vector<int> taken = FillDescriptors();
        if (taken.empty()) return 1;
        errno = 0;
        // Both queued connections are taken and closed; then none waits, and
        // the kernel, which finds a descriptor before it looks at the queue,
        // says EMFILE.
        if (shedder.Accept(listener) != -1) return 2;
        if (errno != EMFILE && errno != EAGAIN) return 3;
        if (shedder.shed() != 2) return 4;
        // Descriptors come free: the next connection is served.
        CloseLast(taken, 2);
        ready();
        return ServeNext(shedder, listener);
      },
      [&clients](int port) {
        for (int i = 0; i < 2; ++i) clients.push_back(Connect(port));
        return clients[0] >= 0 && clients[1] >= 0 ? 0 : 1;
      },
      [&clients](int port, const std::function<void()>& wait) {
        ExpectShedThenNextServed(clients, port, wait);
      });
}

TEST(ConnectionShedderTest, AConnectionThatWouldTakeTheReserveIsShed) {
  int first = -1;
  RunCase(
      [](int listener, const std::function<void()>& ready) {
        // 64 descriptors, 8 of them (an eighth) kept free: fill to 57 open,
        // so that the next connection would be number 57, past the ceiling.
        ConnectionShedder shedder(16);
        std::vector<int> taken = FillDescriptors();
        CloseLast(taken, 7);
        if (shedder.Accept(listener) != -1 || shedder.shed() != 1) return 2;
        // With room again, the next connection is served.
        CloseLast(taken, 16);
        ready();
        return ServeNext(shedder, listener);
      },
      [&first](int port) {
        first = Connect(port);
        return first >= 0 ? 0 : 1;
      },
      [&first](int port, const std::function<void()>& wait) {
        ExpectShedThenNextServed({first}, port, wait);
      });
}

TEST(ConnectionShedderTest, BelowTheReserveConnectionsAreServed) {
  int client = -1;
  RunCase(
      [](int listener, const std::function<void()>&) {
        ConnectionShedder shedder(16);
        const int result = ServeNext(shedder, listener);
        return result == 0 && shedder.shed() == 0 ? 0 : 2;
      },
      [&client](int port) {
        client = Connect(port);
        return client >= 0 ? 0 : 1;
      },
      [&client](int, const std::function<void()>&) {
        EXPECT_TRUE(Served(client));
        close(client);
      });
}

// The wildcard takes IPv4 and, where the machine has IPv6, IPv6 too, as
// gRPC's own listener did (--address=0.0.0.0 is the default).
TEST(ListenTcpTest, TheWildcardTakesBothFamilies) {
  for (const std::string wildcard : {"0.0.0.0", "::", ""}) {
    absl::StatusOr<std::vector<int>> listeners = ListenTcpAll(wildcard, 0);
    ASSERT_TRUE(listeners.ok()) << wildcard << ": " << listeners.status();
    ASSERT_EQ(listeners->size(), 1u) << wildcard;
    const int port = BoundPort(listeners->front());
    const int v4 = Connect(port);
    EXPECT_GE(v4, 0) << wildcard;
    close(v4);
    const int v6 = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in6 loopback6{};
    loopback6.sin6_family = AF_INET6;
    loopback6.sin6_addr = in6addr_loopback;
    loopback6.sin6_port = htons(static_cast<uint16_t>(port));
    if (v6 >= 0 && connect(v6, reinterpret_cast<const sockaddr*>(&loopback6),
                           sizeof(loopback6)) != 0) {
      // Refused is the defect; a machine without IPv6 says otherwise.
      EXPECT_NE(errno, ECONNREFUSED) << wildcard << ": IPv6 not taken";
    }
    if (v6 >= 0) close(v6);
    close(listeners->front());
  }
}

// A name listens on each of its addresses, on one port.
TEST(ListenTcpTest, ANameListensOnEachOfItsAddressesOnOnePort) {
  absl::StatusOr<std::vector<int>> listeners = ListenTcpAll("localhost", 0);
  ASSERT_TRUE(listeners.ok()) << listeners.status();
  ASSERT_FALSE(listeners->empty());
  const int port = BoundPort(listeners->front());
  for (const int fd : *listeners) {
    EXPECT_EQ(BoundPort(fd), port);
    close(fd);
  }
}

TEST(ListenTcpTest, ABusyPortIsRefusedWithTheSystemsReason) {
  absl::StatusOr<int> first = ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<int> second = ListenTcp("127.0.0.1", BoundPort(*first));
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(second.status().message(), "Address already in use");
  close(*first);
  absl::StatusOr<int> any = ListenTcp("0.0.0.0", 0);
  ASSERT_TRUE(any.ok()) << any.status();
  absl::StatusOr<int> again = ListenTcp("::", BoundPort(*any));
  EXPECT_EQ(again.status().message(), "Address already in use");
  close(*any);
  absl::StatusOr<int> unknown = ListenTcp("no-such-host.invalid", 0);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace attnserve
