// The session RPCs' requests and answers other than Step's: checks of every
// field before the store is touched, and the store's descriptions as
// v1.SessionInfo.
#ifndef ATTNSERVE_SERVER_SESSIONS_SESSION_REQUESTS_H_
#define ATTNSERVE_SERVER_SESSIONS_SESSION_REQUESTS_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attnserve/server/sessions/session_store.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// INVALID_ARGUMENT naming `field` unless `id` has a session id's form.
absl::Status ValidateSessionId(absl::string_view field, const std::string& id);

// The session a CreateSession request describes, within `options`' limits:
// INVALID_ARGUMENT naming the field, RESOURCE_EXHAUSTED for a page larger
// than max_page_bytes, or for a session whose first page and bookkeeping
// pass the whole budget or one caller's share: it could never take a token.
absl::StatusOr<SessionConfig> ValidateCreateSession(
    const v1::CreateSessionRequest& request, const SessionOptions& options);

// A fork's shared length (nullopt: all) and TTL (zero: the parent's).
struct ForkPlan {
  std::optional<int64_t> length;
  absl::Duration ttl;
};
absl::StatusOr<ForkPlan> ValidateForkSession(
    const v1::ForkSessionRequest& request, const SessionOptions& options);

absl::Status ValidateTruncateSession(const v1::TruncateSessionRequest& request);

// FAILED_PRECONDITION naming both unless `requested` (a request's
// replica_incarnation) is empty or `replica`'s incarnation: `what` ("the
// session is", "the steps' sessions are") went with the process that created
// it.
absl::Status CheckReplicaIncarnation(absl::string_view requested,
                                     const ReplicaIdentity& replica,
                                     absl::string_view what);

// The replica's identity as CreateSession, ForkSession and GetSession report
// it.
void DescribeReplica(const ReplicaIdentity& replica,
                     v1::ReplicaIdentity* message);

void DescribeSession(const SessionDescription& description,
                     v1::SessionInfo* info);

// The page of `owner`'s sessions in `store` that `request` asks for, in a
// message of at most `max_message_bytes`, with what they hold:
// INVALID_ARGUMENT for a negative page_size or a page_token no answer gave.
absl::Status ListSessionsPage(SessionStore& store, const std::string& owner,
                              const v1::ListSessionsRequest& request,
                              int64_t max_message_bytes,
                              v1::ListSessionsResponse* response);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_SESSIONS_SESSION_REQUESTS_H_
