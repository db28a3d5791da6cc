// attnserve::AttendSession: one AttendStream call, many requests on one stream
// with their answers in order. Client::OpenAttendSession opens one:
//
// clang-format off
//   std::unique_ptr<attnserve::AttendSession> session =
//       client->OpenAttendSession(absl::Seconds(30));
//   ATTNSERVE_RETURN_IF_ERROR(session->Send(request));
//   ATTNSERVE_RETURN_IF_ERROR(session->CloseSend());
//   while (true) {
//     ATTNSERVE_ASSIGN_OR_RETURN(std::optional<attnserve::v1::AttendStreamResponse> answer,
//                                session->Receive());
//     if (!answer.has_value()) break;
//     ...  // answer->index(), then answer->response() or answer->error().
//   }
//   ATTNSERVE_RETURN_IF_ERROR(session->Finish());
// clang-format on
#ifndef ATTNSERVE_CLIENT_ATTEND_SESSION_H_
#define ATTNSERVE_CLIENT_ATTEND_SESSION_H_

#include <atomic>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/attention.grpc.pb.h"

namespace attnserve {

class Client;

// An AttendStream call. One thread may Send (and CloseSend) while another
// Receives; each method itself is not to be called from two threads at once.
// Finish and the destructor end the call: call them once both sides are done
// (after the sending thread's last Send or CloseSend and the receiving
// thread's last Receive have returned), never while another thread is inside
// Send or Receive (gRPC aborts on two reads at once, and the destructor frees
// what those calls use).
class AttendSession {
 public:
  AttendSession(const AttendSession&) = delete;
  AttendSession& operator=(const AttendSession&) = delete;
  ~AttendSession();  // Cancels the stream if it was not finished.

  // Sends one request. FAILED_PRECONDITION after CloseSend; UNAVAILABLE if the
  // stream broke (Finish then says why).
  absl::Status Send(const v1::AttendRequest& request);
  // Tells the server no more requests will come.
  absl::Status CloseSend();
  // The next answer, in the order of the requests; nullopt once the server has
  // answered all of them and closed the stream OK; the stream's error if it
  // ended otherwise (its deadline, the server going away).
  absl::StatusOr<std::optional<v1::AttendStreamResponse>> Receive();
  // Ends the call and returns its final status: tells the server no more
  // requests come (if CloseSend was not called), then drops the answers not
  // yet received as they arrive (the server answers every request it took
  // before it ends the stream); FAILED_PRECONDITION if called before. To end
  // a stream without waiting for those answers, destroy the session.
  absl::Status Finish();

 private:
  friend class Client;  // Client::OpenAttendSession is the way to open one.

  // Starts the stream on `stub` with `context` (its deadline and metadata).
  AttendSession(std::unique_ptr<grpc::ClientContext> context,
                v1::AttentionService::Stub& stub);

  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::AttendRequest, v1::AttendStreamResponse>>
      stream_;
  // Finishes the stream, whose last answer has been read, keeping its status;
  // `close_send` first tells the server no more requests come.
  void End(bool close_send);

  // Set once by CloseSend (or Finish): the sending thread and the one that
  // ends the call may both look at it.
  std::atomic<bool> send_closed_{false};
  bool ended_ = false;          // The stream is finished; final_status_ set.
  bool finish_called_ = false;  // By the caller.
  absl::Status final_status_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTEND_SESSION_H_
