// The one place where an absl::Status becomes a grpc::Status.
#ifndef ATTNSERVE_SERVER_RPC_GRPC_STATUS_H_
#define ATTNSERVE_SERVER_RPC_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace attnserve {

// Same code (absl and gRPC share the canonical numbering), same message.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_GRPC_STATUS_H_
