#include "attnserve/client/attend_session.h"

#include <utility>

#include "grpc_status.h"
#include "grpcpp/grpcpp.h"

namespace attnserve {

AttendSession::AttendSession(std::unique_ptr<grpc::ClientContext> context,
                             v1::AttentionService::Stub& stub)
    : context_(std::move(context)),
      stream_(stub.AttendStream(context_.get())) {}

AttendSession::~AttendSession() {
  if (!ended_) {
    context_->TryCancel();
    stream_->Finish();
  }
}

absl::Status AttendSession::Send(const v1::AttendRequest& request) {
  if (send_closed_) {
    return absl::FailedPreconditionError(
        "Send after CloseSend on an AttendSession");
  }
  if (!stream_->Write(request)) {
    return absl::UnavailableError("the AttendStream broke; Finish says why");
  }
  return absl::OkStatus();
}

absl::Status AttendSession::CloseSend() {
  // Once: a second WritesDone aborts in gRPC.
  if (send_closed_.exchange(true)) return absl::OkStatus();
  if (!stream_->WritesDone()) {
    return absl::UnavailableError("the AttendStream broke; Finish says why");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<v1::AttendStreamResponse>>
AttendSession::Receive() {
  if (!ended_) {
    v1::AttendStreamResponse answer;
    if (stream_->Read(&answer))
      return std::optional<v1::AttendStreamResponse>(std::move(answer));
    // Another thread may be sending: the write side is left alone (Finish
    // itself says no more will come).
    End(/*close_send=*/false);
  }
  // Past the last answer: nullopt if the stream ended OK, else why it did not.
  if (!final_status_.ok()) return final_status_;
  return std::optional<v1::AttendStreamResponse>();
}

absl::Status AttendSession::Finish() {
  if (finish_called_) {
    return absl::FailedPreconditionError("Finish called twice");
  }
  finish_called_ = true;
  if (!ended_) {
    // The server ends the stream once it has answered every request and
    // knows no more come: without the close, this read waited for the
    // call's deadline (or the server's idle timeout).
    CloseSend().IgnoreError();
    v1::AttendStreamResponse unread;
    while (stream_->Read(&unread)) {
    }
    End(/*close_send=*/true);
  }
  return final_status_;
}

void AttendSession::End(bool close_send) {
  ended_ = true;
  if (close_send) CloseSend().IgnoreError();
  final_status_ = FromGrpcStatus(stream_->Finish());
}

}  // namespace attnserve
