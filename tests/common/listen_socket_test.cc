// ConnectionShedder and ListenTcp: a listener that goes on accepting when the
// process is out of file descriptors. Each case runs in a child process, whose
// descriptor limit it lowers and fills; the parent is the client.
#include "attnserve/common/listen_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <functional>
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

// Whether the server closed `fd` within 5 s (a read sees the end).
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

// Runs `server(listener, go)` in a child with a limit of 64 descriptors, once
// the parent has made its connections: `client(port)` returns what the child
// must also return (0) for the case to pass.
void RunCase(const std::function<int(int listener)>& server,
             const std::function<int(int port)>& client) {
  absl::StatusOr<int> listener = ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok()) << listener.status();
  const int port = BoundPort(*listener);
  ASSERT_GT(port, 0);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  if (child == 0) {
    close(ready[1]);
    rlimit limit{64, 64};
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) _exit(90);
    char go = 0;
    if (read(ready[0], &go, 1) != 1) _exit(91);
    _exit(server(*listener));
  }
  close(ready[0]);
  const int client_result = client(port);
  ASSERT_EQ(write(ready[1], "g", 1), 1);
  close(ready[1]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  close(*listener);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(client_result, 0);
}

TEST(ConnectionShedderTest, AtTheLimitTheSpareDescriptorShedsTheConnection) {
  std::vector<int> clients;
  RunCase(
      [](int listener) {
        ConnectionShedder shedder(0);
        const std::vector<int> taken = FillDescriptors();
        if (taken.empty()) return 1;
        errno = 0;
        // Both queued connections are taken and closed; then none waits, and
        // the kernel, which finds a descriptor before it looks at the queue,
        // says EMFILE.
        if (shedder.Accept(listener) != -1) return 2;
        if (errno != EMFILE && errno != EAGAIN) return 3;
        if (shedder.shed() != 2) return 4;
        // A descriptor comes free: the next connection is served.
        close(taken.back());
        return 0;
      },
      [&clients](int port) {
        for (int i = 0; i < 2; ++i) clients.push_back(Connect(port));
        return clients[0] >= 0 && clients[1] >= 0 ? 0 : 1;
      });
  for (int fd : clients) {
    EXPECT_TRUE(ClosedByServer(fd));
    close(fd);
  }
}

TEST(ConnectionShedderTest, AConnectionThatWouldTakeTheReserveIsShed) {
  std::vector<int> clients;
  RunCase(
      [](int listener) {
        // 64 descriptors, 8 of them (an eighth) kept free: fill to 57 open,
        // so that the next connection would be number 57, past the ceiling.
        ConnectionShedder shedder(16);
        std::vector<int> taken = FillDescriptors();
        for (int i = 0; i < 7 && !taken.empty(); ++i) {
          close(taken.back());
          taken.pop_back();
        }
        if (shedder.Accept(listener) != -1 || shedder.shed() != 1) return 2;
        // With room again, the second connection is served.
        for (int i = 0; i < 16 && !taken.empty(); ++i) {
          close(taken.back());
          taken.pop_back();
        }
        return 0;
      },
      [&clients](int port) {
        clients.push_back(Connect(port));
        return clients[0] >= 0 ? 0 : 1;
      });
  ASSERT_EQ(clients.size(), 1u);
  EXPECT_TRUE(ClosedByServer(clients[0]));
  close(clients[0]);
}

TEST(ConnectionShedderTest, BelowTheReserveConnectionsAreServed) {
  std::vector<int> clients;
  RunCase(
      [](int listener) {
        ConnectionShedder shedder(16);
        const int fd = shedder.Accept(listener);
        if (fd < 0 || shedder.shed() != 0) return 2;
        return send(fd, "x", 1, MSG_NOSIGNAL) == 1 ? 0 : 3;
      },
      [&clients](int port) {
        clients.push_back(Connect(port));
        return clients[0] >= 0 ? 0 : 1;
      });
  ASSERT_EQ(clients.size(), 1u);
  char byte = 0;
  EXPECT_EQ(recv(clients[0], &byte, 1, 0), 1);
  EXPECT_EQ(byte, 'x');
  close(clients[0]);
}

TEST(ListenTcpTest, ABusyPortIsRefusedWithTheSystemsReason) {
  absl::StatusOr<int> first = ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<int> second = ListenTcp("127.0.0.1", BoundPort(*first));
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(second.status().message(), "Address already in use");
  close(*first);
  absl::StatusOr<int> unknown = ListenTcp("no-such-host.invalid", 0);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace attnserve
