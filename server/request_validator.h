// Validation of every request field, before any work is queued or anything
// large allocated.
//
// Every error names the field and says what was expected and what arrived, e.g.
//   INVALID_ARGUMENT: key.shape[3] (Dk) is 32, expected 64 (query.shape[3])
#ifndef ATTNSERVE_SERVER_REQUEST_VALIDATOR_H_
#define ATTNSERVE_SERVER_REQUEST_VALIDATOR_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "attnserve/core/attention_engine.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

struct RequestLimits {
  // The largest message the server receives or sends. A response that would be
  // larger is refused with RESOURCE_EXHAUSTED before it is computed.
  int64_t max_message_bytes = int64_t{64} << 20;
};

// What a valid Attend request asks the engine for.
struct AttendWork {
  AttentionShape shape;
  AttentionOptions options;
};

// Returns the work a request describes, INVALID_ARGUMENT for a malformed field,
// or RESOURCE_EXHAUSTED if its response would exceed `limits`.
absl::StatusOr<AttendWork> ValidateAttendRequest(
    const v1::AttendRequest& request, const RequestLimits& limits);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_REQUEST_VALIDATOR_H_
