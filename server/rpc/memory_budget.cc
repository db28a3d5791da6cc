#include "attnserve/server/rpc/memory_budget.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attnserve {

MemoryBudget::Hold::Hold(Hold&& other) noexcept
    : budget_(std::exchange(other.budget_, nullptr)),
      connection_(std::move(other.connection_)),
      bytes_(std::exchange(other.bytes_, 0)) {}

MemoryBudget::Hold& MemoryBudget::Hold::operator=(Hold&& other) noexcept {
  if (this != &other) {
    Reset();
    budget_ = std::exchange(other.budget_, nullptr);
    connection_ = std::move(other.connection_);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

absl::Status MemoryBudget::Hold::Grow(int64_t bytes) {
  if (budget_ == nullptr) {
    return absl::FailedPreconditionError("the hold has no budget");
  }
  absl::Status reserved = budget_->Reserve(bytes, connection_);
  if (reserved.ok()) bytes_ += bytes;
  return reserved;
}

void MemoryBudget::Hold::Reset() {
  if (budget_ != nullptr && bytes_ > 0) budget_->Release(bytes_, connection_);
  bytes_ = 0;
}

absl::StatusOr<MemoryBudget::Hold> MemoryBudget::Take(
    int64_t bytes, const std::string& connection) {
  absl::Status reserved = Reserve(bytes, connection);
  if (!reserved.ok()) return reserved;
  return Hold(this, connection, bytes);
}

MemoryBudget::Hold MemoryBudget::TakeAlways(int64_t bytes,
                                            const std::string& connection) {
  absl::MutexLock lock(&mutex_);
  held_ += bytes;
  connections_[connection] += bytes;
  return Hold(this, connection, bytes);
}

int64_t MemoryBudget::held() const {
  absl::MutexLock lock(&mutex_);
  return held_;
}

int64_t MemoryBudget::held_by(const std::string& connection) const {
  absl::MutexLock lock(&mutex_);
  const auto found = connections_.find(connection);
  return found == connections_.end() ? 0 : found->second;
}

int64_t MemoryBudget::refused() const {
  absl::MutexLock lock(&mutex_);
  return refused_;
}

absl::Status MemoryBudget::Reserve(int64_t bytes,
                                   const std::string& connection) {
  absl::MutexLock lock(&mutex_);
  const auto found = connections_.find(connection);
  const int64_t own = found == connections_.end() ? 0 : found->second;
  // The bounds are compared as "bytes <= bound - held", which cannot overflow.
  const int64_t heavy_bound = own > limit_ / 16 ? limit_ / 8 * 7 : limit_;
  const bool fits = bytes <= heavy_bound - held_ && bytes <= limit_ / 2 - own;
  if (fits) {
    held_ += bytes;
    connections_[connection] += bytes;
    return absl::OkStatus();
  }
  ++refused_;
  if (bytes > limit_ / 2) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this call needs ", bytes, " bytes of memory (its message and its ",
        "compute), more than the ", limit_ / 2,
        " bytes one connection may hold: half of the ", limit_,
        " bytes all calls in flight may hold (max_inflight_bytes)"));
  }
  if (bytes > limit_ / 2 - own) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this connection's calls in flight hold ", own,
        " bytes of memory and this one needs ", bytes,
        " more, past the half of the server's ", limit_,
        " bytes (max_inflight_bytes) one connection may hold; wait for "
        "answers (and read them) before sending more"));
  }
  const std::string bound =
      heavy_bound < limit_
          ? absl::StrCat(heavy_bound,
                         " bytes a connection holding much may take them to "
                         "(the last eighth of the ",
                         limit_, " is kept for connections holding little)")
          : absl::StrCat(limit_, " bytes they may hold");
  return absl::ResourceExhaustedError(absl::StrCat(
      "the server's memory for calls in flight is in use: this call needs ",
      bytes, " bytes, and calls in flight hold ", held_, " of the ", bound,
      " (max_inflight_bytes); retry after a backoff or on another replica"));
}

void MemoryBudget::Release(int64_t bytes, const std::string& connection) {
  absl::MutexLock lock(&mutex_);
  held_ -= bytes;
  const auto found = connections_.find(connection);
  if (found == connections_.end()) return;
  found->second -= bytes;
  if (found->second <= 0) connections_.erase(found);
}

}  // namespace attnserve
