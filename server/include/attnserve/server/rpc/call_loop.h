// CallLoop: serves every gRPC method of the server through gRPC's asynchronous
// generic API, on one completion queue that the loop's own threads poll, and
// hands each call to a ServerCall, driven like a callback-API reactor.
//
// Why not gRPC's callback API: gRPC 1.51 runs callback services on an emulated
// callback queue whose threads all join the poller, so each event of a call
// wakes another thread (6.5 context switches per tiny unary call on the
// server, measured, about 40 % of its CPU in this VM). Here the thread that
// polls a call's event runs its handler, as in a minimal async server. Any
// callback or sync service on the same server would bring those threads back,
// so health and reflection are served here too (health_service.h,
// reflection_service.h).
//
//   class Echo final : public ServerCall {
//     void OnStart() override { StartRead(&message_); }
//     void OnReadDone(bool ok) override {
//       if (ok) FinishWithMessage(message_, grpc::Status::OK);
//       else Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "..."));
//     }
//     grpc::ByteBuffer message_;
//   };
//   CallLoop loop;
//   loop.Handle("/echo.Echo/Echo", [] { return std::make_unique<Echo>(); });
//   loop.AddTo(builder);
//   std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
//   loop.Start(threads);
//   ...
//   server->Shutdown();
//   loop.Shutdown();
//
// Beside the polling threads a standby thread watches them: gRPC 1.51 runs a
// connection's transport work on the polling thread that found its bytes, and
// keeps reading while the socket has more, so one client sending faster than
// the server parses (a rapid-reset flood on a loaded machine) holds that
// thread; with every polling thread so held, no other call's event is handled,
// the reset guard never hears of the resets, and gRPC queues them without
// bound. When every polling thread has been busy in one turn (a poll or a
// handler) for kStallBefore, the standby polls beside them until one of them
// has finished its turn. Busy is the thread's state in
// /proc/self/task/TID/stat: running or ready to run (R), not asleep in
// epoll_wait; a thread starved of CPU is still busy. A second polling thread
// all the time would do the same, at ~50 µs more a tiny call (a hand-over of
// the poller per call).
#ifndef ATTNSERVE_SERVER_RPC_CALL_LOOP_H_
#define ATTNSERVE_SERVER_RPC_CALL_LOOP_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnserve/server/rpc/memory_budget.h"
#include "attnserve/server/rpc/reset_guard.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"

namespace attnserve {

class CallLoop;
namespace internal {
class CallSlot;
}  // namespace internal

// The handler of one call. The loop makes it when the call arrives, calls
// OnStart, then OnReadDone / OnWriteDone as the operations it started complete
// and OnCancel if the call is cancelled, all on the loop's threads; once the
// handler has called Finish (or FinishWithMessage) and every operation has
// completed, OnDone, then deletes it. As with gRPC's reactors: at most one read
// and one write in flight; no write after Finish; every handler calls Finish
// exactly once, even for a cancelled call (its operations then complete with ok
// false). The operations may be started from any thread.
class ServerCall {
 public:
  ServerCall() = default;
  ServerCall(const ServerCall&) = delete;
  ServerCall& operator=(const ServerCall&) = delete;
  virtual ~ServerCall() = default;

  // The call's context: method, deadline, metadata. Valid from OnStart.
  grpc::GenericServerContext& context() const;

  // The client's end of the connection as gRPC names it
  // ("ipv4:10.0.0.7:51234"), taken when the call arrived. Valid from OnStart.
  // Use it rather than context().peer(): gRPC forgets the peer of a call once
  // one of its operations fails (a reset call's do), and then says "unknown".
  const std::string& peer() const;

  // True once gRPC has reported the call cancelled (by the client, a passed
  // deadline, the server's shutdown or CancelStalled). Thread-safe.
  bool cancelled() const;

  // Cancels the call from the server's side, for a transfer that stalled
  // (TransferWatchdog): OnCancel follows as for any cancel, but the call does
  // not count as one its client reset (ResetGuard). Thread-safe.
  void CancelStalled();

 protected:
  virtual void OnStart() = 0;
  virtual void OnReadDone(bool /*ok*/) {}
  virtual void OnWriteDone(bool /*ok*/) {}
  virtual void OnCancel() {}
  virtual void OnDone() {}

  // Reads the next message into `message`, which must live until OnReadDone.
  void StartRead(grpc::ByteBuffer* message);
  // Writes `message`; gRPC holds its own reference to the bytes.
  void StartWrite(const grpc::ByteBuffer& message);
  // Ends the call with `status`.
  void Finish(const grpc::Status& status);
  // Writes `message` and ends the call with `status`, in one operation (a
  // unary response).
  void FinishWithMessage(const grpc::ByteBuffer& message,
                         const grpc::Status& status);

 private:
  friend class internal::CallSlot;
  internal::CallSlot* slot_ = nullptr;
};

// Whether the call's deadline has passed, compared in gRPC's own time type:
// ServerContextBase::deadline() converts to std::chrono::system_clock, whose
// int64 nanoseconds end in 2262, and a later deadline (grpc-timeout 2200000H,
// or any up to its 99999999H) overflows into the past. Such a deadline means
// no deadline.
bool DeadlinePassed(const grpc::ServerContextBase& context);

// Whether the call's deadline passes within `slack` from now (or has passed).
// A client's own deadline reaches the server as a cancel at about the moment
// the server's copy of that deadline passes, sometimes a little before: a
// cancel this close to the deadline is the deadline's.
bool DeadlineWithin(const grpc::ServerContextBase& context,
                    absl::Duration slack);

// How long before its deadline a call's cancel is taken for the client's own
// deadline (DeadlineWithin), so that the metrics tell the two apart.
inline constexpr absl::Duration kDeadlineSlack = absl::Milliseconds(250);

// Thread-safe after Start.
class CallLoop {
 public:
  using Factory = std::function<std::unique_ptr<ServerCall>()>;
  // Told how long the spinning thread polled without an event before one came
  // or it went to sleep; called on that thread.
  using SpinObserver = std::function<void(absl::Duration)>;

  CallLoop();
  CallLoop(const CallLoop&) = delete;
  CallLoop& operator=(const CallLoop&) = delete;
  // Calls Shutdown.
  ~CallLoop();

  // Whether a call may be refused when the memory budget is in use.
  enum class Admission {
    kBudgeted,  // RESOURCE_EXHAUSTED when kBytesPerCall cannot be taken.
    kAlways,    // Counted but never refused (health checks).
  };

  // Serves `method` ("/package.Service/Method") with calls `factory` makes.
  // Before AddTo. Calls to a method not handled get UNIMPLEMENTED.
  void Handle(const std::string& method, Factory factory,
              Admission admission = Admission::kBudgeted);

  // Each call holds kBytesPerCall of `budget` from its arrival until its
  // handler is deleted; past the budget, a kBudgeted method's call is answered
  // RESOURCE_EXHAUSTED without a handler. Before Start; `budget` must outlive
  // the loop. Without one, calls are not counted.
  void SetBudget(MemoryBudget* budget) { budget_ = budget; }

  // Tells `guard` of every call its client cancelled (its deadline not
  // passed). Before Start; `guard` must outlive the loop.
  void SetResetGuard(ResetGuard* guard) { reset_guard_ = guard; }

  // While `busy` says a compute runs (on the threads it was given, usually
  // every core), the spinning thread sleeps until its next event instead of
  // polling: a spin then only takes a core from the compute. Before Start;
  // called before each poll, so it must be cheap and thread-safe.
  void SetComputeBusy(std::function<bool()> busy) {
    compute_busy_ = std::move(busy);
  }

  // Registers the loop's generic service and completion queue; before the
  // builder's BuildAndStart.
  void AddTo(grpc::ServerBuilder& builder);

  // Starts polling on `threads` threads; after BuildAndStart. The first keeps
  // polling without sleeping for `spin` after each event it takes while events
  // come closer together than that, so that a client's next call is not
  // delayed by waking a thread (a cross-CPU wake-up costs tens of microseconds
  // in a VM); `spun` hears the time it spent so.
  void Start(int threads, absl::Duration spin = absl::ZeroDuration(),
             SpinObserver spun = nullptr);

  // Whether gRPC has stopped handing the loop new calls: its shutdown has
  // begun (and with it the GOAWAYs to every connection).
  bool stopped_taking_calls() const { return stopped_taking_calls_.load(); }

  // Calls whose handlers have not finished yet (an answer being sent, a
  // stream open).
  int live_calls() const {
    absl::MutexLock lock(&calls_mutex_);
    return live_calls_;
  }

  // Calls whose handlers have finished, since the start.
  int64_t calls_ended() const {
    absl::MutexLock lock(&calls_mutex_);
    return calls_ended_;
  }

  // How long every polling thread must have been busy in one turn before the
  // standby thread polls beside them, and how often it looks.
  static constexpr absl::Duration kStallBefore = absl::Milliseconds(20);
  static constexpr absl::Duration kStandbyPeriod = absl::Milliseconds(10);

  // Events the standby thread has handled since the start.
  int64_t standby_events() const { return standby_events_.load(); }

  // Stops polling, after the server's Shutdown has returned: waits (up to 5 s)
  // until the handlers of the calls it ended or cancelled have finished, then
  // shuts the queue down and drains it; a handler still holding a call after
  // that can no longer start operations on it. Idempotent.
  void Shutdown();

 private:
  friend class internal::CallSlot;

  // Asks gRPC for the next call.
  void RequestCall();
  // Count the calls whose handlers have not finished yet.
  void CallArrived();
  void CallEnded();
  // Tells the reset guard of a call from `peer` that ended cancelled, unless
  // its deadline had passed.
  void CallCancelled(const grpc::GenericServerContext& context,
                     const std::string& peer);
  // Tells the reset guard of an answer sent to `peer`: a call that finished
  // OK and ended uncancelled, or a message a stream wrote.
  void CallAnswered(const std::string& peer);
  // Makes the handler of a call from `peer` that has arrived, with what it
  // holds of the budget in `hold`: a refusal's if the budget is in use.
  std::unique_ptr<ServerCall> MakeCall(
      const grpc::GenericServerContext& context, const std::string& peer,
      MemoryBudget::Hold* hold) const;
  // What the standby thread sees of a polling thread: the turns it has
  // finished (polls that returned, handlers that ran) and its thread id, whose
  // state (running or waiting for a CPU, or asleep) /proc tells.
  struct Poller {
    std::atomic<uint64_t> turns{0};
    std::atomic<int> tid{0};
  };

  // Takes events until the queue is shut down; spins as Start says. Counts
  // its turns in `self` (none without).
  void Poll(Poller* self = nullptr, absl::Duration spin = absl::ZeroDuration(),
            const SpinObserver& spun = nullptr);
  // Hands one event that AsyncNext returned to its call.
  void Dispatch(void* tag, bool ok);
  // The standby thread: polls while every poller has been busy in one turn
  // for kStallBefore; returns at shutdown.
  void Standby();

  struct Method {
    Factory factory;
    Admission admission;
  };
  std::map<std::string, Method> methods_;
  MemoryBudget* budget_ = nullptr;
  ResetGuard* reset_guard_ = nullptr;
  std::function<bool()> compute_busy_;
  grpc::AsyncGenericService service_;
  std::unique_ptr<grpc::ServerCompletionQueue> queue_;
  std::vector<std::thread> threads_;
  std::vector<std::unique_ptr<Poller>> pollers_;  // One per thread, from Start.
  std::thread standby_;
  absl::Mutex standby_mutex_;
  bool standby_stop_ ABSL_GUARDED_BY(standby_mutex_) = false;
  std::atomic<int64_t> standby_events_{0};
  // Starting operations (shared) and shutting the queue down (exclusive).
  absl::Mutex queue_mutex_;
  bool shut_down_ ABSL_GUARDED_BY(queue_mutex_) = false;
  mutable absl::Mutex calls_mutex_;
  int live_calls_ ABSL_GUARDED_BY(calls_mutex_) = 0;
  int64_t calls_ended_ ABSL_GUARDED_BY(calls_mutex_) = 0;
  std::atomic<bool> stopped_taking_calls_{false};
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_CALL_LOOP_H_
