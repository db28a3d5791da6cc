#include "attnserve/client/client.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <memory>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnserve/common/bearer_tokens.h"
#include "attnserve/common/pem.h"
#include "attnserve/common/refusals.h"
#include "attnserve/common/status_macros.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc_status.h"
#include "grpcpp/grpcpp.h"

namespace attnserve {

namespace {

// gRPC notices that a connection attempt succeeded only when something polls
// its socket. Calls that fail fast (not wait_for_ready) leave nothing polling
// between them but gRPC's backup poller, every 5 s by default: a replica
// restarted at its address stayed unreachable 4-16 s after it listened, each
// attempt cut off unnoticed at its deadline. The poller runs every 100 ms
// instead (a poll that finds nothing costs microseconds), unless the
// environment says otherwise. gRPC reads it once, when it starts, so it is set
// as the library loads, before any thread of the program's could read the
// environment.
[[maybe_unused]] const bool kBackupPollerSet = [] {
  setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "100",
         /*overwrite=*/0);
  return true;
}();

int64_t Milliseconds(absl::Duration duration) {
  return absl::ToInt64Milliseconds(duration);
}

// The client key pair as gRPC will use it. gRPC takes any bytes and fails
// each connection's handshake instead, as UNAVAILABLE ("empty address list"),
// naming neither the key nor the certificate: a network fault to the reader.
absl::Status CheckClientKeyPair(const TlsOptions& tls) {
  if (tls.client_certificate.empty()) return absl::OkStatus();
  const pem::Certificate cert = pem::FirstCertificate(tls.client_certificate);
  const pem::PrivateKey key = pem::UnencryptedKey(tls.client_private_key);
  if (cert == nullptr) {
    return absl::InvalidArgumentError(
        "tls.client_certificate holds no PEM certificate (-----BEGIN "
        "CERTIFICATE-----)");
  }
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        "tls.client_private_key holds no unencrypted PEM private key "
        "(-----BEGIN PRIVATE KEY-----; an encrypted one has no passphrase to "
        "open it)");
  }
  if (!pem::KeyMatches(cert.get(), key.get())) {
    return absl::InvalidArgumentError(
        "tls.client_private_key does not match tls.client_certificate (the "
        "first certificate of the chain must be the key's)");
  }
  return absl::OkStatus();
}

// A bearer token an authorization header can carry and a server's token file
// can hold. gRPC takes any bytes and fails every call, naming the header with
// the token in it (the Python client's raw error showed the secret, an audit
// found); a token read with its line's end matches nothing.
absl::Status CheckBearerToken(const std::string& token) {
  if (token.size() > kMaxBearerTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bearer_token is ", token.size(), " bytes, expected at most ",
        kMaxBearerTokenBytes,
        " (it goes in an HTTP header, which gRPC bounds at 8 KiB with the "
        "others)"));
  }
  for (size_t i = 0; i < token.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(token[i]);
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bearer_token holds byte 0x", absl::Hex(c, absl::kZeroPad2),
          " at offset ", i,
          ", expected printable ASCII (a token read from a file keeps its "
          "line's end: strip it)"));
    }
  }
  if (!token.empty() && (token.front() == ' ' || token.back() == ' ')) {
    return absl::InvalidArgumentError(
        "bearer_token starts or ends with a space, which no token in a "
        "server's token file does (its lines are stripped)");
  }
  return absl::OkStatus();
}

absl::Status ValidateOptions(const ClientOptions& options) {
  ATTNSERVE_RETURN_IF_ERROR(CheckBearerToken(options.bearer_token));
  if (options.max_message_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes is ", options.max_message_bytes, ", expected > 0"));
  }
  const RetryPolicy& retry = options.retry;
  if (retry.max_attempts < 1 || retry.max_attempts > 100) {
    return absl::InvalidArgumentError(absl::StrCat(
        "retry.max_attempts is ", retry.max_attempts, ", expected 1 to 100"));
  }
  if (retry.initial_backoff <= absl::ZeroDuration() ||
      retry.max_backoff < retry.initial_backoff ||
      retry.backoff_multiplier < 1.0) {
    return absl::InvalidArgumentError(
        "retry backoff must have initial_backoff > 0, max_backoff >= "
        "initial_backoff and "
        "backoff_multiplier >= 1");
  }
  // gRPC takes the two as a C int of milliseconds: an infinite or larger one
  // became -1 ms (static_cast of INT64_MAX).
  constexpr absl::Duration kMaxKeepalive =
      absl::Milliseconds(std::numeric_limits<int>::max());
  for (const auto& [name, value] :
       {std::pair{"keepalive_time", options.keepalive_time},
        {"keepalive_timeout", options.keepalive_timeout}}) {
    if (value < absl::ZeroDuration() || value > kMaxKeepalive) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " is ", absl::FormatDuration(value), ", expected 0 to ",
          absl::FormatDuration(kMaxKeepalive),
          name == std::string("keepalive_time") ? " (0: no pings)" : ""));
    }
  }
  if (options.keepalive_time > absl::ZeroDuration() &&
      options.keepalive_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "keepalive_timeout is 0 with keepalive_time set, expected how long a "
        "ping's answer may take (10s by default)");
  }
  if (options.load_balancing_policy.empty() ||
      options.load_balancing_policy.find_first_not_of(
          "abcdefghijklmnopqrstuvwxyz0123456789_") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("load_balancing_policy is \"",
                     options.load_balancing_policy.substr(0, 64),
                     "\", expected a gRPC policy name such as round_robin"));
  }
  if (options.tls && options.tls->client_certificate.empty() !=
                         options.tls->client_private_key.empty()) {
    return absl::InvalidArgumentError(
        "tls.client_certificate and tls.client_private_key must be given "
        "together");
  }
  if (options.tls) return CheckClientKeyPair(*options.tls);
  return absl::OkStatus();
}

std::shared_ptr<grpc::ChannelCredentials> Credentials(
    const ClientOptions& options) {
  if (!options.tls) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = options.tls->root_certificates;
  ssl.pem_cert_chain = options.tls->client_certificate;
  ssl.pem_private_key = options.tls->client_private_key;
  return grpc::SslCredentials(ssl);
}

// A message over a max_message_bytes limit, the client's or the server's,
// as gRPC reports it: the same call would meet the same limit again.
bool OverMessageLimit(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
         (absl::StartsWith(status.error_message(),
                           "Received message larger than max") ||
          absl::StartsWith(status.error_message(),
                           "Sent message larger than max"));
}

// Whether the server asked for no retry of the call (gRFC A6: a negative
// grpc-retry-pushback-ms trailer): it refused for one of its limits on the
// request's own size, which the same call would meet again.
bool ServerSaysNeverRetry(const grpc::ClientContext& context) {
  const auto& trailers = context.GetServerTrailingMetadata();
  const auto found = trailers.find("grpc-retry-pushback-ms");
  return found != trailers.end() &&
         absl::StartsWith(
             absl::string_view(found->second.data(), found->second.size()),
             "-");
}

bool IsRetryable(const RetryPolicy& policy, const grpc::Status& status) {
  return (policy.retry_unavailable &&
          status.error_code() == grpc::StatusCode::UNAVAILABLE) ||
         (policy.retry_resource_exhausted &&
          status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
          !OverMessageLimit(status)) ||
         (policy.retry_cancelled_by_server &&
          status.error_code() == grpc::StatusCode::CANCELLED);
}

// One asynchronous call's state, alive until its callback has run.
template <typename Request, typename Response>
struct AsyncCall {
  std::unique_ptr<grpc::ClientContext> context;
  Request request;
  Response response;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(
    absl::string_view target, const ClientOptions& options) {
  if (target.empty()) {
    return absl::InvalidArgumentError(
        "target is empty, expected e.g. \"localhost:50051\"");
  }
  const absl::Status valid = ValidateOptions(options);
  if (!valid.ok()) return valid;
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(options.max_message_bytes);
  arguments.SetMaxSendMessageSize(options.max_message_bytes);
  arguments.SetLoadBalancingPolicyName(options.load_balancing_policy);
  // A replica that restarts at its address is connected to within about half
  // a second of listening: attempts 100 ms apart at first, then at most
  // 500 ms (gRPC's defaults: 1 s, then up to 120 s), each given at least 1 s
  // to connect. With the backup poller below, 0.3-0.5 s (median; 0.8 s at
  // most) where gRPC's defaults took 6.9-9.8 s; while the replica stays
  // down, about two connects a second per address. The process shares its
  // subchannels, so every channel to the address waits the same.
  arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  arguments.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 1000);
  arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  if (options.health_check) {
    // gRPC's client-side health checking: a Watch per address, and the
    // policy picks only addresses whose server says SERVING.
    arguments.SetServiceConfigJSON(absl::StrCat(
        R"({"loadBalancingConfig": [{")", options.load_balancing_policy,
        R"(": {}}], "healthCheckConfig": {"serviceName": ""}})"));
  }
  if (options.keepalive_time > absl::ZeroDuration()) {
    arguments.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS,
                     static_cast<int>(Milliseconds(options.keepalive_time)));
    arguments.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                     static_cast<int>(Milliseconds(options.keepalive_timeout)));
    arguments.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  }
  if (options.tls && !options.tls->server_name_override.empty()) {
    arguments.SetSslTargetNameOverride(options.tls->server_name_override);
  }
  return std::unique_ptr<Client>(
      new Client(grpc::CreateCustomChannel(std::string(target),
                                           Credentials(options), arguments),
                 options));
}

Client::Client(std::shared_ptr<grpc::Channel> channel,
               const ClientOptions& options)
    : options_(options),
      channel_(std::move(channel)),
      stub_(v1::AttentionService::NewStub(channel_)) {}

std::unique_ptr<grpc::ClientContext> Client::NewContext(
    absl::Time deadline) const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(deadline));
  context->set_wait_for_ready(options_.wait_for_ready);
  if (!options_.bearer_token.empty()) {
    context->AddMetadata("authorization", "Bearer " + options_.bearer_token);
  }
  switch (options_.compression) {
    case Compression::kNone:
      break;
    case Compression::kGzip:
      context->set_compression_algorithm(GRPC_COMPRESS_GZIP);
      break;
    case Compression::kDeflate:
      context->set_compression_algorithm(GRPC_COMPRESS_DEFLATE);
      break;
  }
  return context;
}

std::optional<Compression> ParseCompression(absl::string_view name) {
  if (name == "none") return Compression::kNone;
  if (name == "gzip") return Compression::kGzip;
  if (name == "deflate") return Compression::kDeflate;
  return std::nullopt;
}

template <typename Request, typename Response>
absl::StatusOr<Response> Client::CallWithRetries(
    grpc::Status (v1::AttentionService::Stub::*method)(grpc::ClientContext*,
                                                       const Request&,
                                                       Response*),
    const Request& request, absl::Duration timeout, bool retryable,
    int* attempts, grpc::StatusCode also_retried) {
  const RetryPolicy& policy = options_.retry;
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = policy.initial_backoff;
  thread_local std::minstd_rand jitter(std::random_device{}());
  for (int attempt = 1;; ++attempt) {
    std::unique_ptr<grpc::ClientContext> context = NewContext(deadline);
    Response response;
    const grpc::Status status =
        ((*stub_).*method)(context.get(), request, &response);
    if (attempts != nullptr) *attempts = attempt;
    if (status.ok()) return response;
    const bool never = ServerSaysNeverRetry(*context);
    if (!retryable || attempt >= policy.max_attempts || never ||
        !(IsRetryable(policy, status) ||
          (also_retried != grpc::StatusCode::OK &&
           status.error_code() == also_retried))) {
      // Marked so for Replicas: another replica would refuse it too.
      return never ? Permanent(FromGrpcStatus(status)) : FromGrpcStatus(status);
    }
    // Full backoff scaled by a jitter in [0.5, 1): spreads clients that failed
    // together.
    const absl::Duration wait =
        backoff * std::uniform_real_distribution<double>(0.5, 1.0)(jitter);
    if (absl::Now() + wait >= deadline) return FromGrpcStatus(status);
    absl::SleepFor(wait);
    backoff = std::min(backoff * policy.backoff_multiplier, policy.max_backoff);
  }
}

absl::StatusOr<v1::AttendResponse> Client::Attend(
    const v1::AttendRequest& request, absl::Duration timeout, int* attempts) {
  return CallWithRetries(&v1::AttentionService::Stub::Attend, request, timeout,
                         true, attempts);
}

absl::StatusOr<v1::MultiHeadAttentionResponse> Client::MultiHeadAttention(
    const v1::MultiHeadAttentionRequest& request, absl::Duration timeout) {
  // A replica at another version of the set: another may hold the one asked.
  const bool pinned =
      request.weights_version() != 0 && options_.retry.retry_weights_version;
  return CallWithRetries(
      &v1::AttentionService::Stub::MultiHeadAttention, request, timeout, true,
      nullptr,
      pinned ? grpc::StatusCode::FAILED_PRECONDITION : grpc::StatusCode::OK);
}

Client::~Client() {
  absl::MutexLock lock(&calls_mutex_);
  for (grpc::ClientContext* context : calls_) context->TryCancel();
  calls_mutex_.Await(absl::Condition(
      +[](std::set<grpc::ClientContext*>* calls) { return calls->empty(); },
      &calls_));
}

template <typename Request, typename Response, typename Start>
void Client::CallAsync(Request request, absl::Duration timeout, Start start,
                       std::function<void(absl::StatusOr<Response>)> done) {
  auto call = std::make_shared<AsyncCall<Request, Response>>();
  call->context = NewContext(absl::Now() + timeout);
  call->request = std::move(request);
  {
    absl::MutexLock lock(&calls_mutex_);
    calls_.insert(call->context.get());
  }
  start(call->context.get(), &call->request, &call->response,
        [this, call, done = std::move(done)](grpc::Status status) {
          {
            absl::MutexLock lock(&calls_mutex_);
            calls_.erase(call->context.get());
            call->context.reset();  // Its reference to the channel goes here.
          }
          // The client may be gone from here on.
          if (status.ok()) {
            done(std::move(call->response));
          } else {
            done(FromGrpcStatus(status));
          }
        });
}

void Client::AttendAsync(
    v1::AttendRequest request, absl::Duration timeout,
    std::function<void(absl::StatusOr<v1::AttendResponse>)> done) {
  CallAsync<v1::AttendRequest, v1::AttendResponse>(
      std::move(request), timeout,
      [this](grpc::ClientContext* context, const v1::AttendRequest* in,
             v1::AttendResponse* out,
             std::function<void(grpc::Status)> callback) {
        stub_->async()->Attend(context, in, out, std::move(callback));
      },
      std::move(done));
}

std::future<absl::StatusOr<v1::AttendResponse>> Client::AttendFuture(
    v1::AttendRequest request, absl::Duration timeout) {
  auto promise =
      std::make_shared<std::promise<absl::StatusOr<v1::AttendResponse>>>();
  std::future<absl::StatusOr<v1::AttendResponse>> future =
      promise->get_future();
  AttendAsync(std::move(request), timeout,
              [promise](absl::StatusOr<v1::AttendResponse> result) {
                promise->set_value(std::move(result));
              });
  return future;
}

void Client::MultiHeadAttentionAsync(
    v1::MultiHeadAttentionRequest request, absl::Duration timeout,
    std::function<void(absl::StatusOr<v1::MultiHeadAttentionResponse>)> done) {
  CallAsync<v1::MultiHeadAttentionRequest, v1::MultiHeadAttentionResponse>(
      std::move(request), timeout,
      [this](grpc::ClientContext* context,
             const v1::MultiHeadAttentionRequest* in,
             v1::MultiHeadAttentionResponse* out,
             std::function<void(grpc::Status)> callback) {
        stub_->async()->MultiHeadAttention(context, in, out,
                                           std::move(callback));
      },
      std::move(done));
}

std::unique_ptr<AttendSession> Client::OpenAttendSession(
    absl::Duration timeout) {
  // AttendSession's constructor is private to Client: not make_unique.
  return std::unique_ptr<AttendSession>(
      new AttendSession(NewContext(absl::Now() + timeout), *stub_));
}

absl::StatusOr<v1::PutWeightsResponse> Client::PutWeights(
    const v1::PutWeightsRequest& request, absl::Duration timeout) {
  return CallWithRetries(&v1::AttentionService::Stub::PutWeights, request,
                         timeout, options_.retry.retry_weight_changes);
}

// More sets than any server holds (--max_weights_bytes over the 1 KiB each
// costs): a server whose pages go past it is not followed further.
constexpr int kMaxListedWeights = 1 << 24;

absl::StatusOr<v1::ListWeightsResponse> Client::ListWeights(
    absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  v1::ListWeightsRequest request;
  v1::ListWeightsResponse all;
  while (true) {
    absl::StatusOr<v1::ListWeightsResponse> page =
        CallWithRetries(&v1::AttentionService::Stub::ListWeights, request,
                        deadline - absl::Now(), true);
    if (!page.ok()) return page.status();
    for (v1::WeightsInfo& info : *page->mutable_weights()) {
      *all.add_weights() = std::move(info);
    }
    all.set_total_bytes(page->total_bytes());
    if (page->next_page_token().empty() || page->weights_size() == 0) {
      return all;
    }
    // Names only increase from page to page.
    if (page->next_page_token() <= request.page_token() ||
        all.weights_size() > kMaxListedWeights) {
      return absl::InternalError(
          absl::StrCat("ListWeights: the server's pages do not end (",
                       all.weights_size(), " sets so far, page_token ",
                       request.page_token(), " not passed or too many)"));
    }
    request.set_page_token(page->next_page_token());
  }
}

absl::StatusOr<v1::DeleteWeightsResponse> Client::DeleteWeights(
    absl::string_view name, absl::Duration timeout) {
  v1::DeleteWeightsRequest request;
  request.set_name(std::string(name));
  return CallWithRetries(&v1::AttentionService::Stub::DeleteWeights, request,
                         timeout, options_.retry.retry_weight_changes);
}

absl::StatusOr<v1::CreateSessionResponse> Client::CreateSession(
    const v1::CreateSessionRequest& request, absl::Duration timeout) {
  return CallWithRetries(&v1::AttentionService::Stub::CreateSession, request,
                         timeout, options_.retry.retry_session_creation);
}

absl::StatusOr<v1::StepResponse> Client::Step(const v1::StepRequest& request,
                                              absl::Duration timeout,
                                              int* attempts) {
  // Retryable whatever the steps: each carries its expected_length, so a
  // retry never appends what an earlier attempt did.
  return CallWithRetries(&v1::AttentionService::Stub::Step, request, timeout,
                         true, attempts);
}

absl::StatusOr<v1::ForkSessionResponse> Client::ForkSession(
    const v1::ForkSessionRequest& request, absl::Duration timeout) {
  return CallWithRetries(&v1::AttentionService::Stub::ForkSession, request,
                         timeout, options_.retry.retry_session_creation);
}

absl::StatusOr<v1::TruncateSessionResponse> Client::TruncateSession(
    const v1::TruncateSessionRequest& request, absl::Duration timeout) {
  return CallWithRetries(&v1::AttentionService::Stub::TruncateSession, request,
                         timeout, true);
}

absl::StatusOr<v1::DeleteSessionResponse> Client::DeleteSession(
    absl::string_view session_id, absl::Duration timeout, int* attempts) {
  v1::DeleteSessionRequest request;
  request.set_session_id(std::string(session_id));
  return DeleteSession(request, timeout, attempts);
}

absl::StatusOr<v1::DeleteSessionResponse> Client::DeleteSession(
    const v1::DeleteSessionRequest& request, absl::Duration timeout,
    int* attempts) {
  return CallWithRetries(&v1::AttentionService::Stub::DeleteSession, request,
                         timeout, true, attempts);
}

absl::StatusOr<v1::GetSessionResponse> Client::GetSession(
    absl::string_view session_id, absl::Duration timeout) {
  v1::GetSessionRequest request;
  request.set_session_id(std::string(session_id));
  return GetSession(request, timeout);
}

absl::StatusOr<v1::GetSessionResponse> Client::GetSession(
    const v1::GetSessionRequest& request, absl::Duration timeout) {
  return CallWithRetries(&v1::AttentionService::Stub::GetSession, request,
                         timeout, true);
}

// More sessions than one caller of any server holds (its --max_sessions):
// pages past it are a broken server's.
constexpr int kMaxListedSessions = 1 << 20;

absl::StatusOr<v1::ListSessionsResponse> Client::ListSessions(
    absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  v1::ListSessionsRequest request;
  v1::ListSessionsResponse all;
  while (true) {
    absl::StatusOr<v1::ListSessionsResponse> page =
        CallWithRetries(&v1::AttentionService::Stub::ListSessions, request,
                        deadline - absl::Now(), true);
    if (!page.ok()) return page.status();
    for (v1::SessionInfo& info : *page->mutable_sessions()) {
      *all.add_sessions() = std::move(info);
    }
    all.set_total_bytes(page->total_bytes());
    all.set_budget_bytes(page->budget_bytes());
    all.set_identity_budget_bytes(page->identity_budget_bytes());
    all.set_identity_max_sessions(page->identity_max_sessions());
    all.set_identity_held_bytes(page->identity_held_bytes());
    if (page->next_page_token().empty() || page->sessions_size() == 0) {
      return all;
    }
    // A server's tokens move on; one that repeats a token, or lists more
    // sessions than any server holds, is not followed further.
    if (page->next_page_token() == request.page_token() ||
        all.sessions_size() > kMaxListedSessions) {
      return absl::InternalError(
          absl::StrCat("ListSessions: the server's pages do not end (",
                       all.sessions_size(), " sessions so far, page_token ",
                       request.page_token(), " repeated or too many)"));
    }
    request.set_page_token(page->next_page_token());
  }
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus>
Client::CheckHealth(absl::string_view service, absl::Duration timeout) {
  std::unique_ptr<grpc::ClientContext> context =
      NewContext(absl::Now() + timeout);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(std::string(service));
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status =
      grpc::health::v1::Health::NewStub(channel_)->Check(context.get(), request,
                                                         &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response.status();
}

}  // namespace attnserve
