#include "attnserve/client/replicas.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "attnserve/common/refusals.h"
#include "attnserve/common/status_macros.h"
#include "deadline.h"

namespace attnserve {

using internal::Remaining;

namespace {

// "host:port" or "[host]:port" split; false without a port.
bool SplitHostPort(absl::string_view address, std::string* host,
                   std::string* port) {
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find("]:");
    if (close == absl::string_view::npos) return false;
    *host = std::string(address.substr(1, close - 1));
    *port = std::string(address.substr(close + 2));
  } else {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos) return false;
    *host = std::string(address.substr(0, colon));
    *port = std::string(address.substr(colon + 1));
  }
  int number = 0;
  return !host->empty() && absl::SimpleAtoi(*port, &number) && number > 0 &&
         number < 65536;
}

// The addresses `host`:`port` resolves to, as "a.b.c.d:port" and
// "[v6]:port".
absl::StatusOr<std::vector<std::string>> ResolveHostNow(
    const std::string& host, const std::string& port) {
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int error = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
  if (error != 0) {
    return absl::UnavailableError(
        absl::StrCat("resolving ", host, ":", port, ": ", gai_strerror(error)));
  }
  std::vector<std::string> addresses;
  for (const addrinfo* entry = found; entry != nullptr;
       entry = entry->ai_next) {
    char text[NI_MAXHOST];
    if (getnameinfo(entry->ai_addr, entry->ai_addrlen, text, sizeof(text),
                    nullptr, 0, NI_NUMERICHOST) != 0) {
      continue;
    }
    addresses.push_back(entry->ai_family == AF_INET6
                            ? absl::StrCat("[", text, "]:", port)
                            : absl::StrCat(text, ":", port));
  }
  freeaddrinfo(found);
  return addresses;
}

// ResolveHostNow by `deadline`. getaddrinfo has no deadline of its own (a
// resolver that does not answer holds it for its timeouts, 10 s or more), so
// with one it runs on a thread of its own, which a lookup past the deadline
// leaves to finish alone, holding only its own copies.
absl::StatusOr<std::vector<std::string>> ResolveHost(const std::string& host,
                                                     const std::string& port,
                                                     absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return ResolveHostNow(host, port);
  struct Lookup {
    absl::Mutex mutex;
    bool done ABSL_GUARDED_BY(mutex) = false;
    absl::StatusOr<std::vector<std::string>> result ABSL_GUARDED_BY(mutex);
  };
  auto lookup = std::make_shared<Lookup>();
  std::thread([lookup, host, port] {
    absl::StatusOr<std::vector<std::string>> result =
        ResolveHostNow(host, port);
    absl::MutexLock lock(&lookup->mutex);
    lookup->result = std::move(result);
    lookup->done = true;
  }).detach();
  absl::MutexLock lock(&lookup->mutex);
  if (!lookup->mutex.AwaitWithDeadline(absl::Condition(&lookup->done),
                                       deadline)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "resolving ", host, ":", port, " took past the call's deadline"));
  }
  return lookup->result;
}

// The gRPC target of one address.
std::string TargetOf(const std::string& address) {
  if (absl::StartsWith(address, "unix:")) return address;
  return absl::StrCat(absl::StartsWith(address, "[") ? "ipv6:" : "ipv4:",
                      address);
}

}  // namespace

bool IsReplicaGone(const absl::Status& status) {
  return absl::IsAborted(status) &&
         status.GetPayload(kReplicaGonePayload).has_value();
}

uint64_t RendezvousWeight(absl::string_view address, absl::string_view key) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  const auto mix = [&hash](absl::string_view text) {
    for (const char c : text) {
      hash ^= static_cast<unsigned char>(c);
      hash *= 0x100000001b3ULL;
    }
  };
  mix(address);
  mix("/");
  mix(key);
  hash ^= hash >> 30;
  hash *= 0xbf58476d1ce4e5b9ULL;
  hash ^= hash >> 27;
  hash *= 0x94d049bb133111ebULL;
  hash ^= hash >> 31;
  return hash;
}

std::string RandomSessionId() {
  static constexpr char kHex[] = "0123456789abcdef";
  std::random_device random;  // The operating system's source on Linux.
  std::string id(32, '0');
  for (size_t i = 0; i < id.size(); i += 8) {
    const uint32_t bits = random();
    for (size_t j = 0; j < 8; ++j) id[i + j] = kHex[(bits >> (4 * j)) & 15];
  }
  return id;
}

absl::StatusOr<std::unique_ptr<Replicas>> Replicas::Connect(
    absl::string_view target, const ClientOptions& options) {
  if (target.empty()) return absl::InvalidArgumentError("target is empty");
  ClientOptions one = options;
  one.load_balancing_policy = "pick_first";
  std::unique_ptr<Replicas> replicas(
      new Replicas(std::string(target), std::move(one)));
  if (absl::Status resolved = replicas->Refresh(); !resolved.ok()) {
    return resolved;
  }
  return replicas;
}

absl::StatusOr<std::vector<std::string>> Replicas::Resolve(
    absl::Time deadline) const {
  absl::string_view rest = target_;
  std::vector<std::string> addresses;
  if (absl::ConsumePrefix(&rest, "ipv4:") ||
      absl::ConsumePrefix(&rest, "ipv6:")) {
    for (absl::string_view address : absl::StrSplit(rest, ',')) {
      std::string host, port;
      if (!SplitHostPort(address, &host, &port)) {
        return absl::InvalidArgumentError(
            absl::StrCat("target ", target_, " has the address \"", address,
                         "\", expected host:port or [host]:port"));
      }
      addresses.emplace_back(address);
    }
  } else if (absl::StartsWith(rest, "unix:")) {
    addresses.emplace_back(rest);
  } else {
    if (!absl::ConsumePrefix(&rest, "dns:///")) {
      absl::ConsumePrefix(&rest, "dns:");
    }
    std::string host, port;
    if (!SplitHostPort(rest, &host, &port)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "target ", target_,
          " is not ipv4:, ipv6:, unix:, dns:///host:port or host:port"));
    }
    absl::StatusOr<std::vector<std::string>> resolved =
        ResolveHost(host, port, deadline);
    if (!resolved.ok()) return resolved.status();
    addresses = *std::move(resolved);
  }
  std::sort(addresses.begin(), addresses.end());
  addresses.erase(std::unique(addresses.begin(), addresses.end()),
                  addresses.end());
  if (addresses.empty()) {
    return absl::UnavailableError(
        absl::StrCat("target ", target_, " resolved to no address"));
  }
  return addresses;
}

absl::Status Replicas::Refresh(absl::Time deadline) {
  absl::StatusOr<std::vector<std::string>> addresses = Resolve(deadline);
  if (!addresses.ok()) return addresses.status();
  absl::MutexLock lock(&mutex_);
  for (const std::string& address : *addresses) {
    if (clients_.count(address) > 0) continue;
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(TargetOf(address), options_);
    if (!client.ok()) return client.status();
    clients_.emplace(address, *std::move(client));
  }
  addresses_ = *std::move(addresses);
  return absl::OkStatus();
}

std::vector<std::string> Replicas::addresses() const {
  absl::MutexLock lock(&mutex_);
  return addresses_;
}

Client* Replicas::client(absl::string_view address) const {
  absl::MutexLock lock(&mutex_);
  const auto it = clients_.find(address);
  return it == clients_.end() ? nullptr : it->second.get();
}

std::vector<std::string> Replicas::Rank(absl::string_view key) const {
  std::vector<std::pair<uint64_t, std::string>> weighted;
  for (std::string& address : addresses()) {
    weighted.emplace_back(RendezvousWeight(address, key), std::move(address));
  }
  std::sort(weighted.begin(), weighted.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::string> ranked;
  for (auto& [weight, address] : weighted) ranked.push_back(std::move(address));
  return ranked;
}

absl::StatusOr<Session> Replicas::CreateSession(
    v1::CreateSessionRequest request, absl::Duration timeout,
    const std::set<std::string>& avoid) {
  const absl::Time deadline = absl::Now() + timeout;
  if (request.session_id().empty()) request.set_session_id(RandomSessionId());
  std::vector<std::string> refusals;
  bool all_full = true;  // Every refusal a full replica's.
  std::set<std::string> asked = avoid;
  // The ranking as resolved now, then once more after resolving the target
  // again, for the replicas that came meanwhile.
  for (int round = 0; round < 2; ++round) {
    if (round == 1 && !Refresh(deadline).ok()) break;
    const std::vector<std::string> ranked = Rank(request.session_id());
    int left = 0;
    for (const std::string& address : ranked) {
      if (asked.count(address) == 0) ++left;
    }
    for (const std::string& address : ranked) {
      if (!asked.insert(address).second) continue;
      Client* replica = client(address);
      // Each replica left gets an equal share of the time left (the last
      // all of it), at least 2 s (or what is left) however many there are:
      // one that hangs (stopped, swapping) does not take the whole deadline
      // from the next.
      const absl::Duration share =
          std::max(Remaining(deadline) / left,
                   std::min(Remaining(deadline), absl::Seconds(2)));
      --left;
      absl::StatusOr<v1::CreateSessionResponse> created =
          replica->CreateSession(request, share);
      if (created.ok()) {
        // A replica that took another id would break the placement by id.
        ATTNSERVE_ASSIGN_OR_RETURN(
            Session session, Session::FromServer(replica, created->session(),
                                                 request.session_id()));
        session.replica_ = created->replica();
        session.address_ = address;
        session.replicas_ = this;
        return session;
      }
      // A replica shutting down cancels the calls it holds: its sessions go
      // with it, so the next replica is asked, as for one unreachable, or
      // one that did not answer within its share, or one full (its session
      // caps or KV cache; until 2026-12-07 the first full replica ended the
      // create, an audit found), but not for a refusal of the request itself,
      // which every replica would make.
      const bool share_passed = absl::IsDeadlineExceeded(created.status()) &&
                                Remaining(deadline) > absl::ZeroDuration();
      const bool full = absl::IsResourceExhausted(created.status()) &&
                        !IsPermanent(created.status());
      if (!absl::IsUnavailable(created.status()) &&
          !absl::IsCancelled(created.status()) && !share_passed && !full) {
        return created.status();
      }
      all_full = all_full && full;
      refusals.push_back(
          absl::StrCat(address, ": ", created.status().message()));
    }
  }
  const std::string what = absl::StrCat(
      "no replica of ", target_, " took session ", request.session_id(),
      refusals.empty() ? " (no replica to ask besides those avoided)"
                       : absl::StrCat(": ", absl::StrJoin(refusals, "; ")));
  // Every replica full: the caller's backpressure, as one replica's was.
  return !refusals.empty() && all_full ? absl::ResourceExhaustedError(what)
                                       : absl::UnavailableError(what);
}

absl::StatusOr<Session> Replicas::AttachSession(absl::string_view address,
                                                absl::string_view session_id,
                                                absl::Duration timeout) {
  Client* replica = client(address);
  if (replica == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "address ", address, " is not one of target ", target_, "'s"));
  }
  absl::StatusOr<v1::GetSessionResponse> got =
      replica->GetSession(session_id, timeout);
  if (!got.ok()) return got.status();
  ATTNSERVE_ASSIGN_OR_RETURN(
      Session session,
      Session::FromServer(replica, got->session(), session_id));
  session.replica_ = got->replica();
  session.address_ = std::string(address);
  session.replicas_ = this;
  return session;
}

}  // namespace attnserve
