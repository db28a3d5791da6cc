// attnserve::Client: calls an attnserve server from C++.
//
// clang-format off
//   ATTNSERVE_ASSIGN_OR_RETURN(std::unique_ptr<attnserve::Client> client,
//                              attnserve::Client::Connect("localhost:50051"));
//   attnserve::v1::AttendRequest request;
//   *request.mutable_query() = attnserve::MakeFloat32Tensor({1, 8, 128, 64}, query);
//   ...
//   ATTNSERVE_ASSIGN_OR_RETURN(attnserve::v1::AttendResponse response,
//                              client->Attend(request, absl::Seconds(5)));
// clang-format on
//
// Errors come back as absl::Status with the server's gRPC code and message
// unchanged. The library depends on the generated proto code only (plus Abseil
// and gRPC). This header brings in the tensor helpers
// (attnserve/client/tensors.h) and AttendSession
// (attnserve/client/attend_session.h); KV-cache sessions are
// attnserve/client/session.h, over the session calls below.
#ifndef ATTNSERVE_CLIENT_CLIENT_H_
#define ATTNSERVE_CLIENT_CLIENT_H_

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnserve/client/attend_session.h"
#include "attnserve/client/tensors.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "grpc/health/v1/health.pb.h"

namespace attnserve {

// Retries of the synchronous calls: UNAVAILABLE (no server took the call),
// RESOURCE_EXHAUSTED (the server refused it before computing, for want of room
// now: never a message over a max_message_bytes limit as gRPC reports it, nor
// a refusal the server marks as one the same call would meet again, for one of
// its limits on a request's own size such as max_elements or
// max_request_memory_bytes: it sends those with the trailer
// grpc-retry-pushback-ms: -1, and no call is retried after that trailer),
// CANCELLED (the server's side cancelled it) and, for a MultiHeadAttention
// naming a weights_version, FAILED_PRECONDITION, each as its switch below
// says, with exponential backoff and jitter, and never past the call's
// deadline.
// Attend, MultiHeadAttention and the read-only weights calls are idempotent;
// PutWeights and DeleteWeights are retried only if `retry_weight_changes` is
// set, since a retried put may register a second version.
//
// KV-cache sessions: Step is always retryable, since every step carries the
// layer length it expects and the server appends nothing when the length
// differs, so a retry whose first attempt landed cannot append twice
// (Session in attnserve/client/session.h turns that refusal back into the
// step's result). GetSession, ListSessions and TruncateSession are
// idempotent; DeleteSession is retried too (a retry whose first attempt
// landed answers NOT_FOUND, and the session is gone either way).
// CreateSession and ForkSession are retried only if `retry_session_creation`
// is set: a retried create whose first attempt landed but whose answer was
// lost leaves a session nobody knows the id of, holding cache memory until
// its TTL passes.
struct RetryPolicy {
  int max_attempts = 1;  // 1: no retries.
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(2);
  double backoff_multiplier = 2.0;
  bool retry_unavailable = true;
  bool retry_resource_exhausted = true;
  bool retry_weight_changes = false;
  bool retry_session_creation = false;
  // A MultiHeadAttention that names a weights_version the replica does not
  // hold (FAILED_PRECONDITION): another replica, or this one after its next
  // look at a shared weights_dir, may hold it.
  bool retry_weights_version = true;
  // CANCELLED, which a blocking call gets only from the server's side (this
  // client cancels none): gRPC 1.51 cancels a call that reaches a server as
  // its shutdown begins, before attnserve sees it, and a server past its
  // drain's 30 s cancels what still runs. Retried as UNAVAILABLE is.
  bool retry_cancelled_by_server = true;
};

// TLS for the channel: server authentication, and client authentication (mTLS)
// when a client certificate is given. All PEM text. Connect refuses a client
// certificate without a readable certificate, a key that is encrypted or not
// a key, or one that is not the certificate's (gRPC would take them and fail
// every handshake, UNAVAILABLE).
struct TlsOptions {
  std::string root_certificates;  // CA bundle; empty: gRPC's default roots.
  std::string client_certificate;
  std::string client_private_key;
  // The name the server certificate must carry, when the target is an address.
  std::string server_name_override;
};

// How a client's requests are compressed on the wire. The server takes them
// only with --accept_compressed_requests (else UNIMPLEMENTED, unread);
// compression costs CPU on both sides and saves little on dense float tensors
// (BENCHMARKS.md, "Compression"), so it pays off for masks and other
// repetitive data over slow links only.
enum class Compression { kNone, kGzip, kDeflate };

// "none", "gzip", "deflate" (as attnctl's --compression takes them); nullopt
// for anything else.
std::optional<Compression> ParseCompression(absl::string_view name);

struct ClientOptions {
  // The largest message sent or received, in bytes; match the server's
  // --max_message_bytes.
  int max_message_bytes = 64 << 20;
  // Plaintext when unset.
  std::optional<TlsOptions> tls;
  // Sent as "authorization: Bearer <token>" on every call when not empty.
  std::string bearer_token;
  // The load-balancing policy over the addresses a target resolves to. For
  // Kubernetes, target a headless Service as
  // "dns:///attnserve-headless.NAMESPACE.svc:50051" so that every pod is used
  // (kube-proxy would pin one long-lived HTTP/2 connection to one pod).
  std::string load_balancing_policy = "round_robin";
  // gRPC's client-side health checking: the channel watches each address's
  // grpc.health.v1.Health and sends calls only to those SERVING, so that a
  // draining replica (NOT_SERVING from its SIGTERM on) stops getting calls
  // before it refuses them. Applies to round_robin (pick_first ignores it).
  bool health_check = false;
  // HTTP/2 keepalive pings, so idle connections through proxies and NATs stay
  // open and dead ones are noticed. Zero turns them off; each at most
  // 2^31 - 1 ms (gRPC's C int), and the timeout positive while pings are on.
  absl::Duration keepalive_time = absl::Seconds(30);
  absl::Duration keepalive_timeout = absl::Seconds(10);
  RetryPolicy retry;
  // Calls wait, up to their deadline, for the channel to connect instead of
  // failing UNAVAILABLE at once while it is connecting or backing off after a
  // failed attempt (gRPC's "wait for ready"). It rides out a server that is
  // starting or restarting, and gRPC 1.51's spurious connection failures
  // ("No such file or directory": its client reads connect()'s errno after
  // other calls have changed it, grpc/grpc#35064), after which the channel
  // backs off for about a second. The price: a server that stays unreachable
  // shows as DEADLINE_EXCEEDED once the whole deadline has passed, not as
  // UNAVAILABLE at once.
  bool wait_for_ready = false;
  // Every call's request compressed so (each call's context carries it).
  // Responses come compressed when the server's --response_compression asks,
  // whatever this says: the channel accepts gzip and deflate.
  Compression compression = Compression::kNone;
};

// A channel to one attnserve target. Thread-safe: calls may run concurrently on
// one Client.
class Client {
 public:
  // Returns a client for `target`, a gRPC target string ("localhost:50051",
  // "dns:///attnserve-headless.default.svc:50051", "unix:/run/attnserve.sock").
  // Connects lazily: an unreachable server shows as UNAVAILABLE on the first
  // call. INVALID_ARGUMENT for an empty target or bad options.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      absl::string_view target, const ClientOptions& options = {});

  // Calls Attend, waiting at most `timeout` in all (retries included;
  // DEADLINE_EXCEEDED past it). `attempts`, when not null, receives how many
  // times the call was sent.
  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& request,
                                            absl::Duration timeout,
                                            int* attempts = nullptr);

  // Calls MultiHeadAttention, waiting at most `timeout`.
  absl::StatusOr<v1::MultiHeadAttentionResponse> MultiHeadAttention(
      const v1::MultiHeadAttentionRequest& request, absl::Duration timeout);

  // Cancels the asynchronous calls still in flight and waits until they have
  // let go of the channel (their `done` may still be running).
  ~Client();

  // Asynchronous Attend: returns at once; `done` runs once, on a gRPC thread,
  // with the result. No retries. `done` must not block for long, and must not
  // own the Client (a shared_ptr to it among its captures): the Client would
  // then be destroyed on that gRPC thread, which gRPC 1.51 answers with a
  // double free.
  void AttendAsync(
      v1::AttendRequest request, absl::Duration timeout,
      std::function<void(absl::StatusOr<v1::AttendResponse>)> done);
  // As AttendAsync, with the result in a future.
  std::future<absl::StatusOr<v1::AttendResponse>> AttendFuture(
      v1::AttendRequest request, absl::Duration timeout);
  // Asynchronous MultiHeadAttention, as AttendAsync.
  void MultiHeadAttentionAsync(
      v1::MultiHeadAttentionRequest request, absl::Duration timeout,
      std::function<void(absl::StatusOr<v1::MultiHeadAttentionResponse>)> done);

  // Opens an AttendStream session: many requests on one stream, answers in
  // order. The session lasts at most `timeout`.
  std::unique_ptr<AttendSession> OpenAttendSession(absl::Duration timeout);

  // The weights registry: register or replace, list, delete.
  absl::StatusOr<v1::PutWeightsResponse> PutWeights(
      const v1::PutWeightsRequest& request, absl::Duration timeout);
  // Every registered set, by name: every page of them (the server answers at
  // most 4,096 a call), in one response, within `timeout`.
  absl::StatusOr<v1::ListWeightsResponse> ListWeights(absl::Duration timeout);
  absl::StatusOr<v1::DeleteWeightsResponse> DeleteWeights(
      absl::string_view name, absl::Duration timeout);

  // KV-cache sessions (docs/api.md, "Sessions"): thin wrappers, one call
  // each, with the retries of RetryPolicy. Session (session.h) keeps each
  // layer's length and builds the steps; use these directly to manage
  // sessions by id. Calls on an unknown, expired, evicted, deleted or another
  // identity's session answer NOT_FOUND.
  absl::StatusOr<v1::CreateSessionResponse> CreateSession(
      const v1::CreateSessionRequest& request, absl::Duration timeout);
  // A failed step fails only its own StepResult (its `error`), so an OK
  // status says only that the call as a whole went through. `attempts`, when
  // not null, receives how many times the call was sent: more than one means
  // an earlier attempt may have appended before its answer was lost.
  absl::StatusOr<v1::StepResponse> Step(const v1::StepRequest& request,
                                        absl::Duration timeout,
                                        int* attempts = nullptr);
  absl::StatusOr<v1::ForkSessionResponse> ForkSession(
      const v1::ForkSessionRequest& request, absl::Duration timeout);
  absl::StatusOr<v1::TruncateSessionResponse> TruncateSession(
      const v1::TruncateSessionRequest& request, absl::Duration timeout);
  // `attempts` as for Step: NOT_FOUND after more than one attempt may mean
  // that the first one deleted the session.
  absl::StatusOr<v1::DeleteSessionResponse> DeleteSession(
      absl::string_view session_id, absl::Duration timeout,
      int* attempts = nullptr);
  absl::StatusOr<v1::DeleteSessionResponse> DeleteSession(
      const v1::DeleteSessionRequest& request, absl::Duration timeout,
      int* attempts = nullptr);
  absl::StatusOr<v1::GetSessionResponse> GetSession(
      absl::string_view session_id, absl::Duration timeout);
  absl::StatusOr<v1::GetSessionResponse> GetSession(
      const v1::GetSessionRequest& request, absl::Duration timeout);
  // The caller's sessions, by creation time: every page of them (the server
  // answers as many as fit in a message), in one response, within `timeout`.
  absl::StatusOr<v1::ListSessionsResponse> ListSessions(absl::Duration timeout);

  // Asks grpc.health.v1.Health about `service` ("" for the server as a whole).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus>
  CheckHealth(absl::string_view service, absl::Duration timeout);

  // The options the client was made with.
  const ClientOptions& options() const { return options_; }

  // The channel, for calling services this class does not wrap (reflection,
  // for one), with contexts from NewContext.
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }

  // A context with `deadline`, the client's bearer token, its wait_for_ready
  // and its compression set.
  std::unique_ptr<grpc::ClientContext> NewContext(absl::Time deadline) const;

 private:
  Client(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options);

  // Calls `method` with retries per the policy; `retryable` says whether this
  // RPC may be, and `also_retried` names a code retried beside the policy's
  // (OK: none). `attempts`, when not null, receives how many calls were made.
  template <typename Request, typename Response>
  absl::StatusOr<Response> CallWithRetries(
      grpc::Status (v1::AttentionService::Stub::*method)(grpc::ClientContext*,
                                                         const Request&,
                                                         Response*),
      const Request& request, absl::Duration timeout, bool retryable,
      int* attempts = nullptr,
      grpc::StatusCode also_retried = grpc::StatusCode::OK);

  // Starts an asynchronous call: `start` calls the stub's async method with
  // the context, request, response and callback it is given.
  template <typename Request, typename Response, typename Start>
  void CallAsync(Request request, absl::Duration timeout, Start start,
                 std::function<void(absl::StatusOr<Response>)> done);

  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;

  // Asynchronous calls in flight: their contexts, which hold references to the
  // channel. The last reference to a channel must not go on a gRPC callback
  // thread (the channel's destructor would shut down and join the very
  // threads that run callbacks, a double free in gRPC 1.51), so each call
  // destroys its context as it leaves the set, and the destructor waits for
  // the set to empty.
  absl::Mutex calls_mutex_;
  std::set<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(calls_mutex_);
};

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_CLIENT_H_
