// A real attnserve server on a free loopback port, and a client connected to
// it.
#ifndef ATTNSERVE_TESTS_SERVER_SERVER_FIXTURE_H_
#define ATTNSERVE_TESTS_SERVER_SERVER_FIXTURE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/client/client.h"
#include "attnserve/server/server.h"
#include "grpc/grpc.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"

namespace attnserve::testing {

// An FLOAT32 Attend request of shape `s` with inputs uniform in [-1, 1) drawn
// from `seed`.
inline v1::AttendRequest RandomAttendRequest(const ReferenceShape& s,
                                             uint64_t seed) {
  v1::AttendRequest request;
  *request.mutable_query() = MakeFloat32Tensor(
      {s.batch, s.heads, s.query_len, s.key_dim},
      RandomValues(s.batch * s.heads * s.query_len * s.key_dim, seed));
  *request.mutable_key() = MakeFloat32Tensor(
      {s.batch, s.kv_heads, s.key_len, s.key_dim},
      RandomValues(s.batch * s.kv_heads * s.key_len * s.key_dim, seed + 1));
  *request.mutable_value() = MakeFloat32Tensor(
      {s.batch, s.kv_heads, s.key_len, s.value_dim},
      RandomValues(s.batch * s.kv_heads * s.key_len * s.value_dim, seed + 2));
  return request;
}

class ServerFixture : public ::testing::Test {
 protected:
  // gRPC stays initialised from the first test to the exit. Otherwise each
  // test's teardown drops gRPC's last reference (the server's completion
  // queue, after the client's channel), and grpc_shutdown joins gRPC's
  // executor threads; one of them may be in the TCP backup poller that a write
  // which filled its socket started (gRPC 1.51 tcp_posix.cc, run_poller),
  // which waits up to 10 s in one poll, unwoken once the connections are gone:
  // the teardown then took ~9 s instead of milliseconds.
  ServerFixture() {
    static const bool initialized = [] {
      grpc_init();
      return true;
    }();
    (void)initialized;
  }

  // Options the server starts with; tests may change them before SetUp runs.
  static ServerOptions DefaultOptions() {
    ServerOptions options;
    options.address = "127.0.0.1";
    options.port = 0;
    options.transport.max_message_bytes = 4 << 20;
    options.engine.max_workspace_bytes = 16 << 20;
    // More than the default of one on a small machine, so that a call's
    // events reach its handler on different threads, as on a large one.
    options.transport.io_threads = 3;
    return options;
  }

  void StartServer(const ServerOptions& options) {
    absl::StatusOr<std::unique_ptr<AttnServer>> server =
        AttnServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(server).value();
    ClientOptions client_options;
    client_options.max_message_bytes =
        64 << 20;  // Larger than the server's, to test its limit.
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(
        absl::StrCat("127.0.0.1:", server_->port()), client_options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(client).value();
  }

  void SetUp() override { StartServer(DefaultOptions()); }

  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<Client> client_;
};

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_SERVER_SERVER_FIXTURE_H_
