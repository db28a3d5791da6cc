#include "attnserve/server/rpc/grpc_status.h"

#include <string>

#include "attnserve/common/refusals.h"

namespace attnserve {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

void AddStatusTrailers(const absl::Status& status,
                       grpc::ServerContextBase& context) {
  if (IsPermanent(status)) {
    context.AddTrailingMetadata(std::string(kRetryPushbackTrailer), "-1");
  }
}

}  // namespace attnserve
