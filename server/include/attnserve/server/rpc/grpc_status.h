// The one place where an absl::Status becomes a grpc::Status.
#ifndef ATTNSERVE_SERVER_RPC_GRPC_STATUS_H_
#define ATTNSERVE_SERVER_RPC_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"

namespace attnserve {

// The trailer by which a server tells gRPC clients when to retry a failed
// call (gRFC A6); a negative value: never.
inline constexpr absl::string_view kRetryPushbackTrailer =
    "grpc-retry-pushback-ms";

// Same code (absl and gRPC share the canonical numbering), same message.
grpc::Status ToGrpcStatus(const absl::Status& status);

// Adds to `context`'s trailers what the client should know of `status`
// beyond its code and message: for a Permanent refusal, a retry pushback of
// -1, so that retrying clients do not send the call again. Call it before the
// call's Finish.
void AddStatusTrailers(const absl::Status& status,
                       grpc::ServerContextBase& context);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_GRPC_STATUS_H_
