// attnserve::Client against a fake service (retries, deadlines, TLS, tokens)
// and against a real server (async calls, streaming sessions, exact sharded
// attention).
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnserve/client/client.h"
#include "attnserve/client/replicas.h"
#include "attnserve/client/session.h"
#include "attnserve/client/sharded_attention.h"
#include "attnserve/client/sharded_session.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"
#include "server/free_port.h"
#include "server/metrics_scrape.h"
#include "server/server_fixture.h"
#include "server/test_certificates.h"

namespace attnserve {
namespace {

using ::attnserve::testing::FreeLoopbackPort;
using ::attnserve::testing::MakeCertificates;
using ::attnserve::testing::RandomValues;
using ::attnserve::testing::TestCertificates;
using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(30);

// Answers Attend with the statuses it is given, in order (then OK), recording
// each call's authorization header.
class FakeAttentionService final
    : public v1::AttentionService::CallbackService {
 public:
  explicit FakeAttentionService(std::vector<grpc::StatusCode> failures)
      : failures_(std::move(failures)) {}

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* /*request*/,
                                   v1::AttendResponse* response) override {
    absl::MutexLock lock(&mutex_);
    const auto token = context->client_metadata().find("authorization");
    tokens_.push_back(
        token == context->client_metadata().end()
            ? ""
            : std::string(token->second.data(), token->second.size()));
    const size_t call = calls_++;
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (call < failures_.size()) {
      reactor->Finish(grpc::Status(failures_[call], "injected"));
    } else {
      response->mutable_timing()->set_compute_us(7);
      reactor->Finish(grpc::Status::OK);
    }
    return reactor;
  }

  size_t calls() {
    absl::MutexLock lock(&mutex_);
    return calls_;
  }
  std::vector<std::string> tokens() {
    absl::MutexLock lock(&mutex_);
    return tokens_;
  }

 private:
  const std::vector<grpc::StatusCode> failures_;
  absl::Mutex mutex_;
  size_t calls_ ABSL_GUARDED_BY(mutex_) = 0;
  std::vector<std::string> tokens_ ABSL_GUARDED_BY(mutex_);
};

// A gRPC server on a loopback port (a free one by default) hosting `service`.
struct FakeServer {
  FakeServer(grpc::Service* service,
             std::shared_ptr<grpc::ServerCredentials> credentials =
                 grpc::InsecureServerCredentials(),
             int at_port = 0) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", at_port), credentials,
                             &port);
    builder.RegisterService(service);
    server = builder.BuildAndStart();
  }
  ~FakeServer() { server->Shutdown(); }
  std::string target() const { return absl::StrCat("127.0.0.1:", port); }

  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

std::unique_ptr<Client> Connect(const std::string& target,
                                ClientOptions options = {}) {
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect(target, options);
  EXPECT_TRUE(client.ok()) << client.status();
  return std::move(client).value();
}

TEST(ClientRetryTest, RetriesUnavailableAndResourceExhaustedWithBackoff) {
  FakeAttentionService service(
      {grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::RESOURCE_EXHAUSTED});
  FakeServer server(&service);
  ClientOptions options;
  options.retry.max_attempts = 4;
  options.retry.initial_backoff = absl::Milliseconds(20);
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::AttendResponse> response =
      Connect(server.target(), options)->Attend(v1::AttendRequest(), kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(service.calls(), 3u);
  EXPECT_GE(absl::Now() - start,
            absl::Milliseconds(20));  // Two backoffs of ≥ 10 and ≥ 20 ms.
}

// A broken server: ListSessions pages that never end (its token repeats),
// sessions described with 2^40 layers or negative heads or under another id,
// steps with a query answered without an output.
class BrokenSessionService final
    : public v1::AttentionService::CallbackService {
 public:
  // CreateSession of these ids answers 2^40 layers, or another session.
  static inline const std::string kHugeId = std::string(32, 'a');
  static inline const std::string kOtherId = std::string(32, 'c');

  static void Describe(const std::string& id, v1::SessionInfo* info) {
    info->set_session_id(id);
    info->set_num_layers(id == kHugeId ? int64_t{1} << 40 : 1);
    info->set_num_heads(1);
    info->set_num_kv_heads(1);
    info->set_key_dim(8);
    info->set_value_dim(8);
  }

  grpc::ServerUnaryReactor* CreateSession(
      grpc::CallbackServerContext* context,
      const v1::CreateSessionRequest* request,
      v1::CreateSessionResponse* response) override {
    const std::string& id = request->session_id();
    Describe(id.empty()       ? std::string(32, 'f')
             : id == kOtherId ? std::string(32, 'e')
                              : id,
             response->mutable_session());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* TruncateSession(
      grpc::CallbackServerContext* context,
      const v1::TruncateSessionRequest* /*request*/,
      v1::TruncateSessionResponse* response) override {
    Describe(std::string(32, 'e'), response->mutable_session());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* context,
                                 const v1::StepRequest* request,
                                 v1::StepResponse* response) override {
    for (const v1::SessionStep& step : request->steps()) {
      response->add_results()->set_length(
          step.expected_length() +
          (step.key().shape_size() == 3 ? step.key().shape(1) : 0));
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* ListSessions(
      grpc::CallbackServerContext* context,
      const v1::ListSessionsRequest* /*request*/,
      v1::ListSessionsResponse* response) override {
    response->add_sessions()->set_session_id(std::string(32, 'a'));
    response->set_next_page_token("again");
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* GetSession(
      grpc::CallbackServerContext* context,
      const v1::GetSessionRequest* request,
      v1::GetSessionResponse* response) override {
    v1::SessionInfo& info = *response->mutable_session();
    info.set_session_id(request->session_id());
    const bool huge = request->session_id()[0] == 'a';
    info.set_num_layers(huge ? int64_t{1} << 40 : 1);
    info.set_num_heads(huge ? 4 : -4);
    info.set_num_kv_heads(4);
    info.set_key_dim(8);
    info.set_value_dim(8);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

TEST(ClientBrokenServerTest, NeitherLoopsNorSizesAnythingByItsAnswers) {
  BrokenSessionService service;
  FakeServer server(&service);
  std::unique_ptr<Client> client = Connect(server.target());
  const absl::StatusOr<v1::ListSessionsResponse> listed =
      client->ListSessions(absl::InfiniteDuration());
  EXPECT_EQ(listed.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(listed.status().message()),
              HasSubstr("pages do not end"));
  for (const char first : {'a', 'b'}) {
    const absl::StatusOr<Session> session =
        Session::Attach(client.get(), std::string(32, first), kTimeout);
    EXPECT_EQ(session.status().code(), absl::StatusCode::kInternal);
    EXPECT_THAT(std::string(session.status().message()),
                HasSubstr("expected each 1 to 65536"));
  }
}

// Every way a Session or a ShardedSession is made from a server's answer
// checks it: Replicas' placement and attachment too (an answer of 2^40 layers
// aborted the client there), and the id must be the one asked for.
TEST(ClientBrokenServerTest, SessionsCheckEveryAnswerTheyAreMadeFrom) {
  BrokenSessionService service;
  FakeServer server(&service);
  absl::StatusOr<std::unique_ptr<Replicas>> replicas =
      Replicas::Connect(server.target());
  ASSERT_TRUE(replicas.ok()) << replicas.status();
  v1::CreateSessionRequest create;
  create.set_num_layers(1);
  create.set_num_heads(1);
  create.set_key_dim(8);
  create.set_session_id(BrokenSessionService::kHugeId);
  absl::StatusOr<Session> placed = (*replicas)->CreateSession(create, kTimeout);
  EXPECT_EQ(placed.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(placed.status().message()),
              HasSubstr("expected each 1 to 65536"));
  const std::string address = (*replicas)->addresses().at(0);
  absl::StatusOr<Session> attached = (*replicas)->AttachSession(
      address, BrokenSessionService::kHugeId, kTimeout);
  EXPECT_EQ(attached.status().code(), absl::StatusCode::kInternal);
  create.set_session_id(BrokenSessionService::kOtherId);
  placed = (*replicas)->CreateSession(create, kTimeout);
  EXPECT_EQ(placed.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(placed.status().message()),
              HasSubstr("with session eeee"));

  std::unique_ptr<Client> client = Connect(server.target());
  absl::StatusOr<Session> created =
      Session::Create(client.get(), create, kTimeout);
  EXPECT_EQ(created.status().code(), absl::StatusCode::kInternal);
  create.clear_session_id();  // The server's own id: any.
  created = Session::Create(client.get(), create, kTimeout);
  ASSERT_TRUE(created.ok()) << created.status();
  const absl::Status truncated = created->Truncate(0, kTimeout);
  EXPECT_EQ(truncated.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(truncated.message()),
              HasSubstr("answered a call on session ffff"));
  EXPECT_EQ(created->id(), std::string(32, 'f'));

  // A step with a query answered without an output.
  create.set_max_tokens(16);
  absl::StatusOr<ShardedSession> sharded =
      ShardedSession::Create(replicas->get(), create, 8, kTimeout);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  StepInputs inputs;
  inputs.layer = 0;
  inputs.key = MakeFloat32Tensor({1, 2, 8}, RandomValues(16, 1));
  inputs.value = MakeFloat32Tensor({1, 2, 8}, RandomValues(16, 2));
  inputs.query = MakeFloat32Tensor({1, 1, 8}, RandomValues(8, 3));
  const absl::StatusOr<StepOutput> stepped =
      sharded->Step(std::move(inputs), kTimeout);
  EXPECT_EQ(stepped.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(stepped.status().message()),
              HasSubstr("without an output"));
}

TEST(ClientWaitForReadyTest, CallsWaitForAServerThatStartsLate) {
  const int port = FreeLoopbackPort();
  ASSERT_GT(port, 0);
  const std::string target = absl::StrCat("127.0.0.1:", port);
  // Without it a call fails at once while nothing listens...
  const absl::Time start = absl::Now();
  EXPECT_EQ(
      Connect(target)->Attend(v1::AttendRequest(), kTimeout).status().code(),
      absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // ... with it the call waits until the server comes, within its deadline.
  ClientOptions options;
  options.wait_for_ready = true;
  std::unique_ptr<Client> client = Connect(target, options);
  absl::StatusOr<v1::AttendResponse> response;
  std::thread call(
      [&] { response = client->Attend(v1::AttendRequest(), kTimeout); });
  absl::SleepFor(absl::Milliseconds(300));
  FakeAttentionService service({});
  FakeServer server(&service, grpc::InsecureServerCredentials(), port);
  ASSERT_EQ(server.port, port);
  call.join();
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(service.calls(), 1u);
  // ... and an unreachable server shows as the deadline passing.
  ClientOptions unreachable;
  unreachable.wait_for_ready = true;
  EXPECT_EQ(Connect(absl::StrCat("127.0.0.1:", FreeLoopbackPort()), unreachable)
                ->Attend(v1::AttendRequest(), absl::Milliseconds(300))
                .status()
                .code(),
            absl::StatusCode::kDeadlineExceeded);
}

// A blocking call's CANCELLED is the server's (gRPC's shutdown, a drain past
// its 30 s): retried, unless the policy says not.
TEST(ClientRetryTest, RetriesACancellationFromTheServer) {
  for (const bool retried : {true, false}) {
    SCOPED_TRACE(retried ? "retried" : "not retried");
    FakeAttentionService service({grpc::StatusCode::CANCELLED});
    FakeServer server(&service);
    ClientOptions options;
    options.retry.max_attempts = 3;
    options.retry.initial_backoff = absl::Milliseconds(1);
    options.retry.retry_cancelled_by_server = retried;
    const absl::Status status = Connect(server.target(), options)
                                    ->Attend(v1::AttendRequest(), kTimeout)
                                    .status();
    if (retried) {
      EXPECT_TRUE(status.ok()) << status;
      EXPECT_EQ(service.calls(), 2u);
    } else {
      EXPECT_EQ(status.code(), absl::StatusCode::kCancelled);
      EXPECT_EQ(service.calls(), 1u);
    }
  }
}

TEST(ClientRetryTest, NeverRetriesOtherCodesOrPastMaxAttempts) {
  FakeAttentionService invalid({grpc::StatusCode::INVALID_ARGUMENT});
  FakeServer invalid_server(&invalid);
  ClientOptions options;
  options.retry.max_attempts = 5;
  options.retry.initial_backoff = absl::Milliseconds(1);
  EXPECT_EQ(Connect(invalid_server.target(), options)
                ->Attend(v1::AttendRequest(), kTimeout)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(invalid.calls(), 1u);

  FakeAttentionService unavailable(
      std::vector<grpc::StatusCode>(10, grpc::StatusCode::UNAVAILABLE));
  FakeServer unavailable_server(&unavailable);
  options.retry.max_attempts = 3;
  EXPECT_EQ(Connect(unavailable_server.target(), options)
                ->Attend(v1::AttendRequest(), kTimeout)
                .status()
                .code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(unavailable.calls(), 3u);
}

// A message over a max_message_bytes limit meets it again on every attempt:
// the client's own (its request, or the answer it would receive) is never
// retried, though RESOURCE_EXHAUSTED otherwise is.
TEST(ClientRetryTest, NeverRetriesAMessageOverALimit) {
  FakeAttentionService service(
      std::vector<grpc::StatusCode>(10, grpc::StatusCode::OK));
  FakeServer server(&service);
  ClientOptions options;
  options.retry.max_attempts = 5;
  options.retry.initial_backoff = absl::Milliseconds(1);
  options.max_message_bytes = 1024;
  v1::AttendRequest large;
  *large.mutable_query() =
      MakeFloat32Tensor({1, 1, 1, 1024}, std::vector<float>(1024, 1.0f));
  int attempts = 0;
  const absl::Status status = Connect(server.target(), options)
                                  ->Attend(large, kTimeout, &attempts)
                                  .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("Sent message larger than max"));
  EXPECT_EQ(attempts, 1);
  EXPECT_EQ(service.calls(), 0u);
}

TEST(ClientRetryTest, RetriesStopAtTheDeadline) {
  FakeAttentionService service(
      std::vector<grpc::StatusCode>(100, grpc::StatusCode::UNAVAILABLE));
  FakeServer server(&service);
  ClientOptions options;
  options.retry.max_attempts = 100;
  options.retry.initial_backoff = options.retry.max_backoff =
      absl::Milliseconds(100);
  const absl::Time start = absl::Now();
  EXPECT_FALSE(Connect(server.target(), options)
                   ->Attend(v1::AttendRequest(), absl::Milliseconds(300))
                   .ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_LE(service.calls(), 7u);
}

TEST(ClientOptionsTest, SendsTheBearerTokenAndRejectsBadOptions) {
  FakeAttentionService service({});
  FakeServer server(&service);
  ClientOptions options;
  options.bearer_token = "s3cret";
  ASSERT_TRUE(Connect(server.target(), options)
                  ->Attend(v1::AttendRequest(), kTimeout)
                  .ok());
  EXPECT_THAT(service.tokens(), ::testing::ElementsAre("Bearer s3cret"));

  ClientOptions bad;
  bad.retry.max_attempts = 0;
  EXPECT_EQ(Client::Connect("localhost:1", bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Client::Connect("").status().code(),
            absl::StatusCode::kInvalidArgument);
  // gRPC's keepalive is a C int of milliseconds: an infinite time became -1.
  ClientOptions forever;
  forever.keepalive_time = absl::InfiniteDuration();
  EXPECT_THAT(
      std::string(Client::Connect("localhost:1", forever).status().message()),
      HasSubstr("keepalive_time is inf, expected 0 to"));
  ClientOptions no_timeout;
  no_timeout.keepalive_timeout = absl::ZeroDuration();
  EXPECT_EQ(Client::Connect("localhost:1", no_timeout).status().code(),
            absl::StatusCode::kInvalidArgument);
  ClientOptions off;  // No pings: the timeout is not used.
  off.keepalive_time = absl::ZeroDuration();
  off.keepalive_timeout = absl::ZeroDuration();
  EXPECT_TRUE(Client::Connect("localhost:1", off).ok());
  // A token no header can carry or no token file holds is refused without
  // being shown.
  for (const auto& [token, message] :
       {std::pair<std::string, std::string>{"s3cret\n",
                                            "byte 0x0a at offset 6"},
        {"s3cr\xc3\xa9t", "byte 0xc3 at offset 4"},
        {" s3cret", "starts or ends with a space"},
        {std::string(4097, 'x'), "4097 bytes, expected at most 4096"}}) {
    ClientOptions with_token;
    with_token.bearer_token = token;
    const absl::Status refused =
        Client::Connect("localhost:1", with_token).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_THAT(std::string(refused.message()), HasSubstr(message));
    EXPECT_THAT(std::string(refused.message()),
                ::testing::Not(HasSubstr("s3cr")));
  }
}

std::shared_ptr<grpc::ServerCredentials> ServerTls(
    const TestCertificates& certs, bool require_client_certificate) {
  grpc::SslServerCredentialsOptions ssl(
      require_client_certificate
          ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
          : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  ssl.pem_root_certs = certs.ca;
  ssl.pem_key_cert_pairs.push_back({certs.server_key, certs.server_cert});
  return grpc::SslServerCredentials(ssl);
}

TEST(ClientTlsTest, TlsAndMutualTls) {
  const std::optional<TestCertificates> certs = MakeCertificates();
  ASSERT_TRUE(certs.has_value()) << "openssl could not make test certificates";
  FakeAttentionService service({});
  {
    FakeServer tls_server(&service, ServerTls(*certs, false));
    ClientOptions tls;
    tls.tls = TlsOptions{certs->ca, "", "", ""};
    EXPECT_TRUE(Connect(tls_server.target(), tls)
                    ->Attend(v1::AttendRequest(), kTimeout)
                    .ok());
    // A plaintext client cannot talk to a TLS server.
    EXPECT_EQ(Connect(tls_server.target())
                  ->Attend(v1::AttendRequest(), absl::Seconds(5))
                  .status()
                  .code(),
              absl::StatusCode::kUnavailable);
  }
  {
    FakeServer mtls_server(&service, ServerTls(*certs, true));
    ClientOptions without_certificate;
    without_certificate.tls = TlsOptions{certs->ca, "", "", ""};
    EXPECT_FALSE(Connect(mtls_server.target(), without_certificate)
                     ->Attend(v1::AttendRequest(), absl::Seconds(5))
                     .ok());
    ClientOptions with_certificate;
    with_certificate.tls =
        TlsOptions{certs->ca, certs->client_cert, certs->client_key, ""};
    EXPECT_TRUE(Connect(mtls_server.target(), with_certificate)
                    ->Attend(v1::AttendRequest(), kTimeout)
                    .ok());
  }
  // A key pair gRPC would take, then fail every handshake with as
  // UNAVAILABLE naming neither: refused at Connect (until 2026-12-07 not).
  for (const auto& [cert, key, why] :
       {std::tuple{certs->client_cert, certs->other_key,
                   "tls.client_private_key does not match "
                   "tls.client_certificate"},
        {certs->client_cert, std::string("-----BEGIN PRIVATE KEY-----\n"),
         "tls.client_private_key holds no unencrypted PEM private key"},
        {certs->client_key, certs->client_key,
         "tls.client_certificate holds no PEM certificate"}}) {
    ClientOptions options;
    options.tls = TlsOptions{certs->ca, cert, key, ""};
    const absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect("127.0.0.1:1", options);
    EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(client.status().message()), HasSubstr(why));
  }
}

class ClientServerTest : public ::attnserve::testing::ServerFixture {};

// The server's certificate (PEM) as a new TLS connection to `target` sees it,
// with `client_cert` and `client_key` presented; "" if the call failed.
std::string ServedCertificate(const std::string& target,
                              const TestCertificates& certs,
                              const std::string& client_cert,
                              const std::string& client_key) {
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = certs.ca;
  ssl.pem_cert_chain = client_cert;
  ssl.pem_private_key = client_key;
  // A channel of its own, with its own subchannel: a new handshake.
  grpc::ChannelArguments arguments;
  arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  const std::unique_ptr<v1::AttentionService::Stub> stub =
      v1::AttentionService::NewStub(grpc::CreateCustomChannel(
          target, grpc::SslCredentials(ssl), arguments));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::ListWeightsResponse response;
  if (!stub->ListWeights(&context, v1::ListWeightsRequest(), &response).ok()) {
    return "";
  }
  const std::vector<grpc::string_ref> pem =
      context.auth_context()->FindPropertyValues(
          GRPC_X509_PEM_CERT_PROPERTY_NAME);
  return pem.empty() ? "" : std::string(pem.front().data(), pem.front().size());
}

void WriteFile(const std::string& path, const std::string& text) {
  const std::string temporary = path + ".new";
  std::ofstream(temporary) << text;
  std::filesystem::rename(temporary, path);
}

// Writes `certs`' server pair and CA bundle into the folder `name` of theirs,
// and sets `options` to serve them, reading them again every `reload` (and
// to serve metrics). Returns the folder.
std::string ServeTlsFiles(const TestCertificates& certs,
                          const std::string& name, absl::Duration reload,
                          ServerOptions* options) {
  const std::string dir = certs.directory + "/" + name;
  std::filesystem::create_directories(dir);
  WriteFile(dir + "/tls.crt", certs.server_cert);
  WriteFile(dir + "/tls.key", certs.server_key);
  WriteFile(dir + "/ca.crt", certs.ca);
  options->metrics_port = 0;
  options->tls = {dir + "/tls.crt", dir + "/tls.key", dir + "/ca.crt", reload};
  return dir;
}

// Certificates renewed in place (cert-manager, a SPIFFE agent) are served to
// new connections within --tls_reload_seconds, without a restart (which ends
// every session): the server's own certificate and key, and the client CA
// bundle. Files that fail a check (a key with another's certificate, as
// between two writes; garbage) are not served: the last good set stays, and
// each refusal is counted. Until 2026-12-07 the files were read once.
TEST_F(ClientServerTest, RenewedCertificatesAreServedWithoutARestart) {
  const std::optional<TestCertificates> certs = MakeCertificates();
  ASSERT_TRUE(certs.has_value()) << "openssl could not make test certificates";
  ServerOptions options = DefaultOptions();
  const std::string dir =
      ServeTlsFiles(*certs, "served", absl::Seconds(1), &options);
  client_.reset();
  server_.reset();
  StartServer(options);
  const std::string target = absl::StrCat("127.0.0.1:", server_->port());
  const auto served = [&](const std::string& cert, const std::string& key) {
    return ServedCertificate(target, *certs, cert, key);
  };
  // Waits up to 10 s for `wanted` to be what new connections get.
  const auto eventually = [&](const std::string& wanted,
                              const std::string& cert, const std::string& key) {
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    std::string got = served(cert, key);
    while (got != wanted && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(200));
      got = served(cert, key);
    }
    return got;
  };
  EXPECT_EQ(served(certs->client_cert, certs->client_key), certs->server_cert);
  // The impostor's CA is not trusted yet.
  EXPECT_EQ(served(certs->impostor_cert, certs->impostor_key), "");

  // A key whose certificate has not been written yet: refused, the old pair
  // stays served.
  WriteFile(dir + "/tls.key", certs->reissued_key);
  absl::SleepFor(absl::Milliseconds(2500));
  EXPECT_EQ(served(certs->client_cert, certs->client_key), certs->server_cert);
  // Then its certificate: the new pair is served.
  WriteFile(dir + "/tls.crt", certs->reissued_cert);
  EXPECT_EQ(
      eventually(certs->reissued_cert, certs->client_cert, certs->client_key),
      certs->reissued_cert);
  // Garbage in place of the certificate: not served.
  WriteFile(dir + "/tls.crt", "-----BEGIN CERTIFICATE-----\nbm90\n");
  absl::SleepFor(absl::Milliseconds(2500));
  EXPECT_EQ(served(certs->client_cert, certs->client_key),
            certs->reissued_cert);
  WriteFile(dir + "/tls.crt", certs->reissued_cert);
  // A second CA in the client bundle: its clients are let in.
  WriteFile(dir + "/ca.crt", certs->ca + certs->second_ca);
  EXPECT_EQ(eventually(certs->reissued_cert, certs->impostor_cert,
                       certs->impostor_key),
            certs->reissued_cert);
  // A pair that parses and matches but that OpenSSL will not serve (an
  // RSA-1024 key), and one valid only from 2100: neither replaces the one
  // served (until 2026-12-07 both did, and every handshake failed after).
  for (const auto& [cert, key] : {std::pair{certs->weak_cert, certs->weak_key},
                                  {certs->future_cert, certs->future_key}}) {
    WriteFile(dir + "/tls.key", key);
    WriteFile(dir + "/tls.crt", cert);
    absl::SleepFor(absl::Milliseconds(2500));
    EXPECT_EQ(served(certs->client_cert, certs->client_key),
              certs->reissued_cert);
  }
  const std::map<std::string, double> samples = ::attnserve::testing::Samples(
      ::attnserve::testing::Scrape(server_->metrics_port()));
  EXPECT_EQ(samples.at("attnserve_tls_reloads_total{result=\"replaced\"}"), 2);
  EXPECT_GE(samples.at("attnserve_tls_reloads_total{result=\"refused\"}"), 4);
  EXPECT_GT(samples.at("attnserve_tls_certificate_expiry_timestamp_seconds"),
            absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
}

// A pair rewritten in place, the key first, may be read between the two
// writes: the refused read is tried again a second later, not an interval
// later, so the renewed pair is served about a second after its last write.
// Until 2026-12-07 it waited for the next interval (here 6 s).
TEST_F(ClientServerTest,
       PairCaughtHalfWrittenIsServedASecondAfterItsLastWrite) {
  const std::optional<TestCertificates> certs = MakeCertificates();
  ASSERT_TRUE(certs.has_value()) << "openssl could not make test certificates";
  ServerOptions options = DefaultOptions();
  const std::string dir =
      ServeTlsFiles(*certs, "half", absl::Seconds(6), &options);
  client_.reset();
  server_.reset();
  StartServer(options);
  const std::string target = absl::StrCat("127.0.0.1:", server_->port());
  const auto refused = [&] {
    const std::map<std::string, double> samples = ::attnserve::testing::Samples(
        ::attnserve::testing::Scrape(server_->metrics_port()));
    return samples.at("attnserve_tls_reloads_total{result=\"refused\"}");
  };
  // The key alone: the next reload refuses it. The certificate is written as
  // soon as that refusal shows, before the read a second later; a trial
  // where the poll saw the refusal too late to tell is tried once more, with
  // the other pair.
  const std::pair<std::string, std::string> pairs[] = {
      {certs->reissued_cert, certs->reissued_key},
      {certs->server_cert, certs->server_key}};
  bool judged = false;
  for (const auto& [cert, key] : pairs) {
    const double before = refused();
    WriteFile(dir + "/tls.key", key);
    const absl::Time give_up = absl::Now() + absl::Seconds(15);
    while (refused() == before && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    ASSERT_EQ(refused(), before + 1) << "no reload refused the lone key";
    WriteFile(dir + "/tls.crt", cert);
    const absl::Time written = absl::Now();
    if (refused() != before + 1) continue;  // The second read came first.
    std::string got;
    while (absl::Now() < written + absl::Seconds(4)) {
      got = ServedCertificate(target, *certs, certs->client_cert,
                              certs->client_key);
      if (got == cert) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    EXPECT_EQ(got, cert) << "the renewed pair was not served within 4 s of "
                            "its last write (the reload interval is 6 s)";
    judged = true;
    break;
  }
  EXPECT_TRUE(judged) << "both trials saw the refusal too late to judge";
}

v1::AttendRequest RandomRequest(int64_t b, int64_t h, int64_t hkv, int64_t lq,
                                int64_t lk, int64_t dk, int64_t dv,
                                uint64_t seed) {
  v1::AttendRequest request;
  *request.mutable_query() =
      MakeFloat32Tensor({b, h, lq, dk}, RandomValues(b * h * lq * dk, seed));
  *request.mutable_key() = MakeFloat32Tensor(
      {b, hkv, lk, dk}, RandomValues(b * hkv * lk * dk, seed + 1));
  *request.mutable_value() = MakeFloat32Tensor(
      {b, hkv, lk, dv}, RandomValues(b * hkv * lk * dv, seed + 2));
  return request;
}

void ExpectClose(const v1::Tensor& actual, const v1::Tensor& expected,
                 double tolerance) {
  const std::vector<float> a = FloatValues(actual).value();
  const std::vector<float> e = FloatValues(expected).value();
  ASSERT_EQ(a.size(), e.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(e[i])) {
      ASSERT_EQ(a[i], e[i]) << i;
    } else {
      ASSERT_NEAR(a[i], e[i], tolerance) << i;
    }
  }
}

// A refusal for one of the server's limits on a request's own size comes with
// the trailer grpc-retry-pushback-ms: -1 (gRPC's "do not retry"), and the
// client sends such a call once whatever its retry policy: until 2026-12-07
// it sent it max_attempts times, each refused the same way.
TEST_F(ClientServerTest, ARefusalTheSameCallWouldMeetAgainIsSentOnce) {
  ServerOptions options = DefaultOptions();
  options.limits.max_elements = 1000;
  client_.reset();
  server_.reset();
  StartServer(options);
  const std::string target = absl::StrCat("127.0.0.1:", server_->port());
  v1::AttendRequest request;
  const std::vector<float> values(2048, 0.5f);
  *request.mutable_query() = MakeFloat32Tensor({1, 1, 4, 512}, values);
  *request.mutable_key() = MakeFloat32Tensor({1, 1, 4, 512}, values);
  *request.mutable_value() = MakeFloat32Tensor({1, 1, 4, 512}, values);
  ClientOptions client_options;
  client_options.retry.max_attempts = 5;
  client_options.retry.initial_backoff = absl::Milliseconds(1);
  ASSERT_TRUE(client_options.retry.retry_resource_exhausted);
  int attempts = 0;
  const absl::Status status = Connect(target, client_options)
                                  ->Attend(request, kTimeout, &attempts)
                                  .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("over the max_elements limit of 1000"));
  EXPECT_EQ(attempts, 1);

  // What any gRPC client sees: the trailer, and only on such a refusal.
  const std::unique_ptr<v1::AttentionService::Stub> stub =
      v1::AttentionService::NewStub(
          grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  const auto pushback = [&](const v1::AttendRequest& sent) {
    grpc::ClientContext context;
    v1::AttendResponse response;
    (void)stub->Attend(&context, sent, &response);
    const auto& trailers = context.GetServerTrailingMetadata();
    const auto found = trailers.find("grpc-retry-pushback-ms");
    return found == trailers.end()
               ? std::string("none")
               : std::string(found->second.data(), found->second.size());
  };
  EXPECT_EQ(pushback(request), "-1");
  v1::AttendRequest small;
  *small.mutable_query() = MakeFloat32Tensor({1, 1, 1, 4}, {1, 2, 3, 4});
  *small.mutable_key() = MakeFloat32Tensor({1, 1, 1, 4}, {1, 2, 3, 4});
  *small.mutable_value() = MakeFloat32Tensor({1, 1, 1, 4}, {1, 2, 3, 4});
  EXPECT_EQ(pushback(small), "none");
  v1::AttendRequest bad = small;
  bad.mutable_key()->mutable_shape()->Set(3, 8);
  EXPECT_EQ(pushback(bad), "none");  // INVALID_ARGUMENT: no retry anyway.
}

// What the client cuts itself is checked first, as the server would check it
// whole (an audit found both answered before 2026-12-07): a value shorter
// than the key along Lk (read past its end: std::out_of_range, the process
// ended), or longer (cut silently); an output dtype the shards never see
// (answered OK, its bytes f16 under the dtype's name).
TEST_F(ClientServerTest, ShardedAttendRefusesWhatItWouldCutWrong) {
  std::vector<Client*> replicas = {client_.get(), client_.get()};
  for (const int64_t value_len : {3, 5}) {
    v1::AttendRequest request = RandomRequest(1, 2, 1, 2, 4, 8, 8, 60);
    *request.mutable_value() = MakeFloat32Tensor(
        {1, 1, value_len, 8}, RandomValues(value_len * 8, 61));
    const absl::Status refused =
        ShardedAttend(replicas, request, 2, kTimeout).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_THAT(std::string(refused.message()),
                HasSubstr(absl::StrCat("value.shape[2] is ", value_len,
                                       ", expected 4 (key.shape[2])")));
  }
  v1::AttendRequest request = RandomRequest(1, 2, 1, 2, 4, 8, 8, 62);
  request.mutable_options()->set_output_dtype(v1::BOOL);
  const absl::Status refused =
      ShardedAttend(replicas, request, 2, kTimeout).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr("options.output_dtype is BOOL, expected FLOAT32, "
                        "BFLOAT16 or FLOAT16"));
  // A key length one call refuses is refused, not clipped per shard (a
  // negative one made every row 0 until 2026-12-07).
  for (const int64_t length : {-3, 5}) {
    v1::AttendRequest bad = RandomRequest(1, 2, 1, 2, 4, 8, 8, 63);
    bad.mutable_options()->add_key_lengths(length);
    const absl::Status status =
        ShardedAttend(replicas, bad, 2, kTimeout).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()),
                HasSubstr(absl::StrCat("options.key_lengths[0] is ", length,
                                       ", expected 0 to 4 (Lk)")));
  }
}

// Finish without CloseSend tells the server no more requests come, and ends
// once the answers are in: it waited for the stream's deadline until
// 2026-12-07 (an audit found), the server waiting for more requests.
TEST_F(ClientServerTest, FinishWithoutCloseSendEndsOnceAnswered) {
  std::unique_ptr<AttendSession> session =
      client_->OpenAttendSession(absl::Seconds(5));
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(session->Send(RandomRequest(1, 2, 1, 2, 4, 8, 8, 70 + i)).ok());
  }
  EXPECT_TRUE(session->Finish().ok());
  EXPECT_EQ(session->Send(RandomRequest(1, 2, 1, 2, 4, 8, 8, 72)).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(ClientServerTest, ShardedAttentionMergesExactly) {
  struct Case {
    const char* name;
    void (*options)(v1::AttendRequest&);
  };
  const Case cases[] = {
      {"Plain", [](v1::AttendRequest&) {}},
      {"CausalTopLeft",
       [](v1::AttendRequest& r) { r.mutable_options()->set_causal(true); }},
      {"CausalBottomRightWithKeyLengths",
       [](v1::AttendRequest& r) {
         r.mutable_options()->set_causal(true);
         r.mutable_options()->set_causal_alignment(
             v1::AttentionOptions::BOTTOM_RIGHT);
         r.mutable_options()->add_key_lengths(23);
         r.mutable_options()->add_key_lengths(4);
       }},
      {"BoolMask",
       [](v1::AttendRequest& r) {
         std::vector<bool> allowed;
         for (float v : RandomValues(9 * 23, 5)) allowed.push_back(v > -0.5f);
         *r.mutable_options()->mutable_attn_mask() =
             MakeBoolTensor({9, 23}, allowed);
       }},
      {"FloatMaskAndCausal",
       [](v1::AttendRequest& r) {
         *r.mutable_options()->mutable_attn_mask() =
             MakeFloat32Tensor({2, 1, 1, 23}, RandomValues(46, 6));
         r.mutable_options()->set_causal(true);
       }},
      {"softcap, which every shard applies alike",
       [](v1::AttendRequest& r) {
         r.mutable_options()->set_softcap(1.5f);
         r.mutable_options()->set_causal(true);
       }},
  };
  std::vector<Client*> replicas = {client_.get(), client_.get()};
  for (const Case& test_case : cases) {
    SCOPED_TRACE(test_case.name);
    v1::AttendRequest request = RandomRequest(2, 4, 2, 9, 23, 16, 8, 40);
    test_case.options(request);
    request.mutable_options()->set_return_lse(true);
    absl::StatusOr<v1::AttendResponse> single =
        client_->Attend(request, kTimeout);
    ASSERT_TRUE(single.ok()) << single.status();
    for (int shards : {1, 2, 5}) {
      SCOPED_TRACE(absl::StrCat(shards, " shards"));
      absl::StatusOr<v1::AttendResponse> merged =
          ShardedAttend(replicas, request, shards, kTimeout);
      ASSERT_TRUE(merged.ok()) << merged.status();
      ExpectClose(merged->output(), single->output(), 2e-6);
      ExpectClose(merged->lse(), single->lse(), 2e-5);
    }
  }
  v1::AttendRequest weights = RandomRequest(1, 1, 1, 2, 4, 4, 4, 50);
  weights.mutable_options()->set_return_weights(v1::AttentionOptions::PER_HEAD);
  EXPECT_EQ(ShardedAttend(replicas, weights, 2, kTimeout).status().code(),
            absl::StatusCode::kInvalidArgument);
  // What depends on a key's global position is refused, not drawn wrong.
  for (const auto& set :
       std::vector<std::function<void(v1::AttentionOptions&)>>{
           [](v1::AttentionOptions& o) { o.set_window_left(3); },
           [](v1::AttentionOptions& o) { o.set_window_right(0); },
           [](v1::AttentionOptions& o) { o.set_num_sink_tokens(2); },
           [](v1::AttentionOptions& o) {
             *o.mutable_alibi_slopes() = MakeFloat32Tensor({1}, {0.5f});
           }}) {
    v1::AttendRequest positional = RandomRequest(1, 1, 1, 2, 4, 4, 4, 51);
    set(*positional.mutable_options());
    const absl::Status refused =
        ShardedAttend(replicas, positional, 2, kTimeout).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(refused.message()),
                HasSubstr("must be unset for sharded attention"));
  }
  EXPECT_EQ(ShardedAttend(replicas, RandomRequest(1, 1, 1, 2, 4, 4, 4, 50), 5,
                          kTimeout)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // A mask or key_lengths the client would cut per shard is checked first:
  // causal, so that the client reads the mask itself.
  for (const auto& set :
       std::vector<std::function<void(v1::AttentionOptions&)>>{
           [](v1::AttentionOptions& o) {  // H 3 against the query's 2.
             *o.mutable_attn_mask() =
                 MakeBoolTensor({1, 3, 3, 4}, std::vector<bool>(36, true));
           },
           [](v1::AttentionOptions& o) {  // 8 bytes for [64, 64].
             *o.mutable_attn_mask() = MakeFloat32Tensor({2}, {0.0f, 0.0f});
             o.mutable_attn_mask()->set_shape(0, 64);
             o.mutable_attn_mask()->add_shape(64);
           },
           [](v1::AttentionOptions& o) { o.add_key_lengths(4); }}) {
    v1::AttendRequest bad = RandomRequest(1, 2, 2, 3, 4, 4, 4, 52);
    bad.mutable_options()->set_causal(true);
    bad.mutable_options()->clear_key_lengths();
    set(*bad.mutable_options());
    if (bad.options().key_lengths_size() == 1) {
      bad.mutable_options()->add_key_lengths(4);  // 2 for B = 1.
    }
    const absl::Status refused =
        ShardedAttend(replicas, bad, 2, kTimeout).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument)
        << refused.message();
  }
  // Dimensions whose product passes 2^63 (and wraps to the empty data's 0
  // bytes) are refused, as is a shard whose request (with the causal mask
  // the client builds) would pass the client's max_message_bytes: nothing
  // that large is built.
  v1::AttendRequest wrapping = RandomRequest(1, 1, 1, 1, 4, 4, 4, 53);
  wrapping.mutable_query()->set_shape(0, int64_t{1} << 62);
  wrapping.mutable_query()->set_shape(1, 4);
  wrapping.mutable_query()->set_shape(3, 1);
  wrapping.mutable_query()->clear_data();
  EXPECT_EQ(ShardedAttend(replicas, wrapping, 2, kTimeout).status().code(),
            absl::StatusCode::kInvalidArgument);
  v1::AttendRequest wide = RandomRequest(1, 1, 1, 8192, 8192, 1, 1, 54);
  *wide.mutable_options()->mutable_attn_mask() =
      MakeFloat32Tensor({8192}, std::vector<float>(8192, 0.0f));
  wide.mutable_options()->set_causal(true);
  const absl::Status too_wide =
      ShardedAttend(replicas, wide, 2, kTimeout).status();
  EXPECT_EQ(too_wide.code(), absl::StatusCode::kInvalidArgument) << too_wide;
  EXPECT_THAT(std::string(too_wide.message()),
              HasSubstr("over the client's max_message_bytes"));
}

// A NaN query row is NaN in the merged answer, output and lse, as in one
// call over every key, not a row that saw no key.
TEST_F(ClientServerTest, ShardedAttendKeepsANanRowNan) {
  v1::AttendRequest request = RandomRequest(1, 1, 1, 3, 8, 4, 4, 55);
  std::vector<float> query = FloatValues(request.query()).value();
  query[4] = std::nanf("");  // Row 1.
  *request.mutable_query() = MakeFloat32Tensor({1, 1, 3, 4}, query);
  request.mutable_options()->set_return_lse(true);
  std::vector<Client*> replicas = {client_.get(), client_.get()};
  const absl::StatusOr<v1::AttendResponse> merged =
      ShardedAttend(replicas, request, 2, kTimeout);
  ASSERT_TRUE(merged.ok()) << merged.status();
  const std::vector<float> output = FloatValues(merged->output()).value();
  const std::vector<float> lse = FloatValues(merged->lse()).value();
  for (int64_t v = 0; v < 4; ++v) {
    EXPECT_TRUE(std::isnan(output[4 + v])) << v;
    EXPECT_FALSE(std::isnan(output[v])) << v;
  }
  EXPECT_TRUE(std::isnan(lse[1]));
  EXPECT_TRUE(std::isfinite(lse[0]));
}

TEST_F(ClientServerTest, AsyncAndFutureCallsMatchSyncOnes) {
  const v1::AttendRequest request = RandomRequest(1, 2, 2, 5, 7, 8, 8, 60);
  absl::StatusOr<v1::AttendResponse> sync = client_->Attend(request, kTimeout);
  ASSERT_TRUE(sync.ok());
  absl::StatusOr<v1::AttendResponse> future =
      client_->AttendFuture(request, kTimeout).get();
  ASSERT_TRUE(future.ok()) << future.status();
  ExpectClose(future->output(), sync->output(), 0);

  std::promise<absl::StatusOr<v1::MultiHeadAttentionResponse>> done;
  v1::MultiHeadAttentionRequest mha;
  *mha.mutable_query_input() =
      MakeFloat32Tensor({1, 3, 64}, RandomValues(192, 61));
  mha.set_weights_name("demo");
  client_->MultiHeadAttentionAsync(
      mha, kTimeout,
      [&done](absl::StatusOr<v1::MultiHeadAttentionResponse> result) {
        done.set_value(std::move(result));
      });
  absl::StatusOr<v1::MultiHeadAttentionResponse> async =
      done.get_future().get();
  ASSERT_TRUE(async.ok()) << async.status();
  EXPECT_EQ(async->output().shape_size(), 3);
}

TEST_F(ClientServerTest, DeadlineCutsALongCallShort) {
  ServerOptions options = DefaultOptions();
  options.transport.max_message_bytes = 64 << 20;
  options.engine.max_workspace_bytes = 1 << 30;
  StartServer(options);
  const v1::AttendRequest large =
      RandomRequest(1, 16, 16, 1024, 1024, 64, 64, 70);
  const absl::Time start = absl::Now();
  EXPECT_EQ(client_->Attend(large, absl::Milliseconds(3)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

// gRPC shuts down its callback threads when the last channel using them goes;
// if that happens on one of those threads (a call's context holding the last
// reference to the channel), gRPC 1.51 frees its queue twice. A client
// destroyed right after its future resolves must not do that (under ASan the
// old client failed this within a few rounds).
TEST_F(ClientServerTest, AsyncCallsLetGoOfTheChannelBeforeTheClientGoes) {
  const v1::AttendRequest request = RandomRequest(1, 1, 1, 4, 4, 4, 4, 80);
  v1::MultiHeadAttentionRequest mha;
  *mha.mutable_query_input() =
      MakeFloat32Tensor({1, 3, 64}, RandomValues(192, 81));
  mha.set_weights_name("demo");
  for (int round = 0; round < 20; ++round) {
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(absl::StrCat("127.0.0.1:", server_->port()));
    ASSERT_TRUE(client.ok()) << client.status();
    std::promise<absl::Status> multi_head;
    (*client)->MultiHeadAttentionAsync(
        mha, kTimeout,
        [&multi_head](absl::StatusOr<v1::MultiHeadAttentionResponse> result) {
          multi_head.set_value(result.status());
        });
    EXPECT_TRUE((*client)->AttendFuture(request, kTimeout).get().ok());
    EXPECT_TRUE(multi_head.get_future().get().ok());
    client->reset();
  }
}

TEST_F(ClientServerTest, DestroyingTheClientCancelsItsCallsInFlight) {
  ServerOptions options = DefaultOptions();
  options.transport.max_message_bytes = 64 << 20;
  options.engine.max_workspace_bytes = 1 << 30;
  StartServer(options);
  auto answer = client_->AttendFuture(
      RandomRequest(1, 8, 8, 4096, 8192, 64, 64, 82), kTimeout);
  // About 0.5 s of compute: still in flight 50 ms on.
  absl::SleepFor(absl::Milliseconds(50));
  const absl::Time start = absl::Now();
  client_.reset();
  EXPECT_EQ(answer.get().status().code(), absl::StatusCode::kCancelled);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST_F(ClientServerTest, StreamAnswersInOrderAndSurvivesABadRequest) {
  std::unique_ptr<AttendSession> session = client_->OpenAttendSession(kTimeout);
  std::vector<v1::AttendRequest> requests;
  for (int i = 0; i < 40; ++i)
    requests.push_back(RandomRequest(1, 2, 1, 3, 5, 4, 4, 100 + i));
  requests[7].clear_key();  // Fails alone.
  std::thread sender([&] {
    for (const v1::AttendRequest& request : requests)
      ASSERT_TRUE(session->Send(request).ok());
    ASSERT_TRUE(session->CloseSend().ok());
  });
  for (int i = 0; i < 40; ++i) {
    absl::StatusOr<std::optional<v1::AttendStreamResponse>> answer =
        session->Receive();
    ASSERT_TRUE(answer.ok());
    ASSERT_TRUE(answer->has_value())
        << "stream ended after " << i << " answers";
    EXPECT_EQ((*answer)->index(), i);
    if (i == 7) {
      EXPECT_EQ((*answer)->error().code(),
                static_cast<int>(absl::StatusCode::kInvalidArgument));
      EXPECT_THAT((*answer)->error().message(), HasSubstr("key is missing"));
      continue;
    }
    ASSERT_EQ((*answer)->error().code(), 0) << (*answer)->error().message();
    absl::StatusOr<v1::AttendResponse> single =
        client_->Attend(requests[i], kTimeout);
    ASSERT_TRUE(single.ok());
    ExpectClose((*answer)->response().output(), single->output(), 0);
  }
  sender.join();
  absl::StatusOr<std::optional<v1::AttendStreamResponse>> end =
      session->Receive();
  ASSERT_TRUE(end.ok());
  EXPECT_FALSE(end->has_value());
  EXPECT_TRUE(session->Finish().ok());
}

// A stream that ends other than OK says so from Receive, not as a clean end:
// here its deadline passes while the client waits for an answer.
TEST_F(ClientServerTest, ReceiveReportsAStreamThatFailed) {
  std::unique_ptr<AttendSession> session =
      client_->OpenAttendSession(absl::Milliseconds(300));
  const absl::StatusOr<std::optional<v1::AttendStreamResponse>> answer =
      session->Receive();
  EXPECT_EQ(answer.status().code(), absl::StatusCode::kDeadlineExceeded)
      << answer.status();
  EXPECT_EQ(session->Receive().status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(session->Finish().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(session->Finish().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ClientServerTest, AbandonedStreamLeavesTheServerServing) {
  {
    std::unique_ptr<AttendSession> session =
        client_->OpenAttendSession(kTimeout);
    for (int i = 0; i < 5; ++i) {
      ASSERT_TRUE(
          session->Send(RandomRequest(1, 1, 1, 2, 2, 2, 2, 200 + i)).ok());
    }
  }  // Destroyed unfinished: cancels the call.
  EXPECT_TRUE(
      client_->Attend(RandomRequest(1, 1, 1, 2, 2, 2, 2, 300), kTimeout).ok());
}

TEST(ReadFloatsIntoTest, ChecksShapeAndSize) {
  const v1::Tensor tensor = MakeTensor(v1::FLOAT16, {2, 3}, {1, 2, 3, 4, 5, 6});
  std::vector<float> out(6);
  ASSERT_TRUE(ReadFloatsInto(tensor, {2, 3}, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out[5], 6.0f);
  EXPECT_THAT(
      std::string(
          ReadFloatsInto(tensor, {3, 2}, absl::MakeSpan(out)).message()),
      HasSubstr("tensor.shape is [2, 3], expected [3, 2]"));
  std::vector<float> small(5);
  EXPECT_FALSE(ReadFloatsInto(tensor, {2, 3}, absl::MakeSpan(small)).ok());
}

// Replicas resolves each form of target to its addresses, one Client each.
TEST(ReplicasTargetTest, TargetsResolveToTheirAddresses) {
  absl::StatusOr<std::unique_ptr<Replicas>> two =
      Replicas::Connect("ipv4:127.0.0.2:7002,127.0.0.1:7001");
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_THAT((*two)->addresses(),
              ::testing::ElementsAre("127.0.0.1:7001", "127.0.0.2:7002"));
  EXPECT_NE((*two)->client("127.0.0.1:7001"), nullptr);
  EXPECT_EQ((*two)->client("127.0.0.1:7003"), nullptr);
  absl::StatusOr<std::unique_ptr<Replicas>> v6 =
      Replicas::Connect("ipv6:[::1]:7004");
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_THAT((*v6)->addresses(), ::testing::ElementsAre("[::1]:7004"));
  // A name is resolved by the library, to every address it has.
  for (const char* target : {"dns:///localhost:7005", "localhost:7005"}) {
    absl::StatusOr<std::unique_ptr<Replicas>> named = Replicas::Connect(target);
    ASSERT_TRUE(named.ok()) << target << ": " << named.status();
    ASSERT_FALSE((*named)->addresses().empty());
    for (const std::string& address : (*named)->addresses()) {
      EXPECT_TRUE(address == "127.0.0.1:7005" || address == "[::1]:7005")
          << address;
    }
  }
  for (const char* bad : {"", "ipv4:127.0.0.1", "ipv4:127.0.0.1:0", "localhost",
                          "dns:///localhost:http"}) {
    EXPECT_EQ(Replicas::Connect(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(
      Replicas::Connect("dns:///no-such-host.invalid:7006").status().code(),
      absl::StatusCode::kUnavailable);
}

// The rendezvous weight is the same number in every client (the Python
// package computes it too), and the ranking it gives moves only the keys of
// a replica that comes or goes.
TEST(ReplicasTargetTest, RendezvousPlacementMovesOnlyWhatItMust) {
  EXPECT_EQ(
      RendezvousWeight("127.0.0.1:50051", "00112233445566778899aabbccddeeff"),
      18300100417772493994ULL);
  const auto first = [](const std::vector<std::string>& addresses,
                        const std::string& key) {
    std::string best;
    uint64_t top = 0;
    for (const std::string& address : addresses) {
      const uint64_t weight = RendezvousWeight(address, key);
      if (best.empty() || weight > top) {
        best = address;
        top = weight;
      }
    }
    return best;
  };
  const std::vector<std::string> five = {"10.0.0.1:50051", "10.0.0.2:50051",
                                         "10.0.0.3:50051", "10.0.0.4:50051",
                                         "10.0.0.5:50051"};
  std::vector<std::string> four = five;
  four.erase(four.begin() + 2);
  std::vector<std::string> six = five;
  six.push_back("10.0.0.6:50051");
  std::map<std::string, int> load;
  int moved_by_removal = 0, moved_by_addition = 0;
  constexpr int kKeys = 3000;
  for (int i = 0; i < kKeys; ++i) {
    const std::string key = RandomSessionId();
    ASSERT_EQ(key.size(), 32u);
    const std::string home = first(five, key);
    ++load[home];
    const std::string without = first(four, key);
    if (without != home) {
      ++moved_by_removal;
      EXPECT_EQ(home, "10.0.0.3:50051")
          << "only the removed replica's keys move";
    }
    const std::string with = first(six, key);
    if (with != home) {
      ++moved_by_addition;
      EXPECT_EQ(with, "10.0.0.6:50051") << "keys move only to the new replica";
    }
  }
  EXPECT_EQ(moved_by_removal, load["10.0.0.3:50051"]);
  for (const auto& [address, keys] : load) {
    EXPECT_GT(keys, kKeys / 5 * 0.8) << address;
    EXPECT_LT(keys, kKeys / 5 * 1.2) << address;
  }
  EXPECT_GT(moved_by_addition, kKeys / 6 * 0.8);
  EXPECT_LT(moved_by_addition, kKeys / 6 * 1.2);
  EXPECT_FALSE(IsReplicaGone(absl::AbortedError("another abort")));
}

}  // namespace
}  // namespace attnserve
