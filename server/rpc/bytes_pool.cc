#include "attnserve/server/rpc/bytes_pool.h"

#include <utility>

namespace attnserve {

std::string BytesPool::Take(size_t size) {
  std::string taken;
  {
    absl::MutexLock lock(&mutex_);
    size_t best = held_.size();
    for (size_t i = 0; i < held_.size(); ++i) {
      if (held_[i].capacity() >= size &&
          held_[i].capacity() - size <= size / kMostSpareFraction &&
          (best == held_.size() ||
           held_[i].capacity() < held_[best].capacity())) {
        best = i;
      }
    }
    if (best == held_.size()) return taken;
    taken = std::move(held_[best]);
    held_.erase(held_.begin() + static_cast<ptrdiff_t>(best));
    held_bytes_ -= static_cast<int64_t>(taken.capacity());
  }
  taken.clear();  // Keeps the capacity.
  return taken;
}

void BytesPool::Give(std::string bytes) {
  const int64_t capacity = static_cast<int64_t>(bytes.capacity());
  if (bytes.capacity() < min_bytes_ || capacity > max_bytes_) return;
  std::vector<std::string> dropped;  // Freed outside the lock.
  absl::MutexLock lock(&mutex_);
  size_t oldest = 0;
  while (held_bytes_ + capacity > max_bytes_ ||
         held_.size() - oldest >= kMaxStrings) {
    held_bytes_ -= static_cast<int64_t>(held_[oldest].capacity());
    dropped.push_back(std::move(held_[oldest++]));
  }
  held_.erase(held_.begin(), held_.begin() + static_cast<ptrdiff_t>(oldest));
  held_bytes_ += capacity;
  held_.push_back(std::move(bytes));
}

int64_t BytesPool::held_bytes() const {
  absl::MutexLock lock(&mutex_);
  return held_bytes_;
}

}  // namespace attnserve
