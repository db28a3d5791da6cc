#include "attnserve/server/rpc/call_loop.h"

#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpc/support/time.h"

namespace attnserve {
namespace internal {

// One call, from the request for it to the end: the gRPC context and stream,
// the tags of its operations, and its handler once it has arrived. Deletes
// itself once the handler has finished and every operation has completed.
class CallSlot {
 public:
  enum class Op { kArrive, kRead, kWrite, kFinish, kDone };

  explicit CallSlot(CallLoop* loop) : loop_(loop) {
    for (int i = 0; i < kOps; ++i) {
      tags_[i] = Tag{this, static_cast<Op>(i)};
    }
    // gRPC delivers this tag when the call ends or is cancelled, and only for
    // a call that has arrived.
    context_.AsyncNotifyWhenDone(TagOf(Op::kDone));
  }

  // What the completion queue hands back.
  struct Tag {
    CallSlot* slot;
    Op op;
  };

  void Request(grpc::AsyncGenericService& service,
               grpc::ServerCompletionQueue* queue) {
    pending_.fetch_add(0);  // Publishes the slot; see Complete.
    service.RequestCall(&context_, &stream_, queue, queue, TagOf(Op::kArrive));
  }

  void Complete(Op op, bool ok) {
    // Every operation is started after an update of `pending_` (Request,
    // StartRead, StartWrite, Finish), and completes after it started: this
    // load orders what the starting thread did to the call (the handler it
    // made, the handler's state) before what this thread does, for the
    // memory model and for TSan, not only through gRPC's (uninstrumented)
    // completion queue.
    pending_.load(std::memory_order_acquire);
    bool cancel = false;
    switch (op) {
      case Op::kArrive:
        if (!ok) {  // The server is shutting down; the call never came.
          loop_->stopped_taking_calls_.store(true);
          delete this;
          return;
        }
        loop_->RequestCall();
        loop_->CallArrived();
        // Now, before any operation of the call can fail: gRPC forgets the
        // peer of a call one of whose operations failed (context().peer()
        // then says "unknown"), and the first operation of a call the client
        // reset before the loop took it fails.
        peer_ = context_.peer();
        handler_ = loop_->MakeCall(context_, peer_, &hold_);
        handler_->slot_ = this;
        handler_->OnStart();
        {
          absl::MutexLock lock(&arrival_mutex_);
          arrived_ = true;
          cancel = cancel_waiting_;
        }
        if (cancel) ReportCancel();
        break;
      case Op::kRead:
        handler_->OnReadDone(ok);
        break;
      case Op::kWrite:
        if (ok) loop_->CallAnswered(peer_);
        handler_->OnWriteDone(ok);
        break;
      case Op::kFinish:
        break;
      case Op::kDone:
        if (context_.IsCancelled()) {
          cancelled_.store(true);
          // Another thread may still be taking the arrival of this call: it
          // then reports the cancellation, once it has the peer.
          absl::MutexLock lock(&arrival_mutex_);
          cancel = arrived_;
          cancel_waiting_ = !arrived_;
        } else if (finished_ok_.load()) {
          // Only an arrived call ends uncancelled: the peer is set.
          loop_->CallAnswered(peer_);
        }
        if (cancel) ReportCancel();
        break;
    }
    Release();
  }

  grpc::GenericServerContext& context() { return context_; }
  const std::string& peer() const { return peer_; }
  bool cancelled() const { return cancelled_.load(); }

  void CancelStalled() {
    cancelled_by_server_.store(true);
    context_.TryCancel();
  }

  // Operations on a queue that has shut down would abort gRPC: they are not
  // started (the loop has given up on the call by then; see Shutdown).
  void StartRead(grpc::ByteBuffer* message) {
    absl::ReaderMutexLock lock(&loop_->queue_mutex_);
    if (loop_->shut_down_) return;
    pending_.fetch_add(1);
    stream_.Read(message, TagOf(Op::kRead));
  }

  void StartWrite(const grpc::ByteBuffer& message) {
    absl::ReaderMutexLock lock(&loop_->queue_mutex_);
    if (loop_->shut_down_) return;
    pending_.fetch_add(1);
    stream_.Write(message, TagOf(Op::kWrite));
  }

  // The finish operation carries the handler's count; the update of
  // `pending_` publishes what the finishing thread (often an executor) did
  // to the call, as for every operation (see Complete).
  void Finish(const grpc::Status& status) {
    absl::ReaderMutexLock lock(&loop_->queue_mutex_);
    if (loop_->shut_down_) return;
    finished_ok_.store(status.ok());
    pending_.fetch_add(0);
    stream_.Finish(status, TagOf(Op::kFinish));
  }

  void FinishWithMessage(const grpc::ByteBuffer& message,
                         const grpc::Status& status) {
    absl::ReaderMutexLock lock(&loop_->queue_mutex_);
    if (loop_->shut_down_) return;
    finished_ok_.store(status.ok());
    pending_.fetch_add(0);
    stream_.WriteAndFinish(message, grpc::WriteOptions(), status,
                           TagOf(Op::kFinish));
  }

 private:
  static constexpr int kOps = 5;

  void* TagOf(Op op) { return &tags_[static_cast<int>(op)]; }

  // A cancel the client (not the server's CancelStalled) made counts toward
  // its connection's resets; the handler hears of every one.
  void ReportCancel() {
    if (!cancelled_by_server_.load()) loop_->CallCancelled(context_, peer_);
    handler_->OnCancel();
  }

  void Release() {
    if (pending_.fetch_sub(1) != 1) return;
    handler_->OnDone();
    handler_.reset();
    hold_.Reset();
    loop_->CallEnded();
    delete this;
  }

  CallLoop* const loop_;
  Tag tags_[kOps];
  grpc::GenericServerContext context_;
  grpc::GenericServerAsyncReaderWriter stream_{&context_};
  std::unique_ptr<ServerCall> handler_;  // Set on arrival.
  std::string peer_;                     // Set on arrival.
  MemoryBudget::Hold hold_;  // The call's share of the budget, from arrival.
  // One count until the handler finishes, one until gRPC reports the call
  // done, one for OnStart (released after it), during which the call may
  // already finish on another thread; one per read or write in flight.
  std::atomic<int> pending_{3};
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> cancelled_by_server_{false};  // CancelStalled.
  // Finished OK: an answer, for the reset guard (a refusal costs a client
  // nothing, and is none).
  std::atomic<bool> finished_ok_{false};
  // gRPC may hand one thread the call's cancellation while another takes its
  // arrival: OnCancel then waits until OnStart has returned.
  absl::Mutex arrival_mutex_;
  bool arrived_ ABSL_GUARDED_BY(arrival_mutex_) = false;
  bool cancel_waiting_ ABSL_GUARDED_BY(arrival_mutex_) = false;
};

}  // namespace internal

namespace {

// Answers a method the server does not serve, as gRPC would.
class UnimplementedCall final : public ServerCall {
 private:
  void OnStart() override {
    Finish(grpc::Status(
        grpc::StatusCode::UNIMPLEMENTED,
        absl::StrCat("method ", context().method(),
                     " is not served here; `attnctl services` lists those "
                     "that are")));
  }
};

// Answers a call the memory budget has no room for.
class RefusedCall final : public ServerCall {
 public:
  explicit RefusedCall(grpc::Status status) : status_(std::move(status)) {}

 private:
  void OnStart() override { Finish(status_); }

  const grpc::Status status_;
};

// Calls started in advance, so that a burst of arriving calls does not wait
// for the loop to ask for each.
constexpr int kCallsRequested = 32;

// How long Shutdown waits for the handlers of cancelled calls to finish.
constexpr absl::Duration kFinishTimeout = absl::Seconds(5);

}  // namespace

bool DeadlinePassed(const grpc::ServerContextBase& context) {
  return DeadlineWithin(context, absl::ZeroDuration());
}

bool DeadlineWithin(const grpc::ServerContextBase& context,
                    absl::Duration slack) {
  const gpr_timespec deadline = context.raw_deadline();
  const gpr_timespec horizon = gpr_time_add(
      gpr_now(deadline.clock_type),
      gpr_time_from_micros(absl::ToInt64Microseconds(slack), GPR_TIMESPAN));
  return gpr_time_cmp(deadline, horizon) < 0;
}

grpc::GenericServerContext& ServerCall::context() const {
  return slot_->context();
}

const std::string& ServerCall::peer() const { return slot_->peer(); }

bool ServerCall::cancelled() const { return slot_->cancelled(); }

void ServerCall::CancelStalled() { slot_->CancelStalled(); }

void ServerCall::StartRead(grpc::ByteBuffer* message) {
  slot_->StartRead(message);
}

void ServerCall::StartWrite(const grpc::ByteBuffer& message) {
  slot_->StartWrite(message);
}

void ServerCall::Finish(const grpc::Status& status) { slot_->Finish(status); }

void ServerCall::FinishWithMessage(const grpc::ByteBuffer& message,
                                   const grpc::Status& status) {
  slot_->FinishWithMessage(message, status);
}

CallLoop::CallLoop() = default;

CallLoop::~CallLoop() { Shutdown(); }

void CallLoop::Handle(const std::string& method, Factory factory,
                      Admission admission) {
  methods_[method] = Method{std::move(factory), admission};
}

void CallLoop::AddTo(grpc::ServerBuilder& builder) {
  builder.RegisterAsyncGenericService(&service_);
  queue_ = builder.AddCompletionQueue();
}

void CallLoop::Start(int threads, absl::Duration spin, SpinObserver spun) {
  for (int i = 0; i < kCallsRequested; ++i) RequestCall();
  if (threads < 1) return;
  for (int i = 0; i < threads; ++i) {
    pollers_.push_back(std::make_unique<Poller>());
  }
  threads_.emplace_back([this, spin, spun = std::move(spun)] {
    Poll(pollers_[0].get(), spin, spun);
  });
  for (int i = 1; i < threads; ++i) {
    threads_.emplace_back([this, i] { Poll(pollers_[i].get()); });
  }
  standby_ = std::thread([this] { Standby(); });
}

void CallLoop::Shutdown() {
  {
    absl::ReaderMutexLock lock(&queue_mutex_);
    if (queue_ == nullptr || shut_down_) return;
  }
  // The server has shut down, so every call has ended or been cancelled and
  // its handler finishes promptly: the threads keep polling until then.
  {
    absl::MutexLock lock(&calls_mutex_);
    calls_mutex_.AwaitWithTimeout(
        absl::Condition(
            +[](int* live) { return *live == 0; }, &live_calls_),
        kFinishTimeout);
  }
  {
    absl::WriterMutexLock lock(&queue_mutex_);
    shut_down_ = true;
    queue_->Shutdown();
  }
  {
    absl::MutexLock lock(&standby_mutex_);
    standby_stop_ = true;
  }
  if (standby_.joinable()) standby_.join();
  for (std::thread& thread : threads_) thread.join();
  threads_.clear();
  Poll();  // Without threads (Start never called) the queue still needs it.
}

void CallLoop::CallArrived() {
  absl::MutexLock lock(&calls_mutex_);
  ++live_calls_;
}

void CallLoop::CallEnded() {
  absl::MutexLock lock(&calls_mutex_);
  --live_calls_;
  ++calls_ended_;
}

void CallLoop::CallCancelled(const grpc::GenericServerContext& context,
                             const std::string& peer) {
  if (reset_guard_ == nullptr || DeadlinePassed(context)) return;
  reset_guard_->ClientCancelled(peer);
}

void CallLoop::CallAnswered(const std::string& peer) {
  if (reset_guard_ != nullptr) reset_guard_->Answered(peer);
}

void CallLoop::RequestCall() {
  absl::ReaderMutexLock lock(&queue_mutex_);
  if (shut_down_) return;
  (new internal::CallSlot(this))->Request(service_, queue_.get());
}

std::unique_ptr<ServerCall> CallLoop::MakeCall(
    const grpc::GenericServerContext& context, const std::string& peer,
    MemoryBudget::Hold* hold) const {
  const auto found = methods_.find(context.method());
  const Admission admission =
      found == methods_.end() ? Admission::kBudgeted : found->second.admission;
  if (budget_ != nullptr) {
    if (admission == Admission::kAlways) {
      *hold = budget_->TakeAlways(kBytesPerCall, peer);
    } else {
      absl::StatusOr<MemoryBudget::Hold> taken =
          budget_->Take(kBytesPerCall, peer);
      if (!taken.ok()) {
        return std::make_unique<RefusedCall>(
            grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                         std::string(taken.status().message())));
      }
      *hold = *std::move(taken);
    }
  }
  if (found == methods_.end()) return std::make_unique<UnimplementedCall>();
  return found->second.factory();
}

void CallLoop::Poll(Poller* self, absl::Duration spin,
                    const SpinObserver& spun) {
  if (self != nullptr) self->tid.store(static_cast<int>(syscall(SYS_gettid)));
  const auto turn_done = [self] {
    if (self != nullptr) self->turns.fetch_add(1, std::memory_order_release);
  };
  using Clock = std::chrono::steady_clock;
  const Clock::duration spin_for = absl::ToChronoNanoseconds(spin);
  // Spinning pays while events come closer together than `spin`: it starts
  // when one arrives within `spin` of the previous one's handling, and stops
  // when `spin` passes without one (sparse traffic does not keep a core busy),
  // and pauses while a compute runs: on a machine whose cores the compute's
  // threads fill, a spinning poller would slow the very call it waits on
  // (measured on a 2-vCPU Xeon: a 4,096-token decode Step computed in 1.21 ms
  // with the spin, 1.02 ms without, medians). The compute's answer is an event,
  // which wakes this thread to spin for the client's next call.
  bool spin_pays = false;
  bool spun_idle = false;  // Some of this idle time was spent polling.
  Clock::time_point idle_since = Clock::now();
  const auto report_spin = [&](Clock::time_point now) {
    if (spun_idle && spun) spun(absl::FromChrono(now - idle_since));
    spun_idle = false;
  };
  void* tag;
  bool ok;
  for (;;) {
    const Clock::time_point now = Clock::now();
    const bool spinning = spin_pays && now - idle_since < spin_for &&
                          !(compute_busy_ && compute_busy_());
    if (!spinning) report_spin(now);
    // A deadline in the past polls once without sleeping.
    const grpc::CompletionQueue::NextStatus status =
        queue_->AsyncNext(&tag, &ok,
                          spinning ? gpr_time_0(GPR_CLOCK_MONOTONIC)
                                   : gpr_inf_future(GPR_CLOCK_MONOTONIC));
    turn_done();
    if (status == grpc::CompletionQueue::SHUTDOWN) return;
    if (status == grpc::CompletionQueue::TIMEOUT) {
      spun_idle = true;
      continue;
    }
    const Clock::time_point arrived = Clock::now();
    report_spin(arrived);
    spin_pays = arrived - idle_since < spin_for;
    Dispatch(tag, ok);
    turn_done();
    idle_since = Clock::now();
  }
}

void CallLoop::Dispatch(void* tag, bool ok) {
  auto* done = static_cast<internal::CallSlot::Tag*>(tag);
  done->slot->Complete(done->op, ok);
}

namespace {

// Reads a thread's state from its /proc/self/task/TID/stat, kept open.
class ThreadState {
 public:
  ThreadState() = default;
  ThreadState(const ThreadState&) = delete;
  ThreadState& operator=(const ThreadState&) = delete;
  ~ThreadState() {
    if (fd_ >= 0) close(fd_);
  }

  // Whether thread `tid` is running or waiting for a CPU (state R); false if
  // it is asleep or cannot be read.
  bool Running(int tid) {
    if (tid != tid_) {
      if (fd_ >= 0) close(fd_);
      const std::string path = absl::StrCat("/proc/self/task/", tid, "/stat");
      fd_ = open(path.c_str(), O_RDONLY | O_CLOEXEC);
      tid_ = tid;
    }
    if (fd_ < 0) return false;
    // "TID (COMM) S ...": COMM may hold spaces and parentheses, the state
    // follows the last ')'.
    char text[512];
    const ssize_t length = pread(fd_, text, sizeof(text) - 1, 0);
    if (length <= 0) return false;
    const absl::string_view stat(text, static_cast<size_t>(length));
    const size_t paren = stat.rfind(')');
    return paren != absl::string_view::npos && paren + 2 < stat.size() &&
           stat[paren + 2] == 'R';
  }

 private:
  int tid_ = 0;
  int fd_ = -1;
};

}  // namespace

void CallLoop::Standby() {
  // What the standby knows of each poller: its turns when it last moved on
  // (or was seen asleep), and since when.
  struct Watch {
    ThreadState state;
    uint64_t turns = 0;
    absl::Time held_since = absl::Now();
  };
  std::vector<Watch> watches(pollers_.size());
  const auto still_held = [&] {
    for (size_t i = 0; i < watches.size(); ++i) {
      if (pollers_[i]->turns.load(std::memory_order_acquire) !=
          watches[i].turns) {
        return false;
      }
    }
    return true;
  };
  for (;;) {
    {
      absl::MutexLock lock(&standby_mutex_);
      if (standby_mutex_.AwaitWithTimeout(absl::Condition(&standby_stop_),
                                          kStandbyPeriod)) {
        return;
      }
    }
    const absl::Time now = absl::Now();
    bool every_one_held = true;
    for (size_t i = 0; i < watches.size(); ++i) {
      Watch& watch = watches[i];
      const uint64_t seen = pollers_[i]->turns.load(std::memory_order_acquire);
      // A poller asleep in its poll is not held, however long the poll.
      if (seen != watch.turns ||
          !watch.state.Running(pollers_[i]->tid.load())) {
        watch.turns = seen;
        watch.held_since = now;
      }
      every_one_held = every_one_held && now - watch.held_since >= kStallBefore;
    }
    if (!every_one_held) continue;
    // Poll beside them until one of them has finished its turn (which the
    // next look then sees).
    while (still_held()) {
      void* tag;
      bool ok;
      const grpc::CompletionQueue::NextStatus status =
          queue_->AsyncNext(&tag, &ok,
                            std::chrono::system_clock::now() +
                                absl::ToChronoNanoseconds(kStandbyPeriod));
      if (status == grpc::CompletionQueue::SHUTDOWN) return;
      if (status == grpc::CompletionQueue::GOT_EVENT) {
        standby_events_.fetch_add(1);
        Dispatch(tag, ok);
      }
    }
  }
}

}  // namespace attnserve
