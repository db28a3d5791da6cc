// attnserve's command-line flags: each sets one ServerOptions field and takes
// its default from the library's option structs.
#include "flags.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "attnserve/common/echo.h"
#include "attnserve/common/flags_help.h"
#include "attnserve/common/log.h"
#include "attnserve/common/status_macros.h"

namespace {

// The defaults of every flag but --metrics_port and --drain_grace_seconds:
// the library's own.
const attnserve::ServerOptions& Defaults() {
  static const attnserve::ServerOptions* const defaults =
      new attnserve::ServerOptions();
  return *defaults;
}

// The binary's own defaults, where a served process wants other than the
// library: metrics on, and a drain that gives load balancers time to notice.
constexpr int kDefaultMetricsPort = 9464;
constexpr double kDefaultDrainGraceSeconds = 5;

}  // namespace

ABSL_FLAG(std::string, address, Defaults().address,
          "Address to listen on (IPv4, IPv6 or host name).");
ABSL_FLAG(int, port, Defaults().port,
          "gRPC port; 0 picks a free one, printed at start-up.");
ABSL_FLAG(int, threads, Defaults().engine.num_threads,
          "OpenMP threads per executor, 0 to 4096; 0: OpenMP's threads "
          "(OMP_NUM_THREADS, else the cores the process may use) divided "
          "among the executors.");
ABSL_FLAG(int, executors, Defaults().scheduling.executors,
          "Compute executors: requests computed at once, each on --threads "
          "threads; 1 to 256.");
ABSL_FLAG(
    int, io_threads, Defaults().transport.io_threads,
    "Threads that poll gRPC and run the handlers (parse, validate, "
    "serialise, and calls too small to hand to an executor), 0 to 256; 0: "
    "one per 8 compute cores (--threads x --executors), at least 1, at most "
    "8.");
ABSL_FLAG(int64_t, io_spin_us,
          absl::ToInt64Microseconds(Defaults().transport.io_spin),
          "While calls come within this many µs of each other, the first io "
          "thread keeps polling this long after each event instead of "
          "sleeping (not while a call computes on an executor), so that a "
          "client's next call is taken without a wake-up; costs up to a core "
          "while they do. 0 to 1000000; 0: never spins.");
ABSL_FLAG(int, max_queue, Defaults().scheduling.max_queue,
          "Requests waiting for an executor, taken in turns among clients "
          "(a caller's address, with its bearer token or client certificate "
          "where it has one); past it new ones get RESOURCE_EXHAUSTED, or "
          "take the newest place of a client holding at least two more.");
ABSL_FLAG(int, max_batch, Defaults().scheduling.max_batch,
          "Most Attend requests (alike in shape and options, unary or "
          "streamed; not decode the paged kernel reads, Lq = 1) computed "
          "together in one call, each "
          "answered the bits it gets alone; 1 turns dynamic batching off.");
ABSL_FLAG(int64_t, max_queue_delay_us,
          absl::ToInt64Microseconds(Defaults().scheduling.max_queue_delay),
          "How long the first request of a possible batch waits for partners, "
          "in µs, never past the moment a queued request has waited that "
          "long; at most 10 s; 0 batches only what is already queued (no "
          "added latency).");
ABSL_FLAG(int, max_concurrent_streams,
          Defaults().transport.max_concurrent_streams,
          "HTTP/2 streams one connection may have open at once (advertised "
          "in SETTINGS), at least 1; a client past it waits for one to "
          "end.");
ABSL_FLAG(int, max_client_resets_per_second,
          Defaults().transport.max_client_resets_per_second,
          "Calls one connection's client may cancel in a second before the "
          "server shuts that connection down (rapid-reset floods); a client "
          "answered in that second (calls finished OK, stream messages) may "
          "cancel as many more, up to four times this in all. Calls whose "
          "deadline passed, or that the server cancels for a stalled "
          "transfer, do not count. 0: no limit.");
ABSL_FLAG(double, message_timeout_seconds,
          absl::ToDoubleSeconds(Defaults().transport.message_timeout),
          "How long a unary call's request may take to arrive after its call "
          "starts, and its answer, plus a second per MiB, to be taken by the "
          "client once sent; past it the call is cancelled (a client that "
          "stops sending or reading holds no memory). At most 24 h.");
ABSL_FLAG(double, stream_idle_timeout_seconds,
          absl::ToDoubleSeconds(Defaults().transport.stream_idle_timeout),
          "How long an AttendStream may wait for its next whole message, or "
          "for its client to take an answer (plus a second per MiB); past it "
          "the stream is cancelled (an idle, stalled or unread stream is not "
          "held open forever). At most 24 h.");
ABSL_FLAG(double, handshake_timeout_seconds,
          absl::ToDoubleSeconds(Defaults().transport.handshake_timeout),
          "How long a new connection may take to finish its TLS handshake and "
          "send HTTP/2's preface; past it the server closes it, so that "
          "connections that never start hold no place under "
          "--max_connections. At most 1 h.");
ABSL_FLAG(double, max_connection_idle_seconds,
          absl::ToDoubleSeconds(Defaults().transport.max_connection_idle),
          "How long a connection with no call open may stay before the "
          "server ends it (GOAWAY; a client's next call reconnects unseen), "
          "so that abandoned connections and vanished peers give their "
          "descriptors back. 0 (never) to 2073600 (24 days).");
ABSL_FLAG(std::string, response_compression, "none",
          "Compress responses with gzip or deflate for clients that accept "
          "it (their grpc-accept-encoding), or none. Costs CPU and saves "
          "little on dense float tensors; helps masks and sparse outputs.");
ABSL_FLAG(bool, accept_compressed_requests,
          Defaults().transport.accept_compressed_requests,
          "Take requests compressed with gzip or deflate. Off: they get "
          "UNIMPLEMENTED unread. On: the server inflates them itself, "
          "stopping with RESOURCE_EXHAUSTED once the output passes "
          "--max_message_bytes (gRPC 1.51's own decompression would inflate "
          "a whole message first).");
ABSL_FLAG(int64_t, max_message_bytes, Defaults().transport.max_message_bytes,
          "Largest request or response message in bytes (at most 2147483647).");
ABSL_FLAG(int64_t, max_elements, Defaults().limits.max_elements,
          "Most elements of any one tensor a request carries (weights "
          "excepted: max_weights_bytes bounds them), and of a session step's "
          "output; an Attend's output is bounded by max_request_memory_bytes.");
ABSL_FLAG(int64_t, max_request_memory_bytes,
          Defaults().limits.max_request_memory_bytes,
          "Most memory one request's compute may allocate (outputs, weights, "
          "conversions, scratch), in bytes.");
ABSL_FLAG(int64_t, max_workspace_bytes, Defaults().engine.max_workspace_bytes,
          "Most scratch memory the attention kernel may allocate for one "
          "request, in bytes.");
ABSL_FLAG(int, metrics_port, kDefaultMetricsPort,
          "Port of the Prometheus /metrics endpoint (on --metrics_address, or "
          "--address); 0 "
          "turns it off.");
ABSL_FLAG(std::string, metrics_address, Defaults().metrics_address,
          "Address of the /metrics endpoint; empty: --address. Scrapes need "
          "no token: keep it on an internal address where that matters.");
ABSL_FLAG(std::string, attention_kernel, "fused",
          "SDPA's path: \"fused\" (the tiled kernel, which never holds the "
          "Lq x Lk scores; requests asking for attention weights still take "
          "the unfused path) or \"unfused\" (always materialise the scores, "
          "for comparisons).");
ABSL_FLAG(bool, portable_kernels, Defaults().engine.portable_kernels,
          "Run the fused kernel's portable C++ code even on a CPU with "
          "AVX-512 (for comparisons and to rule the vector code out).");
ABSL_FLAG(
    int64_t, max_weights_bytes, Defaults().memory.max_weights_bytes,
    "Most bytes of registered weights the server holds; 0: a quarter of "
    "what the memory limit (the cgroup's, or physical memory) leaves after "
    "256 MiB for the process and the buffer pool, at most 4 GiB.");
ABSL_FLAG(int64_t, kv_cache_bytes, Defaults().memory.kv_cache_bytes,
          "Most bytes of KV-cache pages the sessions hold, never exceeded; "
          "0: a quarter of what the memory limit (the cgroup's, or physical "
          "memory) leaves after 256 MiB for the process and the buffer "
          "pool.");
ABSL_FLAG(std::string, kv_eviction, "lru",
          "Past --kv_cache_bytes or --max_sessions: \"lru\" evicts the "
          "least recently used sessions no step is using (their next call "
          "gets NOT_FOUND, evicted); \"none\" refuses the new work with "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, kv_page_tokens, Defaults().sessions.page_tokens,
          "Tokens per KV-cache page (a page holds them for every kv head of "
          "one layer); 1 to 4096.");
ABSL_FLAG(int64_t, max_sessions, Defaults().sessions.max_sessions,
          "Most sessions the server holds at once.");
ABSL_FLAG(int64_t, max_sessions_per_identity,
          Defaults().sessions.max_sessions_per_identity,
          "Most sessions one caller (a token, or a client certificate) holds "
          "at once; past it its own least recently used idle session is "
          "evicted (--kv_eviction=lru) or the new one refused (none). 0: no "
          "cap but --max_sessions.");
ABSL_FLAG(int64_t, kv_cache_bytes_per_identity,
          Defaults().sessions.kv_cache_bytes_per_identity,
          "Most bytes of --kv_cache_bytes one caller's sessions hold; past it "
          "its own least recently used idle sessions are evicted "
          "(--kv_eviction=lru) or the step refused (none). 0: no cap but "
          "--kv_cache_bytes.");
ABSL_FLAG(int64_t, max_session_tokens, Defaults().sessions.max_session_tokens,
          "Most tokens one layer of a session may hold; caps and defaults "
          "CreateSession's max_tokens.");
ABSL_FLAG(int64_t, max_session_layers, Defaults().sessions.max_session_layers,
          "Most layers a session may have.");
ABSL_FLAG(double, session_ttl_seconds,
          absl::ToDoubleSeconds(Defaults().sessions.session_ttl),
          "Seconds without a Step, ForkSession or TruncateSession after which "
          "a session expires (GetSession and ListSessions only look); caps "
          "and defaults CreateSession's ttl_seconds. 1 to 1e9.");
ABSL_FLAG(std::string, replica_name, "",
          "The name CreateSession reports as this replica's (with an "
          "incarnation drawn at start-up); empty: the host name, a "
          "Kubernetes pod's name. Up to 253 characters of [A-Za-z0-9._-].");
ABSL_FLAG(int64_t, max_steps_per_call, Defaults().sessions.max_steps_per_call,
          "Most session steps one Step call may carry, 1 to 65536.");
ABSL_FLAG(int64_t, max_inflight_bytes, Defaults().memory.max_inflight_bytes,
          "Memory that requests in flight may hold at once, from the "
          "transport's buffers (a quarter) through the queue and the compute "
          "to the answer's send; past it calls get RESOURCE_EXHAUSTED at "
          "once. 0: three quarters of what the memory limit leaves after the "
          "weights, the KV cache (--kv_cache_bytes), the buffer pool and "
          "256 MiB for the process. Budgets that do not fit the limit stop "
          "start-up (exit 2).");
ABSL_FLAG(
    int64_t, max_connections, Defaults().memory.max_connections,
    "Most connections the gRPC port holds open at once, each planned at "
    "32 KiB of the memory limit; past it a new connection is closed as "
    "soon as accepted, and past seven eighths of it one from an address "
    "holding 4 F^2 / max_connections or more with F places free (a "
    "sixteenth at seven eighths, the last places only for addresses "
    "holding none). 0: a thirty-second of what the memory limit leaves "
    "after 256 MiB for the process, in connections of 32 KiB, but at most "
    "what the budgets set leave (an eighth of it when "
    "--max_inflight_bytes is derived too), at least 64 where they fit.");
ABSL_FLAG(int64_t, buffer_pool_bytes, Defaults().memory.buffer_pool_bytes,
          "Memory kept between calls for tensor bytes (requests parsed into "
          "it, responses sent from it), so that large tensors do not fault in "
          "fresh pages; 0 keeps none. -1: an eighth of what the memory limit "
          "leaves after 256 MiB for the process, at most 256 MiB.");
ABSL_FLAG(bool, demo_weights, Defaults().demo_weights,
          "Register the built-in `demo` weight set (E=64, H=8) at start-up; "
          "turn off in production, where only your own sets should answer.");
ABSL_FLAG(std::string, weights_dir, Defaults().weights_dir,
          "Folder of weight sets to register at start-up: one folder per name "
          "holding config.txt (num_heads=H, optionally version=N) and "
          "w_q/w_k/w_v/w_o[/b_*].npy; looked at again every "
          "--weights_reload_seconds.");
ABSL_FLAG(double, weights_reload_seconds,
          absl::ToDoubleSeconds(Defaults().weights_reload_interval),
          "Seconds between looks at --weights_dir for sets added, changed "
          "(registered at their new version) or removed (deleted): 0.1 to "
          "1e9, or 0: only at start-up.");
ABSL_FLAG(double, drain_grace_seconds, kDefaultDrainGraceSeconds,
          "On SIGTERM, SIGINT or SIGHUP: seconds between health turning "
          "NOT_SERVING and refusing new calls with UNAVAILABLE (0 to 3600); "
          "then queued and running work has 30 s more to finish (what still "
          "runs is cancelled) and the process exits 0.");
ABSL_FLAG(std::string, tls_cert, Defaults().tls.cert_file,
          "PEM certificate chain for TLS; empty: plaintext.");
ABSL_FLAG(std::string, tls_key, Defaults().tls.key_file,
          "PEM private key for --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, Defaults().tls.client_ca_file,
          "PEM CA bundle; when set, clients must present a certificate one of "
          "its CAs signed (mTLS), and a certificate's issuer (name and key), "
          "subject and subject alternative names own its sessions.");
ABSL_FLAG(double, tls_reload_seconds,
          absl::ToDoubleSeconds(Defaults().tls.reload_interval),
          "Seconds between reads of --tls_cert, --tls_key and --tls_client_ca "
          "(renewed in place by cert-manager or a SPIFFE agent): a changed "
          "set that passes the start-up checks is served to new connections; "
          "one that fails them is logged and the last good set stays. 1 to "
          "86400, or 0: only at start-up.");
ABSL_FLAG(std::string, log_level, LogLevelName(Defaults().log_level),
          "The server's own log lines to write: debug, info (the start-up "
          "line, drains), warning (weights folders that failed to load; "
          "gRPC's own errors, escaped, at most one every 10 s from each "
          "place) or error; debug also turns on gRPC's debug logs.");
ABSL_FLAG(std::string, access_log, Defaults().access_log,
          "One JSON line per call (RPC, status, bytes, queue/compute/server "
          "time, peer, weights and session; no tensor data, no token) to "
          "stdout, stderr or a file appended to; empty: none.");
ABSL_FLAG(
    std::string, auth_token_file, Defaults().auth_token_file,
    "File holding bearer tokens, one per line (lines starting with # are "
    "comments; at most 4096 bytes a token); every call except health checks "
    "must carry one as \"authorization: Bearer <token>\", and each token "
    "owns its own sessions. Empty: no token.");
ABSL_FLAG(std::string, weights_admin_token_file,
          Defaults().weights_admin_token_file,
          "File holding the bearer tokens (one per line, as "
          "--auth_token_file's) of which PutWeights and DeleteWeights must "
          "carry one (PERMISSION_DENIED for another token); they are taken "
          "for every other call too. Empty: any caller the server admits may "
          "put or delete weight sets.");

namespace attnserve {

const char kUsage[] =
    "attnserve [FLAGS]: serves multi-head attention over gRPC until SIGINT, "
    "SIGTERM or SIGHUP, then drains (a second SIGINT or SIGTERM exits at "
    "once). Every "
    "flag also reads ATTNSERVE_<FLAG> from the "
    "environment (the command line wins). --help lists the flags, --version "
    "prints the version, --only_check_args makes every check start-up makes "
    "to the flags (ranges, memory plan) and exits: 0, or 2 with the "
    "refusal.";

namespace {

// Each flag and the ServerOptions field it sets, which the library names in
// its messages: start-up errors are shown with the flag instead.
struct FlagOption {
  const char* flag;
  const char* option;
};
constexpr FlagOption kFlags[] = {
    {"address", "address"},
    {"port", "port"},
    {"threads", "engine.num_threads"},
    {"executors", "scheduling.executors"},
    {"io_threads", "transport.io_threads"},
    {"io_spin_us", "transport.io_spin"},
    {"max_queue", "scheduling.max_queue"},
    {"max_batch", "scheduling.max_batch"},
    {"max_queue_delay_us", "scheduling.max_queue_delay"},
    {"max_message_bytes", "transport.max_message_bytes"},
    {"max_elements", "limits.max_elements"},
    {"max_request_memory_bytes", "limits.max_request_memory_bytes"},
    {"max_workspace_bytes", "engine.max_workspace_bytes"},
    {"attention_kernel", "engine.kernel"},
    {"portable_kernels", "engine.portable_kernels"},
    {"metrics_port", "metrics_port"},
    {"metrics_address", "metrics_address"},
    {"max_concurrent_streams", "transport.max_concurrent_streams"},
    {"max_client_resets_per_second", "transport.max_client_resets_per_second"},
    {"accept_compressed_requests", "transport.accept_compressed_requests"},
    {"response_compression", "transport.response_compression"},
    {"message_timeout_seconds", "transport.message_timeout"},
    {"stream_idle_timeout_seconds", "transport.stream_idle_timeout"},
    {"max_connection_idle_seconds", "transport.max_connection_idle"},
    {"handshake_timeout_seconds", "transport.handshake_timeout"},
    {"max_weights_bytes", "memory.max_weights_bytes"},
    {"max_inflight_bytes", "memory.max_inflight_bytes"},
    {"max_connections", "memory.max_connections"},
    {"kv_cache_bytes", "memory.kv_cache_bytes"},
    {"kv_eviction", "sessions.eviction"},
    {"kv_page_tokens", "sessions.page_tokens"},
    {"max_sessions", "sessions.max_sessions"},
    {"max_sessions_per_identity", "sessions.max_sessions_per_identity"},
    {"kv_cache_bytes_per_identity", "sessions.kv_cache_bytes_per_identity"},
    {"max_session_tokens", "sessions.max_session_tokens"},
    {"max_session_layers", "sessions.max_session_layers"},
    {"session_ttl_seconds", "sessions.session_ttl"},
    {"max_steps_per_call", "sessions.max_steps_per_call"},
    {"replica_name", "sessions.replica_name"},
    {"buffer_pool_bytes", "memory.buffer_pool_bytes"},
    {"demo_weights", "demo_weights"},
    {"weights_dir", "weights_dir"},
    {"weights_reload_seconds", "weights_reload_interval"},
    {"drain_grace_seconds", "drain_grace"},
    {"tls_cert", "tls.cert_file"},
    {"tls_key", "tls.key_file"},
    {"tls_client_ca", "tls.client_ca_file"},
    {"tls_reload_seconds", "tls.reload_interval"},
    {"auth_token_file", "auth_token_file"},
    {"weights_admin_token_file", "weights_admin_token_file"},
    {"log_level", "log_level"},
    {"access_log", "access_log"}};

}  // namespace

namespace {

// Adds the name `argument` sets ("--port=1" and "-port" set "port",
// "--nodemo_weights" sets "demo_weights": "no" before a boolean flag's name)
// to `names`; false if it is no flag (a value, "-", "--").
bool AddFlagName(absl::string_view argument, std::set<std::string>* names) {
  if (!absl::ConsumePrefix(&argument, "--") &&
      !absl::ConsumePrefix(&argument, "-")) {
    return false;
  }
  absl::string_view name = argument.substr(0, argument.find('='));
  if (name.empty()) return false;
  if (absl::StartsWith(name, "no")) {
    const absl::CommandLineFlag* flag =
        absl::FindCommandLineFlag(name.substr(2));
    if (flag != nullptr && flag->IsOfType<bool>()) name.remove_prefix(2);
  }
  names->insert(std::string(name));
  return true;
}

// The flags the command line sets, in its own arguments and in the files its
// --flagfile arguments name. A flag file that cannot be read adds nothing:
// FlagArgumentsError names it.
std::set<std::string> CommandLineFlags(int argc, char** argv) {
  const std::vector<absl::string_view> args(argv + 1, argv + argc);
  absl::StatusOr<std::vector<FlagArgument>> arguments = ExpandFlagFiles(args);
  if (!arguments.ok()) {
    arguments.emplace();
    for (const absl::string_view arg : args) {
      arguments->push_back({std::string(arg), ""});
    }
  }
  std::set<std::string> names;
  for (const FlagArgument& argument : *arguments) {
    if (argument.text == "--") break;
    AddFlagName(argument.file.empty()
                    ? absl::string_view(argument.text)
                    : absl::StripTrailingAsciiWhitespace(argument.text),
                &names);
  }
  return names;
}

// An address as the options take it: an IPv6 literal written as in a URL,
// "[::1]", without its brackets (getaddrinfo knows no brackets).
std::string WithoutBrackets(std::string address) {
  if (address.size() >= 2 && address.front() == '[' && address.back() == ']') {
    return address.substr(1, address.size() - 2);
  }
  return address;
}

}  // namespace

// argv with "--flag=value" for each ATTNSERVE_FLAG in the environment whose
// flag the command line (or a --flagfile it names) does not set, inserted
// before the command line's own arguments. A variable is ignored where the
// command line sets its flag, so that one it overrides cannot stop the start
// (Kubernetes' service links set ATTNSERVE_PORT=tcp://10.0.0.1:50051 in every
// pod of a namespace with a Service named attnserve).
std::vector<char*> ArgumentsWithEnvironment(int argc, char** argv,
                                            std::vector<std::string>* storage) {
  const std::set<std::string> set_here = CommandLineFlags(argc, argv);
  for (const FlagOption& entry : kFlags) {
    if (set_here.count(entry.flag) > 0) continue;
    const char* value =
        std::getenv(("ATTNSERVE_" + absl::AsciiStrToUpper(entry.flag)).c_str());
    if (value != nullptr) {
      storage->push_back(absl::StrCat("--", entry.flag, "=", value));
    }
  }
  std::vector<char*> arguments = {argv[0]};
  for (std::string& argument : *storage) arguments.push_back(argument.data());
  for (int i = 1; i < argc; ++i) arguments.push_back(argv[i]);
  return arguments;
}

std::string WithEnvironmentNames(absl::string_view error,
                                 const std::vector<std::string>& environment) {
  // Each flag the environment gave that the error names, in the order named.
  std::vector<std::pair<size_t, absl::string_view>> named;
  for (const std::string& argument : environment) {
    const absl::string_view flag =
        absl::string_view(argument).substr(0, argument.find('='));
    for (size_t at = error.find(flag); at != absl::string_view::npos;
         at = error.find(flag, at + 1)) {
      const size_t end = at + flag.size();
      if (end == error.size() ||
          !(absl::ascii_isalnum(static_cast<unsigned char>(error[end])) ||
            error[end] == '_')) {
        named.emplace_back(at, flag);
        break;
      }
    }
  }
  if (named.empty()) return std::string(error);
  std::sort(named.begin(), named.end());
  const auto variable = [](absl::string_view flag) {
    return absl::StrCat("ATTNSERVE_", absl::AsciiStrToUpper(flag.substr(2)));
  };
  // "[CODE: ]--max_batch is 0, ...": the refused flag, whatever else it names.
  for (const auto& [at, flag] : named) {
    if (absl::StartsWith(error.substr(at + flag.size()), " is ") &&
        (at == 0 || absl::EndsWith(error.substr(0, at), ": "))) {
      return absl::StrCat(error, " (from the environment's ", variable(flag),
                          "; a command-line ", flag, " replaces it)");
    }
  }
  std::vector<std::string> sources;
  for (const auto& [at, flag] : named) {
    sources.push_back(absl::StrCat(flag, " from ", variable(flag)));
  }
  return absl::StrCat(error,
                      " (from the environment: ", absl::StrJoin(sources, ", "),
                      "; a command-line flag replaces its variable)");
}

// `message` with each option it names ("scheduling.max_batch", or a field's
// own name where that has an underscore, "max_weights_bytes") shown as its
// flag ("--max_batch"). A plain word ("address", "port") is an option only
// where a refusal of it starts ("port is 70000") or in backquotes
// ("`port`"): elsewhere it is English, as in the system's "Cannot assign
// requested address". Names inside paths are left alone.
std::string WithFlagNames(absl::string_view message) {
  absl::flat_hash_map<std::string, std::string> flags;
  absl::flat_hash_map<std::string, std::string> plain_words;
  for (const FlagOption& entry : kFlags) {
    const std::string flag = absl::StrCat("--", entry.flag);
    const absl::string_view option = entry.option;
    if (!absl::StrContains(option, '.') && !absl::StrContains(option, '_')) {
      plain_words[entry.option] = flag;
      continue;
    }
    flags[entry.option] = flag;
    const absl::string_view field = option.substr(option.rfind('.') + 1);
    if (absl::StrContains(field, '_')) flags.emplace(std::string(field), flag);
  }
  const auto is_name_char = [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' ||
           c == '.';
  };
  std::string out;
  size_t i = 0;
  while (i < message.size()) {
    if (!is_name_char(message[i])) {
      out += message[i++];
      continue;
    }
    size_t end = i;
    while (end < message.size() && is_name_char(message[end])) ++end;
    absl::string_view name = message.substr(i, end - i);
    absl::string_view trailing;
    while (absl::EndsWith(name, ".")) {
      name.remove_suffix(1);
      trailing = message.substr(i + name.size(), end - i - name.size());
    }
    const bool in_path =
        (i > 0 && (message[i - 1] == '/' || message[i - 1] == '-')) ||
        (end < message.size() && message[end] == '/');
    const std::string* flag = nullptr;
    if (const auto found = flags.find(name); found != flags.end()) {
      flag = &found->second;
    }
    // A plain word in backquotes: "`port`" shows as "--port".
    const bool quoted = trailing.empty() && i > 0 && message[i - 1] == '`' &&
                        end < message.size() && message[end] == '`';
    if (flag == nullptr && trailing.empty() &&
        (quoted || absl::StartsWith(message.substr(end), " is "))) {
      if (const auto found = plain_words.find(name);
          found != plain_words.end()) {
        flag = &found->second;
      }
    }
    if (flag != nullptr && !in_path) {
      if (quoted) out.pop_back();  // The opening backquote.
      absl::StrAppend(&out, *flag, trailing);
      if (quoted) ++end;  // The closing one.
    } else {
      absl::StrAppend(&out, message.substr(i, end - i));
    }
    i = end;
  }
  return out;
}

namespace {

// The duration a flag of seconds gives, if NaN is refused there (naming the
// flag), as absl::Seconds would take it for infinity. With a `range`, only
// in it, which `expected` states; the library checks its own ranges of the
// others.
struct SecondsRange {
  double min;
  double max;
  const char* expected;
};
absl::StatusOr<absl::Duration> SecondsFlag(
    absl::string_view flag, double seconds,
    std::optional<SecondsRange> range = std::nullopt) {
  // Past 1e12 s (31,700 years) absl::Seconds gives an infinite duration,
  // which the options' own checks would name as "inf", not as typed.
  if (std::isnan(seconds) ||
      (range && !(seconds >= range->min && seconds <= range->max)) ||
      std::fabs(seconds) > 1e12) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " is ", seconds, ", expected ",
                     range ? range->expected
                           : "a number of seconds (--help gives its range)"));
  }
  return absl::Seconds(seconds);
}

}  // namespace

absl::StatusOr<ServerOptions> OptionsFromFlags() {
  attnserve::ServerOptions options;
  options.address = WithoutBrackets(absl::GetFlag(FLAGS_address));
  options.port = absl::GetFlag(FLAGS_port);
  attnserve::EngineOptions& engine = options.engine;
  engine.num_threads = absl::GetFlag(FLAGS_threads);
  engine.max_workspace_bytes = absl::GetFlag(FLAGS_max_workspace_bytes);
  const std::string kernel = absl::GetFlag(FLAGS_attention_kernel);
  if (kernel == "fused") {
    engine.kernel = attnserve::AttentionKernel::kAuto;
  } else if (kernel == "unfused") {
    engine.kernel = attnserve::AttentionKernel::kUnfused;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--attention_kernel is ", EchoText(kernel),
                     ", expected fused or unfused"));
  }
  engine.portable_kernels = absl::GetFlag(FLAGS_portable_kernels);
  attnserve::SchedulerOptions& scheduling = options.scheduling;
  scheduling.executors = absl::GetFlag(FLAGS_executors);
  scheduling.max_queue = absl::GetFlag(FLAGS_max_queue);
  scheduling.max_batch = absl::GetFlag(FLAGS_max_batch);
  scheduling.max_queue_delay =
      absl::Microseconds(absl::GetFlag(FLAGS_max_queue_delay_us));
  options.limits.max_elements = absl::GetFlag(FLAGS_max_elements);
  options.limits.max_request_memory_bytes =
      absl::GetFlag(FLAGS_max_request_memory_bytes);
  attnserve::TransportOptions& transport = options.transport;
  transport.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  transport.max_concurrent_streams =
      absl::GetFlag(FLAGS_max_concurrent_streams);
  transport.max_client_resets_per_second =
      absl::GetFlag(FLAGS_max_client_resets_per_second);
  transport.accept_compressed_requests =
      absl::GetFlag(FLAGS_accept_compressed_requests);
  const std::string response_compression =
      absl::GetFlag(FLAGS_response_compression);
  if (response_compression == "none") {
    transport.response_compression = GRPC_COMPRESS_NONE;
  } else if (response_compression == "gzip") {
    transport.response_compression = GRPC_COMPRESS_GZIP;
  } else if (response_compression == "deflate") {
    transport.response_compression = GRPC_COMPRESS_DEFLATE;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("response_compression is ", EchoText(response_compression),
                     ", expected none, gzip or deflate"));
  }
  ATTNSERVE_ASSIGN_OR_RETURN(
      transport.message_timeout,
      SecondsFlag("message_timeout_seconds",
                  absl::GetFlag(FLAGS_message_timeout_seconds)));
  ATTNSERVE_ASSIGN_OR_RETURN(
      transport.stream_idle_timeout,
      SecondsFlag("stream_idle_timeout_seconds",
                  absl::GetFlag(FLAGS_stream_idle_timeout_seconds)));
  ATTNSERVE_ASSIGN_OR_RETURN(
      transport.max_connection_idle,
      SecondsFlag("max_connection_idle_seconds",
                  absl::GetFlag(FLAGS_max_connection_idle_seconds)));
  ATTNSERVE_ASSIGN_OR_RETURN(
      transport.handshake_timeout,
      SecondsFlag("handshake_timeout_seconds",
                  absl::GetFlag(FLAGS_handshake_timeout_seconds)));
  transport.io_threads = absl::GetFlag(FLAGS_io_threads);
  const int64_t io_spin_us = absl::GetFlag(FLAGS_io_spin_us);
  if (io_spin_us < 0 || io_spin_us > 1000000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--io_spin_us is ", io_spin_us, ", expected 0 to 1000000"));
  }
  transport.io_spin = absl::Microseconds(io_spin_us);
  options.memory.max_weights_bytes = absl::GetFlag(FLAGS_max_weights_bytes);
  options.memory.max_inflight_bytes = absl::GetFlag(FLAGS_max_inflight_bytes);
  options.memory.max_connections = absl::GetFlag(FLAGS_max_connections);
  options.memory.buffer_pool_bytes = absl::GetFlag(FLAGS_buffer_pool_bytes);
  options.memory.kv_cache_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
  const std::string eviction = absl::GetFlag(FLAGS_kv_eviction);
  if (eviction == "lru") {
    options.sessions.eviction = attnserve::EvictionPolicy::kLru;
  } else if (eviction == "none") {
    options.sessions.eviction = attnserve::EvictionPolicy::kNone;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_eviction is ", EchoText(eviction), ", expected lru or none"));
  }
  options.sessions.page_tokens = absl::GetFlag(FLAGS_kv_page_tokens);
  options.sessions.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  options.sessions.max_sessions_per_identity =
      absl::GetFlag(FLAGS_max_sessions_per_identity);
  options.sessions.kv_cache_bytes_per_identity =
      absl::GetFlag(FLAGS_kv_cache_bytes_per_identity);
  options.sessions.max_session_tokens = absl::GetFlag(FLAGS_max_session_tokens);
  options.sessions.max_session_layers = absl::GetFlag(FLAGS_max_session_layers);
  ATTNSERVE_ASSIGN_OR_RETURN(
      options.sessions.session_ttl,
      SecondsFlag("session_ttl_seconds",
                  absl::GetFlag(FLAGS_session_ttl_seconds),
                  SecondsRange{1, 1e9, "1 to 1e9"}));
  options.sessions.max_steps_per_call = absl::GetFlag(FLAGS_max_steps_per_call);
  options.sessions.replica_name = absl::GetFlag(FLAGS_replica_name);
  if (!attnserve::IsPlainName(options.sessions.replica_name, 253)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replica_name is ", attnserve::EchoText(options.sessions.replica_name),
        ", expected up to 253 characters of [A-Za-z0-9._-]"));
  }
  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  if (const double tls_reload = absl::GetFlag(FLAGS_tls_reload_seconds);
      tls_reload != 0) {
    ATTNSERVE_ASSIGN_OR_RETURN(
        options.tls.reload_interval,
        SecondsFlag("tls_reload_seconds", tls_reload,
                    SecondsRange{1, 86400,
                                 "0 (only at start-up), or 1 to "
                                 "86400"}));
  } else {
    options.tls.reload_interval = absl::ZeroDuration();
  }
  options.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  options.weights_admin_token_file =
      absl::GetFlag(FLAGS_weights_admin_token_file);
  options.metrics_address =
      WithoutBrackets(absl::GetFlag(FLAGS_metrics_address));
  if (absl::GetFlag(FLAGS_metrics_port) != 0) {
    options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  }
  ATTNSERVE_ASSIGN_OR_RETURN(
      options.drain_grace, SecondsFlag("drain_grace_seconds",
                                       absl::GetFlag(FLAGS_drain_grace_seconds),
                                       SecondsRange{0, 3600, "0 to 1h"}));
  options.demo_weights = absl::GetFlag(FLAGS_demo_weights);
  options.weights_dir = absl::GetFlag(FLAGS_weights_dir);
  const double reload = absl::GetFlag(FLAGS_weights_reload_seconds);
  if (reload != 0) {
    // A look lists the folder and reads every set's config.txt: more often
    // than ten times a second would keep a core busy for nothing.
    ATTNSERVE_ASSIGN_OR_RETURN(
        options.weights_reload_interval,
        SecondsFlag(
            "weights_reload_seconds", reload,
            SecondsRange{0.1, 1e9, "0 (only at start-up), or 0.1 to 1e9"}));
  } else {
    options.weights_reload_interval = absl::ZeroDuration();
  }
  const std::string level = absl::GetFlag(FLAGS_log_level);
  const std::optional<LogLevel> log_level = ParseLogLevel(level);
  if (!log_level) {
    return absl::InvalidArgumentError(
        absl::StrCat("log_level is ", EchoText(level),
                     ", expected debug, info, warning or error"));
  }
  options.log_level = *log_level;
  options.access_log = absl::GetFlag(FLAGS_access_log);
  return options;
}

}  // namespace attnserve
