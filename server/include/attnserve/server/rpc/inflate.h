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
#include "grpcpp/support/byte_buffer.h"

namespace attnserve {

// If `message` (a request's bytes as they arrived, gRPC's own decompression
// off) starts as a gzip stream (bytes 1f 8b) or a zlib stream (RFC 1950's
// header: what gRPC calls "deflate") does, replaces it with its inflated bytes.
// gRPC 1.51 does not show a handler the request's grpc-encoding, so the bytes
// decide: no request of ours starts so, since each starts with a
// length-delimited field (wire type 2), and both headers have wire types 0 or
// 7. RESOURCE_EXHAUSTED once the output passes `max_bytes`, before more is
// allocated; INVALID_ARGUMENT for a corrupt or truncated stream. Other bytes
// are left as they are.
absl::Status InflateRequest(int64_t max_bytes, grpc::ByteBuffer* message);

// UNIMPLEMENTED if `message` starts as a gzip or zlib stream does (as
// InflateRequest tells them); OK otherwise.
absl::Status RefuseCompressedRequest(const grpc::ByteBuffer& message);

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
