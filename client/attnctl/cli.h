// What every attnctl command shares: exit codes, error reporting, and the
// connection flags (--target, --timeout, --max_message_bytes).
#ifndef ATTNSERVE_CLIENT_ATTNCTL_CLI_H_
#define ATTNSERVE_CLIENT_ATTNCTL_CLI_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnserve/client/client.h"

namespace attnserve {

// attnctl's exit statuses.
inline constexpr int kExitOk = 0;
// A call failed (its gRPC status is printed), or an output could not be
// written.
inline constexpr int kExitCallFailed = 1;
// Bad command line, or an input file that cannot be read or used.
inline constexpr int kExitUsage = 2;

// Prints `status` to stderr; returns kExitCallFailed.
int Fail(const absl::Status& status);

// Prints `status` to stderr as a usage error; returns kExitUsage.
int UsageError(const absl::Status& status);

// --timeout: the deadline of each call.
absl::Duration CallTimeout();

// A client for --target with --max_message_bytes. INVALID_ARGUMENT for a bad
// target or limit.
absl::StatusOr<std::unique_ptr<Client>> ConnectFromFlags();

// --max_message_bytes.
int64_t MaxMessageBytes();

// The largest input file attnctl reads: twice --max_message_bytes, since a
// float64 file shrinks by half on the wire.
int64_t MaxInputFileBytes();

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTNCTL_CLI_H_
