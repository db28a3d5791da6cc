// Requests parsed and responses serialised by the service itself rather than by
// gRPC's generated handlers, so that bytes that are not a valid request are
// answered like any other malformed request: INVALID_ARGUMENT naming the
// message type. (gRPC 1.51's generated callback handlers answer an unparsable
// unary request UNIMPLEMENTED with an empty message, and an unparsable message
// on a stream reads as the client closing its side.)
//
// With a BytesPool, the tensors' bytes (the `data` of the message's own Tensor
// fields, and the entries of its own repeated bytes fields: the Open Inference
// Protocol's raw_input_contents and raw_output_contents) are parsed into kept
// memory, and a response's are sent without a copy: the wire refers to them,
// and they go back to the pool once gRPC has sent them.
//
//   absl::Status parsed = ParseWire(&wire_request, &request, pool.get());
//   ...
//   absl::Status serialised = SerializeWire(&response, &wire_response, pool);
//   ...  // Once the call is done:
//   GiveTensorBytes(&request, pool.get());
//   GiveTensorBytes(&response, pool.get());
#ifndef ATTNSERVE_SERVER_RPC_WIRE_MESSAGES_H_
#define ATTNSERVE_SERVER_RPC_WIRE_MESSAGES_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "attnserve/server/rpc/bytes_pool.h"
#include "google/protobuf/message.h"
#include "grpcpp/support/byte_buffer.h"

namespace attnserve {

// The most integers a request's repeated fields (shapes, key lengths, typed
// contents) may hold in all: each parses into 4 or 8 bytes from as little as
// one on the wire, so a message of max_message_bytes could otherwise make the
// parse allocate 8 times its size, outside the memory budget's count.
inline constexpr int64_t kMaxRepeatedIntegers = int64_t{1} << 20;

// The most entries a request's repeated message, string and bytes fields and
// unknown fields may hold in all: each parses into an object of 30 to 200+
// bytes from as little as two on the wire (an empty ModelInfer input, an
// empty step), so their count bounds that part of the parse's memory, to
// about 13 MiB. A Step carries at most 65,536 steps (--max_steps_per_call).
inline constexpr int64_t kMaxRepeatedEntries = int64_t{1} << 16;

// Parses `wire` into `message`, consuming the bytes (`wire` is left empty, so a
// request is not held twice). With a pool, `message` must be empty, and the
// data of each of its Tensor fields is read into a string taken from the pool.
// INVALID_ARGUMENT naming the message type and the byte count when the bytes
// are not a valid message (truncated, not protobuf wire format, a string that
// is not UTF-8), or naming the field when its repeated integer fields hold
// more than kMaxRepeatedIntegers values or its repeated entries and unknown
// fields more than kMaxRepeatedEntries (counted before anything is parsed).
absl::Status ParseWire(grpc::ByteBuffer* wire,
                       google::protobuf::Message* message,
                       BytesPool* pool = nullptr);

// Serialises `message` into `wire`. With a pool, the data of each of its Tensor
// fields of at least the pool's min_bytes() leaves `message` and is sent in
// place (as a second occurrence of the Tensor field holding only the data,
// which protobuf parsers merge into the first), then given to the pool.
// INTERNAL if protobuf cannot (a message over 2 GiB, which the response size
// limits rule out).
absl::Status SerializeWire(google::protobuf::Message* message,
                           grpc::ByteBuffer* wire,
                           const std::shared_ptr<BytesPool>& pool = nullptr);

// Gives the data of `message`'s Tensor fields to `pool`.
void GiveTensorBytes(google::protobuf::Message* message, BytesPool* pool);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_WIRE_MESSAGES_H_
