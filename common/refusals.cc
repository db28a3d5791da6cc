#include "attnserve/common/refusals.h"

#include <utility>

#include "absl/strings/cord.h"

namespace attnserve {
namespace {

// The payload's key; absl keys payloads by a type URL.
constexpr absl::string_view kPermanentUrl = "type.attnserve.dev/Permanent";

}  // namespace

absl::Status Permanent(absl::Status status) {
  if (!status.ok()) status.SetPayload(kPermanentUrl, absl::Cord());
  return status;
}

bool IsPermanent(const absl::Status& status) {
  return status.GetPayload(kPermanentUrl).has_value();
}

absl::Status Reworded(const absl::Status& status, absl::string_view message) {
  absl::Status reworded(status.code(), message);
  status.ForEachPayload(
      [&reworded](absl::string_view url, const absl::Cord& payload) {
        reworded.SetPayload(url, payload);
      });
  return reworded;
}

}  // namespace attnserve
