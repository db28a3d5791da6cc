// grpc::ByteBuffer <-> bytes, for tests that build or read wire messages.
#ifndef ATTNSERVE_TESTS_SERVER_BYTE_BUFFERS_H_
#define ATTNSERVE_TESTS_SERVER_BYTE_BUFFERS_H_

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "gtest/gtest.h"

namespace attnserve::testing {

// `bytes` in slices of `slice_bytes` (as gRPC hands a large request over).
inline grpc::ByteBuffer ToByteBuffer(const std::string& bytes,
                                     size_t slice_bytes = SIZE_MAX) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += slice_bytes) {
    slices.emplace_back(bytes.data() + at,
                        std::min(slice_bytes, bytes.size() - at));
  }
  if (slices.empty()) slices.emplace_back(bytes);  // A valid empty buffer.
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// The bytes of `buffer`, all its slices in order.
inline std::string ToString(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return bytes;
}

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_SERVER_BYTE_BUFFERS_H_
