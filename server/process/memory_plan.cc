#include "attnserve/server/process/memory_plan.h"

#include <sys/resource.h>
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

namespace {

// The number in a cgroup limit file, or nothing for "max", a missing file or
// anything else. cgroup v1 writes a huge number (about 2^63) for "no limit".
std::optional<int64_t> ReadLimitFile(const std::string& path) {
  std::ifstream file(path);
  std::string text;
  if (!file || !std::getline(file, text)) return std::nullopt;
  int64_t bytes = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &bytes) ||
      bytes <= 0 || bytes >= (int64_t{1} << 62)) {
    return std::nullopt;
  }
  return bytes;
}

// A "VmSize:"-style line of /proc/self/status, in bytes; 0 if absent.
int64_t StatusBytes(absl::string_view field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (!absl::StartsWith(line, field)) continue;
    absl::string_view rest = absl::StripAsciiWhitespace(
        absl::string_view(line).substr(field.size()));
    absl::ConsumeSuffix(&rest, " kB");
    int64_t kib = 0;
    return absl::SimpleAtoi(rest, &kib) ? kib * 1024 : 0;
  }
  return 0;
}

int64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return std::numeric_limits<int64_t>::max();
  return static_cast<int64_t>(pages) * page_size;
}

// The cgroup folders whose limits bind this process, innermost first: for each
// hierarchy line of /proc/self/cgroup ("0::/a/b" for v2,
// "4:memory:/a/b" for v1's memory controller), the folder and its ancestors up
// to the hierarchy's root.
std::vector<std::string> CgroupLimitFiles(const std::string& cgroup_root,
                                          const std::string& proc_self_cgroup) {
  std::vector<std::string> files;
  std::ifstream membership(proc_self_cgroup);
  std::string line;
  while (std::getline(membership, line)) {
    const std::vector<std::string> fields =
        absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (fields.size() != 3) continue;
    std::string folder;
    std::string file;
    if (fields[0] == "0" && fields[1].empty()) {
      folder = cgroup_root;
      file = "memory.max";
    } else if (absl::StrContains(fields[1], "memory")) {
      folder = cgroup_root + "/memory";
      file = "memory.limit_in_bytes";
    } else {
      continue;
    }
    std::string path = fields[2];
    while (true) {
      files.push_back(absl::StrCat(folder, path == "/" ? "" : path, "/", file));
      if (path.empty() || path == "/") break;
      const size_t slash = path.rfind('/');
      path = slash == 0 || slash == std::string::npos ? "/"
                                                      : path.substr(0, slash);
    }
  }
  // In a container the process's own cgroup is mounted at the root.
  files.push_back(cgroup_root + "/memory.max");
  files.push_back(cgroup_root + "/memory/memory.limit_in_bytes");
  return files;
}

}  // namespace

MemoryLimit ReadMemoryLimit(const std::string& cgroup_root,
                            const std::string& proc_self_cgroup) {
  MemoryLimit limit{PhysicalMemoryBytes(), "physical memory"};
  for (const std::string& file :
       CgroupLimitFiles(cgroup_root, proc_self_cgroup)) {
    const std::optional<int64_t> bytes = ReadLimitFile(file);
    if (bytes && *bytes < limit.bytes) {
      limit = {*bytes, absl::StrCat("cgroup ", file)};
    }
  }
  // The process's own limits bind too (a systemd LimitAS=, a batch
  // scheduler's ulimit): past them malloc fails, and a failed allocation in
  // protobuf's parse or gRPC's buffers ends the process. They count address
  // space, not memory: what the process has mapped and not touched (thread
  // stacks, allocator arenas) comes off them first.
  const int64_t untouched =
      std::max<int64_t>(0, StatusBytes("VmSize:") - StatusBytes("VmRSS:"));
  const std::pair<int, const char*> rlimits[] = {
      {RLIMIT_AS, "RLIMIT_AS (ulimit -v)"},
      {RLIMIT_DATA, "RLIMIT_DATA (ulimit -d)"}};
  for (const auto& [resource, name] : rlimits) {
    rlimit process{};
    if (getrlimit(resource, &process) != 0 ||
        process.rlim_cur == RLIM_INFINITY ||
        process.rlim_cur >= static_cast<rlim_t>(INT64_MAX)) {
      continue;
    }
    const int64_t usable = std::max<int64_t>(
        0, static_cast<int64_t>(process.rlim_cur) - untouched);
    if (usable < limit.bytes) limit = {usable, name};
  }
  return limit;
}

absl::StatusOr<MemoryPlan> PlanMemory(const MemoryOptions& requested,
                                      const MemoryLimit& limit) {
  const int64_t max_inflight_bytes = requested.max_inflight_bytes;
  const std::pair<const char*, int64_t> budgets[] = {
      {"max_weights_bytes", requested.max_weights_bytes},
      {"kv_cache_bytes", requested.kv_cache_bytes},
      {"max_inflight_bytes", max_inflight_bytes},
      {"max_connections", requested.max_connections}};
  for (const auto& [name, value] : budgets) {
    if (value < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " is ", value,
                       ", expected >= 0 (0: derived from the memory limit)"));
    }
  }
  if (requested.buffer_pool_bytes < 0 &&
      requested.buffer_pool_bytes != kDerivedBufferPool) {
    return absl::InvalidArgumentError(
        absl::StrCat("buffer_pool_bytes is ", requested.buffer_pool_bytes,
                     ", expected >= 0, or ", kDerivedBufferPool,
                     " (derived from the memory limit)"));
  }
  MemoryPlan plan;
  plan.limit = limit;
  // What the limit leaves after the process: the derived budgets' base.
  const int64_t left =
      std::max<int64_t>(0, limit.bytes - kProcessOverheadBytes);
  plan.buffer_pool_bytes = requested.buffer_pool_bytes == kDerivedBufferPool
                               ? std::min(int64_t{256} << 20, left / 8)
                               : requested.buffer_pool_bytes;
  const int64_t shared =
      std::max<int64_t>(0, left - plan.buffer_pool_bytes) / 4;
  plan.max_weights_bytes = requested.max_weights_bytes > 0
                               ? requested.max_weights_bytes
                               : std::min(int64_t{4} << 30, shared);
  plan.kv_cache_bytes =
      requested.kv_cache_bytes > 0 ? requested.kv_cache_bytes : shared;
  // Sums in double: the flags may be anything up to 2^63. What the budgets
  // but the connections and the calls in flight take:
  const double planned = static_cast<double>(plan.max_weights_bytes) +
                         static_cast<double>(plan.kv_cache_bytes) +
                         static_cast<double>(plan.buffer_pool_bytes) +
                         static_cast<double>(kProcessOverheadBytes);
  if (requested.max_connections > 0) {
    plan.max_connections = requested.max_connections;
  } else {
    // A thirty-second of left, but no more than what the budgets set leave
    // (an eighth of it when the in-flight budget is derived from the rest),
    // so that budgets which fit before connections were planned still fit.
    const double rest = std::max(
        0.0, static_cast<double>(limit.bytes) - planned -
                 static_cast<double>(std::max<int64_t>(0, max_inflight_bytes)));
    const double bytes = std::min(static_cast<double>(left / 32),
                                  max_inflight_bytes > 0 ? rest : rest / 8);
    plan.max_connections = static_cast<int64_t>(bytes) / kConnectionBytes;
    if (plan.max_connections < kLeastDerivedConnections) {
      // At least 64 where they fit, and one (which may not) where not.
      plan.max_connections = std::max<int64_t>(
          1, std::min(kLeastDerivedConnections,
                      static_cast<int64_t>(rest) / kConnectionBytes));
    }
  }
  const double fixed =
      planned + static_cast<double>(plan.max_connections) * kConnectionBytes;
  if (max_inflight_bytes > 0) {
    plan.max_inflight_bytes = max_inflight_bytes;
  } else {
    const double rest = static_cast<double>(limit.bytes) - fixed;
    plan.max_inflight_bytes =
        rest >= 4.0 ? static_cast<int64_t>(rest * 0.75) : 0;
  }
  const double total = fixed + static_cast<double>(plan.max_inflight_bytes);
  // Derived, at least 32 MiB: below it nearly every call is refused for the
  // budget while the server says it serves.
  const int64_t least =
      max_inflight_bytes > 0 ? int64_t{1} << 20 : kLeastDerivedInflightBytes;
  if (plan.max_inflight_bytes < least ||
      total > static_cast<double>(limit.bytes)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the memory budgets do not fit the memory limit: max_weights_bytes ",
        plan.max_weights_bytes, " + kv_cache_bytes ", plan.kv_cache_bytes,
        " + buffer_pool_bytes ", plan.buffer_pool_bytes, " + max_connections ",
        plan.max_connections, " of ", kConnectionBytes, " bytes",
        " + max_inflight_bytes ",
        max_inflight_bytes > 0 ? absl::StrCat(plan.max_inflight_bytes)
        : plan.max_inflight_bytes > 0
            ? absl::StrCat("(derived: ", plan.max_inflight_bytes, ")")
            : std::string("(derived: none left)"),
        " + ", kProcessOverheadBytes,
        " for the process = ", static_cast<int64_t>(std::min(total, 9.2e18)),
        " bytes, expected at most the ", limit.bytes, " bytes of ",
        limit.source, ", and at least ", least >> 20,
        " MiB for calls in flight; lower the budgets or raise that limit"));
  }
  plan.transport_bytes = plan.max_inflight_bytes / 4;
  return plan;
}

}  // namespace attnserve
