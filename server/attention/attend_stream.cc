#include "attnserve/server/attention/attend_stream.h"

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnserve/server/rpc/grpc_status.h"
#include "attnserve/server/rpc/inflate.h"
#include "attnserve/server/rpc/memory_budget.h"
#include "attnserve/server/rpc/wire_messages.h"

namespace attnserve {
namespace {

constexpr char kDrainReason[] = "the server is shutting down";

class AttendStreamCall final : public ServerCall, public OpenStreams::Stream {
 public:
  explicit AttendStreamCall(const StreamDependencies& deps) : deps_(deps) {}

  // The drain: no more messages are taken; the stream ends UNAVAILABLE once
  // the answers to those taken are written (at once if there are none, with
  // the read of the next one in flight). Advance picks the status: OK for a
  // client that had closed its side, CANCELLED for one gone.
  void End(const std::string& reason) override {
    {
      absl::MutexLock lock(&mutex_);
      if (finished_) return;
      drain_reason_ = reason;
    }
    Advance();
  }

 private:
  // A refusal at the end of a drain is held by the gate (call_gate.h).
  void OnStart() override {
    const absl::Status admitted = deps_.gate->Admit(context());
    if (!admitted.ok()) {
      // Counted as one request, so that refusals of streams (a wrong token,
      // a drain) show beside the unary calls'.
      deps_.compute.metrics->CallStarted(Rpc::kAttendStream, 0);
      deps_.compute.metrics->CallFinished(Rpc::kAttendStream, admitted.code(),
                                          absl::ZeroDuration(), 0);
      if (deps_.access_log != nullptr) {  // A line without a stream_index.
        AccessRecord record;
        record.time = absl::Now();
        record.rpc = RpcName(Rpc::kAttendStream);
        record.status = admitted;
        record.peer = peer();
        deps_.access_log->Write(record);
      }
      held_ = deps_.gate->HoldRefusal(
          [this, admitted] { Finish(ToGrpcStatus(admitted)); });
      if (!held_) Finish(ToGrpcStatus(admitted));
      return;
    }
    if (deps_.open_streams != nullptr) {
      registered_ = true;
      deps_.open_streams->Add(this);
    }
    identity_ = deps_.gate->Identity(context());
    Read();
  }

  void OnDone() override {
    if (registered_) deps_.open_streams->Remove(this);
  }

  void OnCancel() override {
    // Its messages still queued are answered now, their places and memory
    // freed; the loop's hold on the call keeps it alive meanwhile.
    deps_.compute.scheduler->DropAbandoned();
    if (held_) {
      if (deps_.gate->Unhold(*held_)) {
        Finish(grpc::Status(grpc::StatusCode::CANCELLED,
                            "the call was cancelled while the server was "
                            "shutting down"));
      }
      return;
    }
    // Reading paused (answers not taken): no read is in flight to fail, so
    // reading is over here, or the call would never finish and would hold
    // its budget until the process exits.
    bool paused;
    {
      absl::MutexLock lock(&mutex_);
      paused = read_paused_ && !reading_done_;
      if (paused) reading_done_ = true;
    }
    if (paused) Advance();
  }

  // Reads the next message, watched: a stream whose next message has not come
  // within stream_idle_timeout is cancelled. Under the lock, so that no read
  // starts after End has finished the call.
  void Read() {
    absl::MutexLock lock(&mutex_);
    if (finished_ || !drain_reason_.empty()) return;
    read_ticket_ = deps_.watchdog->Watch(this);
    StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    deps_.watchdog->Unwatch(read_ticket_);
    bool draining;
    {
      absl::MutexLock lock(&mutex_);
      draining = !drain_reason_.empty();
      // Until it is among the slots, End must not finish the call under it.
      if (ok && !draining) ++taking_;
    }
    if (ok && draining) {
      // A message read after the drain began is not taken: the stream's
      // status tells the client to send it again elsewhere.
      incoming_.Clear();
      Advance();
      return;
    }
    if (!ok) {
      {
        absl::MutexLock lock(&mutex_);
        reading_done_ = true;
      }
      Advance();
      return;
    }
    auto slot = std::make_shared<Slot>();
    slot->started = absl::Now();
    slot->request_bytes = static_cast<int64_t>(incoming_.Length());
    deps_.compute.metrics->CallStarted(Rpc::kAttendStream, slot->request_bytes);
    // A message that is not an AttendRequest, that inflates past the message
    // limit, or that the memory budget has no room for, fails only its own
    // answer.
    absl::StatusOr<MemoryBudget::Hold> held =
        AdmitMessage(deps_.transport, *deps_.budget, peer(), &incoming_);
    absl::Status parsed = held.status();
    if (held.ok()) {
      slot->hold = *std::move(held);
      parsed = ParseWire(&incoming_, &slot->request);
    }
    incoming_.Clear();
    absl::StatusOr<AttendWork> work =
        parsed.ok() ? ValidateAttendRequest(slot->request, deps_.checks)
                    : absl::StatusOr<AttendWork>(parsed);
    if (work.ok()) {
      const absl::Status compute_held = slot->hold.Grow(work->memory_bytes);
      if (!compute_held.ok()) work = compute_held;
    }
    bool read_more;
    {
      absl::MutexLock lock(&mutex_);
      --taking_;
      slot->answer.set_index(next_index_++);
      slots_.push_back(slot);
      if (work.ok()) ++computing_;
      read_more = static_cast<int>(slots_.size()) < kMaxPendingPerStream;
      read_paused_ = !read_more;
    }
    if (work.ok()) {
      Compute(slot, *std::move(work));
    } else {
      Resolve(*slot, work.status());
      Advance();
    }
    if (read_more) Read();
  }

  void OnWriteDone(bool ok) override {
    deps_.watchdog->Unwatch(write_ticket_);
    bool resume_reading = false;
    {
      absl::MutexLock lock(&mutex_);
      writing_ = false;
      // An OK answer, counted when it was resolved, that did not go out.
      if (!ok && !slots_.front()->answer.has_error()) {
        deps_.compute.metrics->AnswerNotDelivered(Rpc::kAttendStream);
      }
      slots_.pop_front();
      if (!ok) broken_ = true;
      if (read_paused_ && !reading_done_) {
        if (broken_) {
          reading_done_ = true;  // No read in flight, and none will start.
        } else if (drain_reason_.empty()) {
          read_paused_ = false;
          resume_reading = true;
        }
      }
    }
    if (resume_reading) Read();
    Advance();
  }

  struct Slot {
    v1::AttendRequest request;
    v1::AttendStreamResponse answer;
    grpc::ByteBuffer wire_answer;  // `answer` serialised, while it is written.
    absl::Time started;
    int64_t request_bytes = 0;  // On the wire.
    bool ready = false;
    MemoryBudget::Hold hold;  // Given back when the slot goes, once written.
  };

  // A message's side of its compute job.
  class SlotCaller final : public ComputeCaller {
   public:
    SlotCaller(AttendStreamCall* stream, std::shared_ptr<Slot> slot)
        : stream_(stream), slot_(std::move(slot)) {}

    // As a unary call's: a passed deadline (or a cancel within
    // kDeadlineSlack of it) is the deadline's, for the answer and the
    // metrics.
    absl::Status StillWanted() const override {
      const bool cancelled = stream_->cancelled();
      if (DeadlineWithin(stream_->context(),
                         cancelled ? kDeadlineSlack : absl::ZeroDuration())) {
        return absl::DeadlineExceededError(
            "the stream's deadline passed before the compute started");
      }
      if (cancelled) return absl::CancelledError("the stream was cancelled");
      return absl::OkStatus();
    }

    std::string client() const override {
      return QueueClient(stream_->identity_, stream_->peer());
    }

    void Computed(const absl::Status& status) override {
      stream_->Resolve(*slot_, status);
      // The count drops inside Advance's critical section: once it is 0
      // another thread may finish the call and free the stream, so nothing
      // may touch it after that section.
      stream_->Advance(/*computes_done=*/1);
    }

   private:
    AttendStreamCall* const stream_;
    const std::shared_ptr<Slot> slot_;
  };

  // Runs the request through the compute path unary Attends take (batched
  // with them where alike); its answer becomes ready when done.
  void Compute(std::shared_ptr<Slot> slot, AttendWork work) {
    v1::AttendResponse* response = slot->answer.mutable_response();
    const v1::AttendRequest* request = &slot->request;
    const absl::Time started = slot->started;
    ComputeJob::Submit(ComputeJob::ForAttend(
        deps_.compute, Rpc::kAttendStream,
        std::make_shared<SlotCaller>(this, std::move(slot)), started,
        std::move(work), request, response));
  }

  // Fills the slot's answer with `status` (keeping the response if OK), records
  // it, marks it ready.
  void Resolve(Slot& slot, const absl::Status& computed) {
    absl::Status status = computed;
    bool broken;
    {
      absl::MutexLock lock(&mutex_);
      broken = broken_;
    }
    if (status.ok() && (broken || cancelled())) {
      // Computed for a client gone meanwhile: nothing will be written, so
      // nothing is counted as sent.
      status = DeadlineWithin(context(), kDeadlineSlack)
                   ? absl::DeadlineExceededError(
                         "the stream's deadline passed before the answer was "
                         "written (its work was done)")
                   : absl::CancelledError(
                         "the stream ended before the answer was written "
                         "(its work was done)");
    }
    if (!status.ok()) {
      slot.answer.clear_response();
      slot.answer.mutable_error()->set_code(static_cast<int>(status.code()));
      slot.answer.mutable_error()->set_message(std::string(status.message()));
    }
    const absl::Time now = absl::Now();
    const int64_t response_bytes =
        status.ok() ? static_cast<int64_t>(slot.answer.ByteSizeLong()) : 0;
    deps_.compute.metrics->CallFinished(Rpc::kAttendStream, status.code(),
                                        now - slot.started, response_bytes);
    if (deps_.access_log != nullptr) {
      AccessRecord record;
      record.time = now;
      record.rpc = RpcName(Rpc::kAttendStream);
      record.status = status;
      record.peer = peer();
      record.identity = identity_;
      record.stream_index = slot.answer.index();
      record.request_bytes = slot.request_bytes;
      record.response_bytes = response_bytes;
      record.server = now - slot.started;
      if (status.ok()) {
        record.queue_us = slot.answer.response().timing().queue_us();
        record.compute_us = slot.answer.response().timing().compute_us();
      }
      deps_.access_log->Write(record);
    }
    absl::MutexLock lock(&mutex_);
    slot.ready = true;
  }

  // Serialises a ready answer for writing; an answer protobuf cannot serialise
  // (none the size limits let through) becomes its error.
  static void Serialize(Slot& slot) {
    const absl::Status serialized =
        SerializeWire(&slot.answer, &slot.wire_answer);
    if (serialized.ok()) return;
    slot.answer.clear_response();
    slot.answer.mutable_error()->set_code(static_cast<int>(serialized.code()));
    slot.answer.mutable_error()->set_message(std::string(serialized.message()));
    // An error answer is small enough to serialise.
    SerializeWire(&slot.answer, &slot.wire_answer).IgnoreError();
  }

  // Writes the next answer if it is ready and no write is in flight; finishes
  // the call once everything is answered. gRPC operations start outside the
  // lock. `computes_done` computes have just ended.
  void Advance(int computes_done = 0) {
    Slot* to_write = nullptr;
    bool finish = false;
    grpc::Status final_status = grpc::Status::OK;
    {
      absl::MutexLock lock(&mutex_);
      computing_ -= computes_done;
      if (broken_) {
        // The client is gone: drop answers as they become ready. An OK one
        // was counted when it was resolved (before the stream broke).
        while (!writing_ && !slots_.empty() && slots_.front()->ready) {
          if (!slots_.front()->answer.has_error()) {
            deps_.compute.metrics->AnswerNotDelivered(Rpc::kAttendStream);
          }
          slots_.pop_front();
        }
      } else if (!writing_ && !slots_.empty() && slots_.front()->ready) {
        writing_ = true;
        to_write = slots_.front().get();
      }
      const bool draining = !drain_reason_.empty();
      if ((reading_done_ || draining) && slots_.empty() && computing_ == 0 &&
          taking_ == 0 && !writing_ && !finished_) {
        finished_ = finish = true;
        if (broken_ || cancelled()) {
          final_status = grpc::Status(
              grpc::StatusCode::CANCELLED,
              "the client went away before every answer was written");
        } else if (draining && !reading_done_) {
          final_status = DrainStatusLocked();
        }
      }
    }
    if (to_write != nullptr) {
      Serialize(*to_write);
      // An answer the client does not take within the idle timeout cancels
      // the stream: it would otherwise hold every answer after it, and the
      // messages behind them, for as long as the connection lives.
      write_ticket_ = deps_.watchdog->Watch(
          this, SendAllowance(to_write->wire_answer.Length()));
      StartWrite(to_write->wire_answer);
    }
    if (finish) Finish(final_status);
  }

  // UNAVAILABLE, naming the first message not taken.
  grpc::Status DrainStatusLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    return grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        absl::StrCat(drain_reason_, ": this stream took ", next_index_,
                     " messages (indexes below ", next_index_,
                     ") and answered each; send the rest again on a new "
                     "stream"));
  }

  const StreamDependencies deps_;
  std::optional<CallGate::Ticket> held_;  // Set in OnStart only.
  bool registered_ = false;               // With open_streams; set in OnStart.
  std::string identity_;  // The caller's, for the queue and the access log;
                          // set in OnStart.
  grpc::ByteBuffer incoming_;  // Only the read in flight touches it.
  TransferWatchdog::Ticket read_ticket_ = 0;   // The read in flight's.
  TransferWatchdog::Ticket write_ticket_ = 0;  // The write in flight's.

  absl::Mutex mutex_;
  std::deque<std::shared_ptr<Slot>> slots_
      ABSL_GUARDED_BY(mutex_);  // Unanswered, in order.
  int64_t next_index_ ABSL_GUARDED_BY(mutex_) = 0;
  int computing_ ABSL_GUARDED_BY(mutex_) = 0;
  int taking_ ABSL_GUARDED_BY(mutex_) = 0;  // Messages read, not yet slots.
  bool reading_done_ ABSL_GUARDED_BY(mutex_) = false;
  bool read_paused_ ABSL_GUARDED_BY(mutex_) = false;
  bool writing_ ABSL_GUARDED_BY(mutex_) = false;
  bool broken_ ABSL_GUARDED_BY(mutex_) = false;
  bool finished_ ABSL_GUARDED_BY(mutex_) = false;
  // Why the stream takes no more messages: set by End (the drain).
  std::string drain_reason_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace

void OpenStreams::Add(Stream* stream) {
  bool ended;
  {
    absl::MutexLock lock(&mutex_);
    streams_.insert(stream);
    ended = ended_;
  }
  if (ended) stream->End(kDrainReason);
}

void OpenStreams::Remove(Stream* stream) {
  absl::MutexLock lock(&mutex_);
  streams_.erase(stream);
}

void OpenStreams::EndAll() {
  // Under the lock: a stream removes itself before it is deleted.
  absl::MutexLock lock(&mutex_);
  ended_ = true;
  for (Stream* stream : streams_) stream->End(kDrainReason);
}

std::unique_ptr<ServerCall> MakeAttendStreamCall(
    const StreamDependencies& dependencies) {
  return std::make_unique<AttendStreamCall>(dependencies);
}

}  // namespace attnserve
