#include "cli.h"

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(std::string, target, "localhost:50051",
          "gRPC target of the attnserve server.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(30), "Deadline of each call.");
ABSL_FLAG(int64_t, max_message_bytes, 64 << 20,
          "Largest message the client sends or receives; match the server's "
          "--max_message_bytes.");

namespace attnserve {

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "attnctl: %s\n", status.ToString().c_str());
  return kExitCallFailed;
}

int UsageError(const absl::Status& status) {
  std::fprintf(stderr, "attnctl: %s\n", std::string(status.message()).c_str());
  return kExitUsage;
}

absl::Duration CallTimeout() { return absl::GetFlag(FLAGS_timeout); }

absl::StatusOr<std::unique_ptr<Client>> ConnectFromFlags() {
  const int64_t max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (max_message_bytes <= 0 || max_message_bytes > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_message_bytes is ", max_message_bytes,
                     ", expected 1 to ", INT32_MAX));
  }
  ClientOptions options;
  options.max_message_bytes = static_cast<int>(max_message_bytes);
  return Client::Connect(absl::GetFlag(FLAGS_target), options);
}

int64_t MaxMessageBytes() { return absl::GetFlag(FLAGS_max_message_bytes); }

int64_t MaxInputFileBytes() { return 2 * MaxMessageBytes(); }

}  // namespace attnserve
