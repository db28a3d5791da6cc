#include "call_gate.h"

namespace attnserve {
namespace {

// Compares without an early exit, so the time taken does not reveal how much of
// a guess matched.
bool ConstantTimeEquals(const std::string& expected, grpc::string_ref actual) {
  unsigned char difference = expected.size() == actual.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const char got = i < actual.size() ? actual.data()[i] : '\0';
    difference |= static_cast<unsigned char>(expected[i] ^ got);
  }
  return difference == 0;
}

}  // namespace

absl::Status CallGate::Admit(const grpc::ServerContextBase& context) const {
  if (closed_.load()) {
    return absl::UnavailableError(
        "the server is shutting down; retry on another replica");
  }
  if (bearer_token_.empty()) return absl::OkStatus();
  const auto header = context.client_metadata().find("authorization");
  if (header == context.client_metadata().end() ||
      !ConstantTimeEquals("Bearer " + bearer_token_, header->second)) {
    return absl::UnauthenticatedError(
        "authorization is missing or wrong, expected the header "
        "\"authorization: Bearer "
        "<token>\" with the server's token");
  }
  return absl::OkStatus();
}

}  // namespace attnserve
