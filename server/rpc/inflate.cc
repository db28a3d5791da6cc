#include "attnserve/server/rpc/inflate.h"

#include <zlib.h>

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
  // Inflated into 64 KiB slices, the message's own from then on: no string
  // grown past the limit by doubling and then copied into a slice (until
  // 2026-12-07 an io thread briefly held some three times max_message_bytes
  // per compressed request, outside the memory budget, an audit found).
  constexpr size_t kChunk = size_t{64} << 10;
  std::vector<grpc::Slice> inflated;
  grpc::Slice chunk;
  size_t filled = kChunk;  // Of `chunk`: a new one is due.
  int64_t total = 0;
  int result = Z_OK;
  absl::Status status;
  for (const grpc::Slice& slice : slices) {
    stream.next_in = const_cast<Bytef*>(slice.begin());
    stream.avail_in = static_cast<uInt>(slice.size());
    // Past the input, zlib may still hold output that a full chunk had no
    // room for: it is asked again until it has none.
    bool pending = false;
    while ((stream.avail_in > 0 || pending) && result != Z_STREAM_END &&
           total <= max_bytes) {
      if (filled == kChunk) {
        if (chunk.size() > 0) inflated.push_back(std::move(chunk));
        chunk = grpc::Slice(kChunk);
        filled = 0;
      }
      // The new slice is this function's alone until it is handed over.
      stream.next_out = const_cast<Bytef*>(chunk.begin()) + filled;
      stream.avail_out = static_cast<uInt>(kChunk - filled);
      result = inflate(&stream, Z_NO_FLUSH);
      const size_t got = kChunk - filled - stream.avail_out;
      filled += got;
      total += static_cast<int64_t>(got);
      pending = stream.avail_out == 0;
      if (result == Z_BUF_ERROR) {  // No progress: it needs the next slice.
        result = Z_OK;
        break;
      }
      if (result != Z_OK && result != Z_STREAM_END) break;
    }
    if (total > max_bytes || (result != Z_OK && result != Z_STREAM_END)) break;
  }
  if (total > max_bytes) {
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
  if (filled > 0 && filled < kChunk) {
    // Copied to its size: a sub-slice would hold all 64 KiB, which a request
    // inflating to a few hundred bytes is not charged for.
    inflated.emplace_back(chunk.begin(), filled);
  } else if (filled == kChunk && chunk.size() > 0) {
    inflated.push_back(std::move(chunk));
  }
  *message = grpc::ByteBuffer(inflated.data(), inflated.size());
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
