// Requests parsed and responses serialised by the service itself rather than by
// gRPC's generated handlers, so that bytes that are not a valid request are
// answered like any other malformed request: INVALID_ARGUMENT naming the
// message type. (gRPC 1.51's generated callback handlers answer an unparsable
// unary request UNIMPLEMENTED with an empty message, and an unparsable message
// on a stream reads as the client closing its side.)
//
//   auto* reactor = new WireUnaryReactor<v1::AttendRequest,
//   v1::AttendResponse>; absl::Status parsed = ParseWire(wire_request,
//   &reactor->request);
//   ...
//   absl::Status serialised = SerializeWire(reactor->response, wire_response);
//   reactor->Finish(...);  // Deletes itself, request and response, when done.
#ifndef ATTNSERVE_SERVER_WIRE_MESSAGES_H_
#define ATTNSERVE_SERVER_WIRE_MESSAGES_H_

#include "absl/status/status.h"
#include "google/protobuf/message.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"

namespace attnserve {

// Parses `wire` into `message`, consuming the bytes (`wire` is left empty, so a
// request is not held twice). INVALID_ARGUMENT naming the message type and the
// byte count when the bytes are not a valid message (truncated, not protobuf
// wire format, a string that is not UTF-8).
absl::Status ParseWire(grpc::ByteBuffer* wire,
                       google::protobuf::Message* message);

// Serialises `message` into `wire`. INTERNAL if protobuf cannot (a message over
// 2 GiB, which the response size limits rule out).
absl::Status SerializeWire(const google::protobuf::Message& message,
                           grpc::ByteBuffer* wire);

// The reactor of one unary call; it owns the call's request and response until
// gRPC is done with the call, then deletes itself. Thread-compatible: the
// handler and the job that answers the call hand it over, never share it.
template <typename Request, typename Response>
class WireUnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  Request request;
  Response response;

  void OnDone() override { delete this; }
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_WIRE_MESSAGES_H_
