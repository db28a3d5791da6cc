// gRPC core's own log lines through the server's log (common/log.h): at the
// server's --log_level (gRPC's errors as warnings: most say what a peer sent
// that gRPC could not parse), each message quoted and escaped as an error
// message quotes a client's text (EchoText: a client's header value cannot
// forge a line or a JSON access-log record), and at most one line every 10 s
// from each place in gRPC's sources, with the count of those not shown (one
// client's malformed headers wrote a line each, unbounded). With --log_level
// =debug every line is shown.
//
//   RouteGrpcLogs();  // once, before the server starts
#ifndef ATTNSERVE_SERVER_RPC_GRPC_LOG_H_
#define ATTNSERVE_SERVER_RPC_GRPC_LOG_H_

#include <string>

#include "absl/time/time.h"

namespace attnserve {

// Installs the route (gpr_set_log_function). Idempotent.
void RouteGrpcLogs();

// The line RouteGrpcLogs writes for one of gRPC's, or an empty string for one
// not shown: `severity` is gRPC's ('D', 'I' or 'E'), `file` its source path,
// at `now`. Exposed for tests.
std::string GrpcLogLine(char severity, const char* file, int line,
                        const char* message, absl::Time now);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_GRPC_LOG_H_
