#include "attnserve/server/rpc/inflate.h"

#include <zlib.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/common/refusals.h"
#include "grpc/byte_buffer.h"
#include "grpc/compression.h"

// gRPC declares this class a friend of ByteBuffer (for its own tests) and
// defines it in none of its libraries. It is the one way to a received
// message's grpc_byte_buffer, whose public `data.raw.compression` says whether
// the message came with its compressed flag set; gRPC 1.51 shows a handler
// neither that flag nor the call's grpc-encoding otherwise.
namespace grpc {
namespace internal {
class GrpcByteBufferPeer {
 public:
  static grpc_compression_algorithm Compression(ByteBuffer* message) {
    const grpc_byte_buffer* buffer = message->c_buffer();
    return buffer != nullptr && buffer->type == GRPC_BB_RAW
               ? buffer->data.raw.compression
               : GRPC_COMPRESS_NONE;
  }
};
}  // namespace internal
}  // namespace grpc

namespace attnserve {

grpc_compression_algorithm MessageCompression(grpc::ByteBuffer* message) {
  return grpc::internal::GrpcByteBufferPeer::Compression(message);
}

absl::Status InflateRequest(int64_t max_bytes, grpc::ByteBuffer* message) {
  const grpc_compression_algorithm algorithm = MessageCompression(message);
  if (algorithm == GRPC_COMPRESS_NONE) return absl::OkStatus();
  if (algorithm != GRPC_COMPRESS_GZIP && algorithm != GRPC_COMPRESS_DEFLATE) {
    return absl::UnimplementedError(
        "the request is compressed with an encoding this server does not "
        "take; send it uncompressed, gzip or deflate");
  }
  std::vector<grpc::Slice> slices;
  if (!message->Dump(&slices).ok()) {
    return absl::InternalError("the request's bytes could not be read");
  }
  const bool gzip = algorithm == GRPC_COMPRESS_GZIP;
  const char* const encoding = gzip ? "gzip" : "deflate";

  z_stream stream{};
  if (inflateInit2(&stream, gzip ? 16 + MAX_WBITS : MAX_WBITS) != Z_OK) {
    return absl::InternalError("zlib could not start inflating");
  }
  std::string output;
  constexpr size_t kChunk = size_t{64} << 10;
  int result = Z_OK;
  absl::Status status;
  for (const grpc::Slice& slice : slices) {
    stream.next_in = const_cast<Bytef*>(slice.begin());
    stream.avail_in = static_cast<uInt>(slice.size());
    while (stream.avail_in > 0 && result != Z_STREAM_END) {
      const size_t used = output.size();
      if (static_cast<int64_t>(used) > max_bytes) break;
      output.resize(used + kChunk);
      stream.next_out = reinterpret_cast<Bytef*>(output.data() + used);
      stream.avail_out = static_cast<uInt>(kChunk);
      result = inflate(&stream, Z_NO_FLUSH);
      output.resize(used + kChunk - stream.avail_out);
      if (result != Z_OK && result != Z_STREAM_END) break;
    }
    if (static_cast<int64_t>(output.size()) > max_bytes ||
        (result != Z_OK && result != Z_STREAM_END)) {
      break;
    }
  }
  if (static_cast<int64_t>(output.size()) > max_bytes) {
    status = Permanent(absl::ResourceExhaustedError(absl::StrCat(
        "the ", encoding, "-compressed request inflates to more than ",
        max_bytes, " bytes, over the max_message_bytes limit (",
        message->Length(), " bytes compressed)")));
  } else if (result != Z_STREAM_END) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "the request is not a whole ", encoding, " stream (", message->Length(),
        " bytes; zlib: ", stream.msg != nullptr ? stream.msg : "truncated",
        ")"));
  }
  inflateEnd(&stream);
  if (!status.ok()) return status;
  grpc::Slice inflated(output.data(), output.size());
  *message = grpc::ByteBuffer(&inflated, 1);
  return absl::OkStatus();
}

absl::Status RefuseCompressedRequest(grpc::ByteBuffer* message) {
  const grpc_compression_algorithm algorithm = MessageCompression(message);
  if (algorithm == GRPC_COMPRESS_NONE) return absl::OkStatus();
  const char* name = "";
  grpc_compression_algorithm_name(algorithm, &name);
  return absl::UnimplementedError(absl::StrCat(
      "the request is ", name,
      "-compressed, and this server takes compressed requests only with "
      "accept_compressed_requests on; send it uncompressed"));
}

absl::StatusOr<MemoryBudget::Hold> AdmitMessage(
    const TransportOptions& transport, MemoryBudget& budget,
    const std::string& peer, grpc::ByteBuffer* message) {
  // Without response compression gRPC refuses compressed requests itself,
  // before reading them; with it, gRPC must take the encoding (or it would
  // not compress the responses either) and hands the bytes over as they came.
  absl::Status inflated = absl::OkStatus();
  if (transport.accept_compressed_requests) {
    inflated = InflateRequest(transport.max_message_bytes, message);
  } else if (transport.response_compression != GRPC_COMPRESS_NONE) {
    inflated = RefuseCompressedRequest(message);
  }
  absl::StatusOr<MemoryBudget::Hold> held =
      inflated.ok() ? budget.Take(static_cast<int64_t>(message->Length()), peer)
                    : absl::StatusOr<MemoryBudget::Hold>(inflated);
  if (!held.ok()) message->Clear();
  return held;
}

}  // namespace attnserve
