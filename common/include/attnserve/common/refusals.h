// Refusals a request meets again however often it is sent: it passes one of
// the server's limits on a request's own size (max_elements, max_message_bytes,
// max_workspace_bytes, max_request_memory_bytes, a session's max_tokens, ...),
// not a limit that other calls fill (the compute queue, the memory in flight,
// the KV-cache budget while others hold it). The server answers these with
// the trailer `grpc-retry-pushback-ms: -1`, which tells gRPC's retrying
// clients, and attnserve's, not to send the call again.
//
//   if (elements > max_elements) {
//     return Permanent(absl::ResourceExhaustedError("... max_elements ..."));
//   }
#ifndef ATTNSERVE_COMMON_REFUSALS_H_
#define ATTNSERVE_COMMON_REFUSALS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace attnserve {

// `status` marked as a refusal that the same request would meet again.
absl::Status Permanent(absl::Status status);

// Whether Permanent marked `status` (or the status it was reworded from).
bool IsPermanent(const absl::Status& status);

// `status` with `message` instead of its own, keeping its code and marks.
absl::Status Reworded(const absl::Status& status, absl::string_view message);

}  // namespace attnserve

#endif  // ATTNSERVE_COMMON_REFUSALS_H_
