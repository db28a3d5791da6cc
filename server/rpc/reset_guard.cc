#include "attnserve/server/rpc/reset_guard.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attnserve {

bool ResetGuard::ClientCancelled(const std::string& peer, absl::Time now) {
  if (max_per_second_ <= 0) return false;
  last_cancel_us_.store(absl::ToUnixMicros(now), std::memory_order_relaxed);
  {
    absl::MutexLock lock(&mutex_);
    // Windows of connections that went quiet are dropped as the map grows,
    // at most once a second (each sweep reads every entry).
    if (windows_.size() > 4096 && now - last_sweep_ >= absl::Seconds(1)) {
      last_sweep_ = now;
      absl::erase_if(windows_, [now](const auto& entry) {
        return now - entry.second.start > absl::Seconds(2);
      });
    }
    Window& window = windows_[peer];
    if (now - window.start >= absl::Seconds(1)) window = Window{now};
    ++window.cancelled;
    const int64_t cap = max_per_second_;
    if (window.cancelled <= std::min(cap + window.answered, 4 * cap) ||
        window.closed) {
      return false;
    }
    window.closed = true;
    ++closed_;
  }
  // Outside the lock: it reads /proc. A peer whose socket is already gone has
  // nothing left to close.
  ShutDownConnection(peer).IgnoreError();
  return true;
}

void ResetGuard::Answered(const std::string& peer, absl::Time now) {
  if (max_per_second_ <= 0 ||
      absl::ToUnixMicros(now) -
              last_cancel_us_.load(std::memory_order_relaxed) >
          1'000'000) {
    return;
  }
  absl::MutexLock lock(&mutex_);
  const auto it = windows_.find(peer);
  if (it == windows_.end() || now - it->second.start >= absl::Seconds(1)) {
    return;
  }
  ++it->second.answered;
}

int64_t ResetGuard::closed() const {
  absl::MutexLock lock(&mutex_);
  return closed_;
}

namespace {

// A peer's address as /proc/net/tcp{,6} writes it: the address's bytes as
// 32-bit words in host order, each as 8 hex digits, then ":" and the port in
// 4 hex digits.
struct ProcAddress {
  bool ipv6 = false;
  std::string text;
};

std::optional<ProcAddress> ProcAddressOf(const std::string& peer) {
  absl::string_view rest = peer;
  const bool ipv6 = absl::ConsumePrefix(&rest, "ipv6:");
  if (!ipv6 && !absl::ConsumePrefix(&rest, "ipv4:")) return std::nullopt;
  const size_t colon = rest.rfind(':');
  if (colon == absl::string_view::npos) return std::nullopt;
  absl::string_view host = rest.substr(0, colon);
  int port = 0;
  if (!absl::SimpleAtoi(rest.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return std::nullopt;
  }
  std::array<unsigned char, 16> bytes{};
  const std::string host_text(
      ipv6 ? absl::StripSuffix(absl::StripPrefix(host, "["), "]") : host);
  if (inet_pton(ipv6 ? AF_INET6 : AF_INET, host_text.c_str(), bytes.data()) !=
      1) {
    return std::nullopt;
  }
  ProcAddress address{ipv6, ""};
  const int words = ipv6 ? 4 : 1;
  for (int w = 0; w < words; ++w) {
    uint32_t word = 0;
    std::memcpy(&word, bytes.data() + 4 * w, 4);
    absl::StrAppend(&address.text, absl::Hex(word, absl::kZeroPad8));
  }
  absl::StrAppend(&address.text, ":", absl::Hex(port, absl::kZeroPad4));
  address.text = absl::AsciiStrToUpper(address.text);
  return address;
}

// The inodes of the sockets in `table` (a /proc/net/tcp{,6} file) whose remote
// address is `remote`.
std::vector<std::string> SocketInodes(const std::string& table,
                                      const std::string& remote) {
  std::vector<std::string> inodes;
  std::ifstream file(table);
  std::string line;
  std::getline(file, line);  // The header.
  while (std::getline(file, line)) {
    const std::vector<absl::string_view> fields =
        absl::StrSplit(line, ' ', absl::SkipEmpty());
    // sl local rem st tx:rx tr:when retrnsmt uid timeout inode ...
    if (fields.size() > 9 && fields[2] == remote) {
      inodes.emplace_back(fields[9]);
    }
  }
  return inodes;
}

}  // namespace

absl::Status ShutDownConnection(const std::string& peer) {
  const std::optional<ProcAddress> remote = ProcAddressOf(peer);
  if (!remote) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer \"", peer, "\" is not a TCP address"));
  }
  std::vector<std::string> inodes =
      SocketInodes(remote->ipv6 ? "/proc/self/net/tcp6" : "/proc/self/net/tcp",
                   remote->text);
  if (!remote->ipv6) {
    // On a dual-stack listener an IPv4 client's socket is an IPv6 one, to the
    // IPv4-mapped address ::ffff:A.B.C.D.
    for (std::string& inode :
         SocketInodes("/proc/self/net/tcp6",
                      "0000000000000000FFFF0000" + remote->text)) {
      inodes.push_back(std::move(inode));
    }
  }
  if (inodes.empty()) {
    return absl::NotFoundError(absl::StrCat("no socket to ", peer));
  }
  DIR* fds = opendir("/proc/self/fd");
  if (fds == nullptr) return absl::NotFoundError("cannot list /proc/self/fd");
  bool found = false;
  while (dirent* entry = readdir(fds)) {
    int fd = 0;
    if (!absl::SimpleAtoi(entry->d_name, &fd)) continue;
    char target[64] = {};
    const std::string link = absl::StrCat("/proc/self/fd/", entry->d_name);
    const ssize_t length = readlink(link.c_str(), target, sizeof(target) - 1);
    if (length <= 0) continue;
    const absl::string_view text(target, static_cast<size_t>(length));
    for (const std::string& inode : inodes) {
      if (text == absl::StrCat("socket:[", inode, "]")) {
        shutdown(fd, SHUT_RDWR);
        found = true;
      }
    }
  }
  closedir(fds);
  return found ? absl::OkStatus()
               : absl::NotFoundError(absl::StrCat("no socket to ", peer));
}

}  // namespace attnserve
