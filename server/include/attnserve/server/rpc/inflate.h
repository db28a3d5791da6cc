// A request message's way in: inflated with a bound, then charged to the
// memory budget (AdmitMessage).
//
// Inflating compressed requests with a bound. gRPC 1.51 inflates a whole
// compressed message before it applies the message size limit, so a 1 MB
// gzip request could make the server allocate 1 GiB. With
// --accept_compressed_requests the server turns gRPC's decompression off and
// inflates here instead, stopping as soon as the output passes the limit.
#ifndef ATTNSERVE_SERVER_RPC_INFLATE_H_
#define ATTNSERVE_SERVER_RPC_INFLATE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/server/rpc/memory_budget.h"
#include "attnserve/server/rpc/transport_options.h"
#include "grpc/compression.h"
#include "grpcpp/support/byte_buffer.h"

namespace attnserve {

// Which algorithm compressed `message` (a request's bytes as they arrived,
// gRPC's own decompression off): the one its grpc-encoding named, if the
// message came with its compressed flag set; GRPC_COMPRESS_NONE if not.
grpc_compression_algorithm MessageCompression(grpc::ByteBuffer* message);

// If `message` came compressed, replaces it with its inflated bytes: gzip, or
// what gRPC calls "deflate" (a zlib stream, RFC 1950); another algorithm is
// UNIMPLEMENTED. The message's compressed flag decides, never its bytes: a
// plain message may start as a zlib header does (a CreateSession of 60
// layers starts 08 3c). RESOURCE_EXHAUSTED once the output passes
// `max_bytes`, before more is allocated; INVALID_ARGUMENT for a corrupt or
// truncated stream. A plain message is left as it is.
absl::Status InflateRequest(int64_t max_bytes, grpc::ByteBuffer* message);

// UNIMPLEMENTED, naming the encoding, if `message` came compressed (as
// MessageCompression tells); OK otherwise.
absl::Status RefuseCompressedRequest(grpc::ByteBuffer* message);

// Takes a request `message` that has arrived from `peer`: inflates it (with
// `transport.accept_compressed_requests`; without it, a compressed message
// that reached the handler, as one can with `transport.response_compression`
// on, is refused UNIMPLEMENTED), then takes its bytes from `budget`.
// On an error (the inflation's, or the budget's RESOURCE_EXHAUSTED) the
// message is cleared, so that its bytes are not held.
absl::StatusOr<MemoryBudget::Hold> AdmitMessage(
    const TransportOptions& transport, MemoryBudget& budget,
    const std::string& peer, grpc::ByteBuffer* message);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_INFLATE_H_
