#include "attnserve/server/rpc/memory_budget.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "attnserve/common/refusals.h"

namespace attnserve {
namespace {

int64_t HeldIn(const absl::flat_hash_map<std::string, int64_t>& holders,
               const std::string& holder) {
  const auto found = holders.find(holder);
  return found == holders.end() ? 0 : found->second;
}

void GiveBack(absl::flat_hash_map<std::string, int64_t>& holders,
              const std::string& holder, int64_t bytes) {
  const auto found = holders.find(holder);
  if (found == holders.end()) return;
  found->second -= bytes;
  if (found->second <= 0) holders.erase(found);
}

}  // namespace

std::string PeerAddress(const std::string& peer) {
  // "ipv4:10.0.0.7:51234" and "ipv6:[fe80::1]:51234": the port follows the
  // last colon. Anything else ("unix:/path", "unknown") is its own address.
  if (!absl::StartsWith(peer, "ipv4:") && !absl::StartsWith(peer, "ipv6:")) {
    return peer;
  }
  const size_t colon = peer.rfind(':');
  if (colon <= 4) return peer;
  const absl::string_view port = absl::string_view(peer).substr(colon + 1);
  if (port.empty() ||
      !std::all_of(port.begin(), port.end(), absl::ascii_isdigit)) {
    return peer;
  }
  return peer.substr(0, colon);
}

MemoryBudget::Hold::Hold(Hold&& other) noexcept
    : budget_(std::exchange(other.budget_, nullptr)),
      connection_(std::move(other.connection_)),
      address_(std::move(other.address_)),
      bytes_(std::exchange(other.bytes_, 0)) {}

MemoryBudget::Hold& MemoryBudget::Hold::operator=(Hold&& other) noexcept {
  if (this != &other) {
    Reset();
    budget_ = std::exchange(other.budget_, nullptr);
    connection_ = std::move(other.connection_);
    address_ = std::move(other.address_);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

absl::Status MemoryBudget::Hold::Grow(int64_t bytes) {
  if (budget_ == nullptr) {
    return absl::FailedPreconditionError("the hold has no budget");
  }
  absl::Status reserved = budget_->Reserve(bytes, connection_, address_);
  if (reserved.ok()) bytes_ += bytes;
  return reserved;
}

void MemoryBudget::Hold::Reset() {
  if (budget_ != nullptr && bytes_ > 0) {
    budget_->Release(bytes_, connection_, address_);
  }
  bytes_ = 0;
}

absl::StatusOr<MemoryBudget::Hold> MemoryBudget::Take(
    int64_t bytes, const std::string& connection) {
  std::string address = PeerAddress(connection);
  absl::Status reserved = Reserve(bytes, connection, address);
  if (!reserved.ok()) return reserved;
  return Hold(this, connection, std::move(address), bytes);
}

MemoryBudget::Hold MemoryBudget::TakeAlways(int64_t bytes,
                                            const std::string& connection) {
  std::string address = PeerAddress(connection);
  absl::MutexLock lock(&mutex_);
  held_ += bytes;
  connections_[connection] += bytes;
  addresses_[address] += bytes;
  return Hold(this, connection, std::move(address), bytes);
}

int64_t MemoryBudget::held() const {
  absl::MutexLock lock(&mutex_);
  return held_;
}

int64_t MemoryBudget::held_by(const std::string& connection) const {
  absl::MutexLock lock(&mutex_);
  return HeldIn(connections_, connection);
}

int64_t MemoryBudget::held_from(const std::string& address) const {
  absl::MutexLock lock(&mutex_);
  return HeldIn(addresses_, address);
}

int64_t MemoryBudget::refused() const {
  absl::MutexLock lock(&mutex_);
  return refused_;
}

absl::Status MemoryBudget::Reserve(int64_t bytes, const std::string& connection,
                                   const std::string& address) {
  absl::MutexLock lock(&mutex_);
  const int64_t own = HeldIn(connections_, connection);
  const int64_t own_address = HeldIn(addresses_, address);
  // The bounds are compared as "bytes <= bound - held", which cannot overflow.
  const bool heavy = own > limit_ / 16 || own_address > limit_ / 16;
  const int64_t heavy_bound = heavy ? limit_ / 8 * 7 : limit_;
  const bool fits = bytes <= heavy_bound - held_ && bytes <= limit_ / 2 - own;
  if (fits) {
    held_ += bytes;
    connections_[connection] += bytes;
    addresses_[address] += bytes;
    return absl::OkStatus();
  }
  ++refused_;
  if (bytes > limit_ / 2) {
    return Permanent(absl::ResourceExhaustedError(absl::StrCat(
        "this call needs ", bytes, " bytes of memory (its message and its ",
        "compute), more than the ", limit_ / 2,
        " bytes one connection may hold: half of the ", limit_,
        " bytes all calls in flight may hold (max_inflight_bytes)")));
  }
  if (bytes > limit_ / 2 - own) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this connection's calls in flight hold ", own,
        " bytes of memory and this one needs ", bytes,
        " more, past the half of the server's ", limit_,
        " bytes (max_inflight_bytes) one connection may hold; wait for "
        "answers (and read them) before sending more"));
  }
  std::string bound = absl::StrCat(limit_, " bytes they may hold");
  if (heavy) {
    bound = absl::StrCat(
        heavy_bound, " bytes a client holding much may take them to (",
        own > limit_ / 16 ? absl::StrCat("this connection holds ", own)
                          : absl::StrCat("the connections from ", address,
                                         " (this client's and any other's "
                                         "at that address) hold ",
                                         own_address),
        "; the last eighth of the ", limit_,
        " is kept for clients holding little)");
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "the server's memory for calls in flight is in use: this call needs ",
      bytes, " bytes, and calls in flight hold ", held_, " of the ", bound,
      " (max_inflight_bytes); retry after a backoff or on another replica"));
}

void MemoryBudget::Release(int64_t bytes, const std::string& connection,
                           const std::string& address) {
  absl::MutexLock lock(&mutex_);
  held_ -= bytes;
  GiveBack(connections_, connection, bytes);
  GiveBack(addresses_, address, bytes);
}

}  // namespace attnserve
