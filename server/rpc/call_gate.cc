#include "attnserve/server/rpc/call_gate.h"

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
    refused_closed_.fetch_add(1);
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

std::optional<CallGate::Ticket> CallGate::HoldRefusal(
    std::function<void()> answer) const {
  absl::MutexLock lock(&mutex_);
  if (!holding_) return std::nullopt;
  const Ticket ticket = next_++;
  held_.emplace(ticket, std::move(answer));
  return ticket;
}

bool CallGate::Unhold(Ticket ticket) const {
  absl::MutexLock lock(&mutex_);
  return held_.erase(ticket) == 1;
}

void CallGate::HoldRefusals() {
  absl::MutexLock lock(&mutex_);
  holding_ = true;
}

int CallGate::ReleaseHeld() {
  std::map<Ticket, std::function<void()>> held;
  {
    absl::MutexLock lock(&mutex_);
    holding_ = false;
    held.swap(held_);
  }
  for (auto& [ticket, answer] : held) answer();
  return static_cast<int>(held.size());
}

}  // namespace attnserve
