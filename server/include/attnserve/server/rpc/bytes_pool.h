// BytesPool: large byte strings kept for reuse, so that a request's tensors
// are parsed into, and a response's computed into, memory the process already
// has mapped. A fresh 8 MB string costs 2,048 page faults, each zeroing a page,
// before the first byte is copied: on a virtual machine the faults of one
// large Attend's 32 MB took longer than copying the bytes (20 ms against 3).
//
//   std::string bytes = pool->Take(size);  // Capacity >= size if one is kept.
//   ...
//   pool->Give(std::move(bytes));          // Kept if the budget allows.
//
// Thread-safe.
#ifndef ATTNSERVE_SERVER_RPC_BYTES_POOL_H_
#define ATTNSERVE_SERVER_RPC_BYTES_POOL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace attnserve {

class BytesPool {
 public:
  // Strings of less capacity are not worth keeping: malloc serves them from
  // memory it already holds.
  static constexpr size_t kMinBytes = size_t{64} << 10;
  // Most strings kept (Take looks through them all).
  static constexpr size_t kMaxStrings = 256;
  // Take hands out a string at most 1/kMostSpareFraction larger than asked:
  // a call is charged the bytes it asks for, and holds its strings until its
  // answer is sent (a client that never reads it: until the message
  // timeout). Until 2026-12-07 any larger string was handed out, and small
  // calls left unread after large ones each held a 16 MiB string for a
  // 256 KiB answer: 1.3 GB in flight against 19 MB charged (an audit).
  static constexpr size_t kMostSpareFraction = 8;

  // Keeps at most `max_bytes` of capacity in all, in strings of at least
  // `min_bytes` (tests and fuzzers lower it); 0 keeps nothing.
  explicit BytesPool(int64_t max_bytes, size_t min_bytes = kMinBytes)
      : max_bytes_(max_bytes), min_bytes_(min_bytes) {}

  // The least capacity worth keeping: smaller tensors are neither parsed into
  // kept strings nor sent in place.
  size_t min_bytes() const { return min_bytes_; }

  BytesPool(const BytesPool&) = delete;
  BytesPool& operator=(const BytesPool&) = delete;

  // An empty string with capacity for `size` bytes: the smallest kept one that
  // fits with at most size / kMostSpareFraction to spare, or, if none does, a
  // new string without capacity.
  std::string Take(size_t size);

  // Keeps `bytes`' storage for a later Take if it is at least min_bytes() and
  // fits the budget, dropping the strings kept longest to make room (in bytes
  // and in count, kMaxStrings); frees it otherwise.
  void Give(std::string bytes);

  // Capacity kept now, in bytes.
  int64_t held_bytes() const;

 private:
  const int64_t max_bytes_;
  const size_t min_bytes_;
  mutable absl::Mutex mutex_;
  std::vector<std::string> held_ ABSL_GUARDED_BY(mutex_);  // Oldest first.
  int64_t held_bytes_ ABSL_GUARDED_BY(mutex_) = 0;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_BYTES_POOL_H_
