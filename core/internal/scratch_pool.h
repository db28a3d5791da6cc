// Reusable scratch buffers. A call of the fused kernel needs a few hundred KB
// to a few MB of scratch; allocating it fresh each time costs page faults
// (glibc maps and unmaps blocks this size), which for mid-size calls measured
// ~14% of the run time. The pool keeps a few freed buffers and hands them to
// the next call that fits. Thread-safe: concurrent calls each take their own.
#ifndef ATTNSERVE_CORE_INTERNAL_SCRATCH_POOL_H_
#define ATTNSERVE_CORE_INTERNAL_SCRATCH_POOL_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace attnserve::internal {

class ScratchPool {
 public:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  using Buffer = std::unique_ptr<char, Free>;

  // A buffer of at least `bytes`, 64-byte aligned, given back to the pool when
  // the lease ends.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&&) = default;
    Lease& operator=(Lease&&) = default;
    ~Lease() {
      if (pool_ != nullptr && buffer_ != nullptr) {
        pool_->Return(std::move(buffer_), capacity_);
      }
    }
    char* get() const { return buffer_.get(); }

   private:
    friend class ScratchPool;
    ScratchPool* pool_ = nullptr;
    Buffer buffer_;
    int64_t capacity_ = 0;
  };

  // Keeps at most `max_buffers` freed buffers of at most `max_kept_bytes`
  // each.
  ScratchPool(size_t max_buffers, int64_t max_kept_bytes)
      : max_buffers_(max_buffers), max_kept_bytes_(max_kept_bytes) {}

  // Null data if the allocation fails.
  Lease Acquire(int64_t bytes) {
    Lease lease;
    lease.pool_ = this;
    {
      absl::MutexLock lock(&mutex_);
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].capacity >= bytes) {
          lease.buffer_ = std::move(free_[i].buffer);
          lease.capacity_ = free_[i].capacity;
          free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
          return lease;
        }
      }
    }
    const int64_t capacity = (bytes + 63) / 64 * 64;
    lease.buffer_.reset(static_cast<char*>(std::aligned_alloc(
        64, static_cast<size_t>(capacity > 0 ? capacity : 64))));
    lease.capacity_ = capacity;
    return lease;
  }

 private:
  struct Kept {
    Buffer buffer;
    int64_t capacity;
  };

  void Return(Buffer buffer, int64_t capacity) {
    if (capacity > max_kept_bytes_) return;
    absl::MutexLock lock(&mutex_);
    if (free_.size() >= max_buffers_) {
      // Keep the larger buffers: they serve every smaller request too.
      auto smallest = free_.begin();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->capacity < smallest->capacity) smallest = it;
      }
      if (smallest->capacity >= capacity) return;
      free_.erase(smallest);
    }
    free_.push_back({std::move(buffer), capacity});
  }

  const size_t max_buffers_;
  const int64_t max_kept_bytes_;
  absl::Mutex mutex_;
  std::vector<Kept> free_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_SCRATCH_POOL_H_
