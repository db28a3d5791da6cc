#include "internal/dnnl_status.h"

namespace attnserve::internal {

absl::Status DnnlErrorToStatus(const dnnl::error& error,
                               absl::string_view what) {
  std::string message =
      absl::StrCat(what, ": oneDNN status ", static_cast<int>(error.status),
                   ": ", error.what());
  if (error.status == dnnl_out_of_memory) {
    return absl::ResourceExhaustedError(std::move(message));
  }
  return absl::InternalError(std::move(message));
}

}  // namespace attnserve::internal
