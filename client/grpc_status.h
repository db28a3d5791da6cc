// The client library's own helper, not installed: a gRPC status as the
// absl::Status callers get, code and message unchanged.
#ifndef ATTNSERVE_CLIENT_GRPC_STATUS_H_
#define ATTNSERVE_CLIENT_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace attnserve {

inline absl::Status FromGrpcStatus(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_GRPC_STATUS_H_
