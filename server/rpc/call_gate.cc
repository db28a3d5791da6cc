#include "attnserve/server/rpc/call_gate.h"

#include <openssl/sha.h>

#include "absl/strings/escaping.h"
#include "absl/strings/string_view.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/auth_context.h"

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
  if (bearer_tokens_.empty()) return absl::OkStatus();
  const auto header = context.client_metadata().find("authorization");
  bool matched = false;
  if (header != context.client_metadata().end()) {
    // Every token compared, so the time taken does not say which matched.
    for (const std::string& token : bearer_tokens_) {
      matched =
          ConstantTimeEquals("Bearer " + token, header->second) || matched;
    }
  }
  if (!matched) {
    return absl::UnauthenticatedError(
        "authorization is missing or wrong, expected the header "
        "\"authorization: Bearer "
        "<token>\" with the server's token");
  }
  return absl::OkStatus();
}

std::string CallGate::Identity(const grpc::ServerContextBase& context) const {
  if (!bearer_tokens_.empty()) {
    const auto header = context.client_metadata().find("authorization");
    if (header == context.client_metadata().end()) return "";
    unsigned char digest[SHA256_DIGEST_LENGTH];
    SHA256(reinterpret_cast<const unsigned char*>(header->second.data()),
           header->second.size(), digest);
    return "token:" + absl::BytesToHexString(absl::string_view(
                          reinterpret_cast<const char*>(digest), 16));
  }
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    const std::vector<grpc::string_ref> subject =
        auth->FindPropertyValues(GRPC_X509_SUBJECT_PROPERTY_NAME);
    if (!subject.empty()) {
      return "x509:" +
             std::string(subject.front().data(), subject.front().size());
    }
  }
  return "";
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
