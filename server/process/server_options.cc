#include "attnserve/server/server_options.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attnserve/common/echo.h"
#include "attnserve/server/rpc/wire_messages.h"

namespace attnserve {
namespace {

absl::Status OutOfRange(const char* name, int64_t value, const char* expected) {
  return absl::InvalidArgumentError(
      absl::StrCat(name, " is ", value, ", expected ", expected));
}

// The addresses a listen on `address` binds, as 16-byte IPv6 ones (IPv4 as
// ::ffff:a.b.c.d), or the name itself for a host name other than
// localhost, whose addresses only its bind learns.
std::set<std::string> BoundAddresses(absl::string_view address) {
  std::string text = absl::AsciiStrToLower(address);
  if (absl::StartsWith(text, "[") && absl::EndsWith(text, "]")) {
    text = text.substr(1, text.size() - 2);
  }
  const auto v4 = [](const in_addr& ip) {
    std::string bytes(16, '\0');
    bytes[10] = bytes[11] = '\xff';
    std::memcpy(&bytes[12], &ip, 4);
    return bytes;
  };
  in_addr ip4;
  in6_addr ip6;
  if (text == "localhost") {
    inet_pton(AF_INET, "127.0.0.1", &ip4);
    inet_pton(AF_INET6, "::1", &ip6);
    return {v4(ip4), std::string(reinterpret_cast<const char*>(&ip6), 16)};
  }
  if (inet_pton(AF_INET, text.c_str(), &ip4) == 1) return {v4(ip4)};
  if (inet_pton(AF_INET6, text.c_str(), &ip6) == 1) {
    return {std::string(reinterpret_cast<const char*>(&ip6), 16)};
  }
  return {text};
}

// Whether `bound` (BoundAddresses') is every interface: 0.0.0.0 or ::.
bool IsEveryInterface(const std::set<std::string>& bound) {
  return bound.count(std::string(16, '\0')) > 0 ||
         bound.count(std::string("\0\0\0\0\0\0\0\0\0\0\xff\xff\0\0\0\0", 16)) >
             0;
}

// Whether listening on `a` and `b` with one port could clash: addresses in
// common (localhost is 127.0.0.1 and ::1; 0:0::1 is ::1) or either every
// interface. Two host names are taken for two interfaces (if they are one,
// the second bind fails, naming the port).
bool AddressesMayOverlap(absl::string_view a, absl::string_view b) {
  const std::set<std::string> bound_a = BoundAddresses(a);
  const std::set<std::string> bound_b = BoundAddresses(b);
  if (IsEveryInterface(bound_a) || IsEveryInterface(bound_b)) return true;
  for (const std::string& address : bound_a) {
    if (bound_b.count(address) > 0) return true;
  }
  return false;
}

// What is wrong with `address` as an address to listen on, written so that
// no resolver could take it: a port in it, an IPv4 address out of range. ""
// if nothing is (a host name is resolved only at the bind).
std::string AddressMistake(absl::string_view address) {
  if (absl::StrContains(address, ':')) {
    in6_addr ip6;
    if (inet_pton(AF_INET6, std::string(address).c_str(), &ip6) == 1) {
      return "";
    }
    return "expected a host name or an IP address without a port (`port` "
           "and metrics_port give it), an IPv6 one with or without [ ]";
  }
  if (!address.empty() &&
      address.find_first_not_of("0123456789.") == absl::string_view::npos) {
    in_addr ip4;
    if (inet_pton(AF_INET, std::string(address).c_str(), &ip4) == 1) {
      return "";
    }
    return "expected an IPv4 address (four numbers of 0 to 255) or a host "
           "name";
  }
  return "";
}

}  // namespace

absl::Status ValidateServerOptions(const ServerOptions& options) {
  if (options.address.empty()) {
    // gRPC would take it for every interface, unasked.
    return absl::InvalidArgumentError(
        "address is empty, expected a host name or an IP address (0.0.0.0 "
        "or :: for every interface)");
  }
  // A name that cannot be one would fail at the bind, exit 1, as if the
  // network were not up yet: a supervisor would retry it forever.
  for (const auto& [name, address] :
       {std::pair<const char*, const std::string&>{"address", options.address},
        {"metrics_address", options.metrics_address}}) {
    const std::string mistake = AddressMistake(address);
    if (!mistake.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " is ", EchoText(address), ", ", mistake));
    }
  }
  if (options.port < 0 || options.port > 65535) {
    return OutOfRange("port", options.port, "0 to 65535");
  }
  if (options.metrics_port &&
      (*options.metrics_port < 0 || *options.metrics_port > 65535)) {
    return OutOfRange("metrics_port", *options.metrics_port, "0 to 65535");
  }
  const TransportOptions& transport = options.transport;
  if (transport.max_message_bytes <= 0 ||
      transport.max_message_bytes > std::numeric_limits<int>::max()) {
    return OutOfRange("transport.max_message_bytes",
                      transport.max_message_bytes, "1 to 2147483647");
  }
  // Durations have bounds: a flag of inf or nan is an infinite duration,
  // which would mean never (a drain that never ends, a batch that waits for
  // partners forever).
  const struct {
    const char* name;
    absl::Duration value;
    absl::Duration low;  // Exclusive if positive_only.
    bool positive_only;
    absl::Duration high;
    const char* expected;
  } durations[] = {
      {"transport.message_timeout", transport.message_timeout,
       absl::ZeroDuration(), true, absl::Hours(24), "> 0 and at most 24h"},
      {"transport.stream_idle_timeout", transport.stream_idle_timeout,
       absl::ZeroDuration(), true, absl::Hours(24), "> 0 and at most 24h"},
      {"scheduling.max_queue_delay", options.scheduling.max_queue_delay,
       absl::ZeroDuration(), false, absl::Seconds(10), "0 to 10s"},
      {"drain_grace", options.drain_grace, absl::ZeroDuration(), false,
       absl::Hours(1), "0 to 1h"},
      // gRPC takes milliseconds as an int.
      {"transport.max_connection_idle", transport.max_connection_idle,
       absl::ZeroDuration(), false, absl::Hours(24 * 24), "0 (never) to 24d"},
      {"transport.handshake_timeout", transport.handshake_timeout,
       absl::ZeroDuration(), true, absl::Hours(1), "> 0 and at most 1h"},
  };
  for (const auto& d : durations) {
    const bool low_ok = d.positive_only ? d.value > d.low : d.value >= d.low;
    if (!low_ok || d.value > d.high) {
      return absl::InvalidArgumentError(
          absl::StrCat(d.name, " is ", absl::FormatDuration(d.value),
                       ", expected ", d.expected));
    }
  }
  if (transport.max_client_resets_per_second < 0) {
    return OutOfRange("transport.max_client_resets_per_second",
                      transport.max_client_resets_per_second, ">= 0");
  }
  if (transport.response_compression != GRPC_COMPRESS_NONE &&
      transport.response_compression != GRPC_COMPRESS_GZIP &&
      transport.response_compression != GRPC_COMPRESS_DEFLATE) {
    return OutOfRange("transport.response_compression",
                      static_cast<int64_t>(transport.response_compression),
                      "GRPC_COMPRESS_NONE, GRPC_COMPRESS_GZIP or "
                      "GRPC_COMPRESS_DEFLATE");
  }
  if (transport.max_concurrent_streams < 1) {
    return OutOfRange("transport.max_concurrent_streams",
                      transport.max_concurrent_streams, ">= 1");
  }
  if (transport.io_threads < 0 || transport.io_threads > 256) {
    return OutOfRange("transport.io_threads", transport.io_threads, "0 to 256");
  }
  if (transport.io_spin < absl::ZeroDuration() ||
      transport.io_spin > absl::Seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "transport.io_spin is ", absl::FormatDuration(transport.io_spin),
        ", expected 0 to 1s"));
  }
  // More threads than any machine has cores would only fail every call (the
  // kernels size their scratch by the thread count).
  if (options.engine.num_threads < 0 || options.engine.num_threads > 4096) {
    return OutOfRange("engine.num_threads", options.engine.num_threads,
                      "0 (every core) to 4096");
  }
  const std::pair<const char*, int64_t> positive[] = {
      {"scheduling.executors", options.scheduling.executors},
      {"scheduling.max_queue", options.scheduling.max_queue},
      {"scheduling.max_batch", options.scheduling.max_batch},
      {"limits.max_elements", options.limits.max_elements},
      {"limits.max_request_memory_bytes",
       options.limits.max_request_memory_bytes}};
  for (const auto& [name, value] : positive) {
    if (value <= 0) return OutOfRange(name, value, "> 0");
  }
  if (options.scheduling.executors > 256) {
    return OutOfRange("scheduling.executors", options.scheduling.executors,
                      "at most 256");
  }
  const SessionOptions& sessions = options.sessions;
  const std::pair<const char*, int64_t> session_limits[] = {
      {"sessions.max_sessions", sessions.max_sessions},
      {"sessions.max_session_tokens", sessions.max_session_tokens},
      {"sessions.max_session_layers", sessions.max_session_layers},
      {"sessions.max_steps_per_call", sessions.max_steps_per_call}};
  for (const auto& [name, value] : session_limits) {
    if (value <= 0) return OutOfRange(name, value, "> 0");
  }
  const std::pair<const char*, int64_t> identity_caps[] = {
      {"sessions.max_sessions_per_identity",
       sessions.max_sessions_per_identity},
      {"sessions.kv_cache_bytes_per_identity",
       sessions.kv_cache_bytes_per_identity}};
  for (const auto& [name, value] : identity_caps) {
    if (value < 0) return OutOfRange(name, value, ">= 0 (0: no cap)");
  }
  if (sessions.max_steps_per_call > kMaxRepeatedEntries) {
    // Each step is a repeated entry (wire_messages.h).
    return OutOfRange("sessions.max_steps_per_call",
                      sessions.max_steps_per_call, "1 to 65536");
  }
  if (sessions.page_tokens < 1 || sessions.page_tokens > 4096) {
    return OutOfRange("sessions.page_tokens", sessions.page_tokens,
                      "1 to 4096");
  }
  if (options.weights_reload_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("weights_reload_interval is ",
                     absl::FormatDuration(options.weights_reload_interval),
                     ", expected zero (off) or positive"));
  }
  if (sessions.session_ttl < absl::Seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sessions.session_ttl is ", absl::FormatDuration(sessions.session_ttl),
        ", expected at least 1s"));
  }
  const ServerTlsOptions& tls = options.tls;
  if (tls.reload_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls.reload_interval is ", absl::FormatDuration(tls.reload_interval),
        ", expected zero (off) or positive"));
  }
  if (tls.cert_file.empty() != tls.key_file.empty() ||
      (!tls.client_ca_file.empty() && tls.cert_file.empty())) {
    return absl::InvalidArgumentError(
        "tls.cert_file and tls.key_file go together, and tls.client_ca_file "
        "needs them");
  }
  if (options.metrics_port && *options.metrics_port != 0 &&
      *options.metrics_port == options.port &&
      AddressesMayOverlap(options.address, options.metrics_address.empty()
                                               ? options.address
                                               : options.metrics_address)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics_port is ", *options.metrics_port,
        ", the same as `port`, on addresses that may share interfaces (",
        options.address, " and ",
        options.metrics_address.empty() ? options.address
                                        : options.metrics_address,
        "); expected another port"));
  }
  // The memory budgets are checked by PlanMemory.
  return absl::OkStatus();
}

std::string DescribeOptions(const ServerOptions& options,
                            const MemoryPlan& memory, int io_threads) {
  const TransportOptions& transport = options.transport;
  const SchedulerOptions& scheduling = options.scheduling;
  return absl::StrCat(
      options.engine.kernel == AttentionKernel::kAuto ? "fused" : "unfused",
      " attention", "; max_message_bytes=", transport.max_message_bytes,
      " max_workspace_bytes=", options.engine.max_workspace_bytes,
      " max_weights_bytes=", memory.max_weights_bytes,
      " kv_cache_bytes=", memory.kv_cache_bytes, " (kv_eviction=",
      options.sessions.eviction == EvictionPolicy::kLru ? "lru" : "none",
      " kv_page_tokens=", options.sessions.page_tokens,
      " max_sessions=", options.sessions.max_sessions,
      " max_sessions_per_identity=", options.sessions.max_sessions_per_identity,
      " kv_cache_bytes_per_identity=",
      options.sessions.kv_cache_bytes_per_identity,
      " max_session_tokens=", options.sessions.max_session_tokens,
      " session_ttl=", absl::FormatDuration(options.sessions.session_ttl), ")",
      " buffer_pool_bytes=", memory.buffer_pool_bytes,
      " max_inflight_bytes=", memory.max_inflight_bytes, " (",
      memory.transport_bytes, " for gRPC's buffers) of a memory limit of ",
      memory.limit.bytes, " (", memory.limit.source, ")",
      " max_connections=", memory.max_connections,
      " max_elements=", options.limits.max_elements,
      " max_request_memory_bytes=", options.limits.max_request_memory_bytes,
      " max_concurrent_streams=", transport.max_concurrent_streams,
      " handshake_timeout=", absl::FormatDuration(transport.handshake_timeout),
      " max_client_resets_per_second=", transport.max_client_resets_per_second,
      " compressed_requests=",
      transport.accept_compressed_requests ? "on" : "off",
      " response_compression=",
      transport.response_compression == GRPC_COMPRESS_GZIP      ? "gzip"
      : transport.response_compression == GRPC_COMPRESS_DEFLATE ? "deflate"
                                                                : "none",
      "; io_threads=", io_threads,
      " io_spin=", absl::FormatDuration(transport.io_spin),
      " executors=", scheduling.executors, " max_queue=", scheduling.max_queue,
      " max_batch=", scheduling.max_batch,
      " max_queue_delay=", absl::FormatDuration(scheduling.max_queue_delay),
      " drain_grace=", absl::FormatDuration(options.drain_grace), "; tls=",
      options.tls.cert_file.empty()
          ? "off"
          : absl::StrCat(options.tls.client_ca_file.empty() ? "on" : "mutual",
                         " tls_reload=",
                         absl::FormatDuration(options.tls.reload_interval)),
      " auth_token=", options.auth_token_file.empty() ? "off" : "on",
      " weights_admin_token=",
      options.weights_admin_token_file.empty() ? "off" : "on",
      " demo_weights=", options.demo_weights ? "on" : "off", " weights_dir=",
      options.weights_dir.empty()
          ? "(none)"
          : absl::StrCat(
                options.weights_dir, " (reload ",
                options.weights_reload_interval == absl::ZeroDuration()
                    ? "off"
                    : absl::FormatDuration(options.weights_reload_interval),
                ")"),
      "; log_level=", LogLevelName(options.log_level),
      " access_log=", options.access_log.empty() ? "off" : options.access_log);
}

}  // namespace attnserve
