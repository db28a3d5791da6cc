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
  if (!finished_) {
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
  if (send_closed_) return absl::OkStatus();
  send_closed_ = true;
  if (!stream_->WritesDone()) {
    return absl::UnavailableError("the AttendStream broke; Finish says why");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<v1::AttendStreamResponse>>
AttendSession::Receive() {
  v1::AttendStreamResponse answer;
  if (stream_->Read(&answer))
    return std::optional<v1::AttendStreamResponse>(std::move(answer));
  return std::optional<v1::AttendStreamResponse>();
}

absl::Status AttendSession::Finish() {
  if (finished_) return absl::FailedPreconditionError("Finish called twice");
  finished_ = true;
  if (!send_closed_) CloseSend().IgnoreError();
  v1::AttendStreamResponse unread;
  while (stream_->Read(&unread)) {
  }
  return FromGrpcStatus(stream_->Finish());
}

}  // namespace attnserve
