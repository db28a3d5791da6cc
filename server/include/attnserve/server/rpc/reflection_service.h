// ReflectionService: gRPC server reflection (grpc.reflection.v1alpha and its
// wire-identical successor grpc.reflection.v1), so that attnctl, grpcurl and
// grpc_cli can list the services and fetch their proto descriptors. Answers
// from the descriptors linked into the binary; behind the call gate like every
// RPC but health (token, draining). Served on the CallLoop (call_loop.h says
// why gRPC's own reflection service is not used).
//
//   ReflectionService reflection(&gate, {"attnserve.v1.AttentionService",
//                                        "grpc.health.v1.Health"});
//   reflection.AddTo(loop);
#ifndef ATTNSERVE_SERVER_RPC_REFLECTION_SERVICE_H_
#define ATTNSERVE_SERVER_RPC_REFLECTION_SERVICE_H_

#include <string>
#include <vector>

#include "attnserve/server/rpc/call_gate.h"
#include "attnserve/server/rpc/call_loop.h"

namespace attnserve {

// Thread-safe. Must outlive the loop's calls, as must `gate`.
class ReflectionService {
 public:
  // Lists `services` and itself.
  ReflectionService(const CallGate* gate, std::vector<std::string> services);

  void AddTo(CallLoop& loop);

 private:
  class InfoCall;

  const CallGate* const gate_;
  std::vector<std::string> services_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_REFLECTION_SERVICE_H_
