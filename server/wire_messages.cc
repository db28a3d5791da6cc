#include "wire_messages.h"

#include "absl/strings/str_cat.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace attnserve {

absl::Status ParseWire(grpc::ByteBuffer* wire,
                       google::protobuf::Message* message) {
  const size_t bytes = wire->Length();
  bool parsed = false;
  {
    grpc::ProtoBufferReader reader(wire);
    parsed = reader.status().ok() && message->ParseFromZeroCopyStream(&reader);
  }
  wire->Clear();
  if (parsed) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the request is not a valid ", message->GetDescriptor()->full_name(),
      ": its ", bytes,
      " bytes could not be parsed (truncated, not protobuf wire format, or a "
      "string field that is not UTF-8)"));
}

absl::Status SerializeWire(const google::protobuf::Message& message,
                           grpc::ByteBuffer* wire) {
  bool own_buffer = false;
  const grpc::Status status =
      grpc::SerializationTraits<google::protobuf::Message>::Serialize(
          message, wire, &own_buffer);
  if (status.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("could not serialise the ",
                                          message.GetDescriptor()->full_name(),
                                          " answer: ", status.error_message()));
}

}  // namespace attnserve
