#include "attnserve/server/rpc/inflate.h"

#include <zlib.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

// The first two bytes of the message, or fewer.
std::string Head(const std::vector<grpc::Slice>& slices) {
  std::string head;
  for (const grpc::Slice& slice : slices) {
    for (size_t i = 0; i < slice.size() && head.size() < 2; ++i) {
      head.push_back(static_cast<char>(slice.begin()[i]));
    }
    if (head.size() == 2) break;
  }
  return head;
}

bool LooksGzip(const std::string& head) {
  return head.size() == 2 && static_cast<unsigned char>(head[0]) == 0x1f &&
         static_cast<unsigned char>(head[1]) == 0x8b;
}

// RFC 1950: compression method 8, window at most 32 KiB, and the header's
// check bits.
bool LooksZlib(const std::string& head) {
  if (head.size() != 2) return false;
  const unsigned cmf = static_cast<unsigned char>(head[0]);
  const unsigned flg = static_cast<unsigned char>(head[1]);
  return (cmf & 0x0f) == 8 && (cmf >> 4) <= 7 && (cmf * 256 + flg) % 31 == 0;
}

}  // namespace

absl::Status InflateRequest(int64_t max_bytes, grpc::ByteBuffer* message) {
  std::vector<grpc::Slice> slices;
  if (!message->Dump(&slices).ok()) {
    return absl::InternalError("the request's bytes could not be read");
  }
  const std::string head = Head(slices);
  const bool gzip = LooksGzip(head);
  if (!gzip && !LooksZlib(head)) return absl::OkStatus();
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
    status = absl::ResourceExhaustedError(absl::StrCat(
        "the ", encoding, "-compressed request inflates to more than ",
        max_bytes, " bytes, over the max_message_bytes limit (",
        message->Length(), " bytes compressed)"));
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

absl::Status RefuseCompressedRequest(const grpc::ByteBuffer& message) {
  std::vector<grpc::Slice> slices;
  if (!message.Dump(&slices).ok()) {
    return absl::InternalError("the request's bytes could not be read");
  }
  const std::string head = Head(slices);
  const bool gzip = LooksGzip(head);
  if (!gzip && !LooksZlib(head)) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      "the request is ", gzip ? "gzip" : "deflate",
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
    inflated = RefuseCompressedRequest(*message);
  }
  absl::StatusOr<MemoryBudget::Hold> held =
      inflated.ok() ? budget.Take(static_cast<int64_t>(message->Length()), peer)
                    : absl::StatusOr<MemoryBudget::Hold>(inflated);
  if (!held.ok()) message->Clear();
  return held;
}

}  // namespace attnserve
