// CallGate: whether a call may enter — the server still takes calls (not
// draining) and the caller holds the bearer token, if one is configured. Health
// checks never pass through it.
#ifndef ATTNSERVE_SERVER_CALL_GATE_H_
#define ATTNSERVE_SERVER_CALL_GATE_H_

#include <atomic>
#include <string>

#include "absl/status/status.h"
#include "grpcpp/server_context.h"

namespace attnserve {

// Thread-safe.
class CallGate {
 public:
  // `bearer_token` empty: calls need no token.
  explicit CallGate(std::string bearer_token)
      : bearer_token_(std::move(bearer_token)) {}

  // OK; UNAVAILABLE once Close() was called; UNAUTHENTICATED without
  // "authorization: Bearer <token>" when a token is configured.
  absl::Status Admit(const grpc::ServerContextBase& context) const;

  // New calls get UNAVAILABLE from now on (the server is draining).
  void Close() { closed_.store(true); }

 private:
  const std::string bearer_token_;
  std::atomic<bool> closed_{false};
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_CALL_GATE_H_
