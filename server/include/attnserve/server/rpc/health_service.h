// HealthService: grpc.health.v1.Health, Check and Watch, for the server as a
// whole ("") and for the services it names, all serving or not together.
// Served on the CallLoop (see call_loop.h for why not gRPC's own health
// service). Never asks for the bearer token, so probes need none.
//
//   HealthService health({"attnserve.v1.AttentionService"});
//   health.AddTo(loop);
//   ... server started ...
//   health.SetServing(true);
//   ...
//   health.SetServing(false);  // Watchers hear NOT_SERVING at once.
//   health.Shutdown();         // Ends every Watch, before the server's
//                              // Shutdown.
#ifndef ATTNSERVE_SERVER_RPC_HEALTH_SERVICE_H_
#define ATTNSERVE_SERVER_RPC_HEALTH_SERVICE_H_

#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/server/rpc/call_loop.h"
#include "grpc/health/v1/health.pb.h"

namespace attnserve {

// Thread-safe. Must outlive the loop's calls.
class HealthService {
 public:
  // Knows "" and `services`, all NOT_SERVING until SetServing(true).
  explicit HealthService(const std::vector<std::string>& services);
  HealthService(const HealthService&) = delete;
  HealthService& operator=(const HealthService&) = delete;

  void AddTo(CallLoop& loop);

  // Every known service turns SERVING or NOT_SERVING; watchers hear it.
  void SetServing(bool serving);

  // NOT_SERVING for good; ends every Watch call (UNAVAILABLE), and those that
  // start later at once.
  void Shutdown();

 private:
  class CheckCall;
  class WatchCall;
  using Status = grpc::health::v1::HealthCheckResponse::ServingStatus;

  Status StatusOf(const std::string& service) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Sends the watcher its service's status and every change after.
  void AddWatcher(WatchCall* watcher);
  void RemoveWatcher(WatchCall* watcher);

  const std::set<std::string> services_;
  mutable absl::Mutex mutex_;
  bool serving_ ABSL_GUARDED_BY(mutex_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mutex_) = false;
  std::set<WatchCall*> watchers_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_HEALTH_SERVICE_H_
