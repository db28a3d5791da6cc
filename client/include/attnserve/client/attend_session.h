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

#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/attention.grpc.pb.h"

namespace attnserve {

class Client;

// An AttendStream call. One thread may Send while another Receives; each method
// itself is not to be called from two threads at once.
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
  // Ends the call (answers not yet received are dropped) and returns its
  // final status; FAILED_PRECONDITION if called before.
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

  bool send_closed_ = false;
  bool ended_ = false;          // The stream is finished; final_status_ set.
  bool finish_called_ = false;  // By the caller.
  absl::Status final_status_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTEND_SESSION_H_
