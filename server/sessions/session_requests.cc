#include "attnserve/server/sessions/session_requests.h"

#include <cmath>
#include <optional>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "attnserve/common/echo.h"
#include "attnserve/common/refusals.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/core/attention_types.h"
#include "attnserve/server/sessions/page_arena.h"
#include "attnserve/server/tensors/tensor_checks.h"
#include "attnserve/server/tensors/tensor_codec.h"

namespace attnserve {
namespace {

// Heads and head dimensions beyond this are no attention anyone runs, and
// keep every product of them far from overflowing.
constexpr int64_t kMaxHeads = 4096;
constexpr int64_t kMaxHeadDim = 4096;

absl::Status CheckRange(absl::string_view field, int64_t value, int64_t low,
                        int64_t high, absl::string_view why = "") {
  if (value >= low && value <= high) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, " is ", value, ", expected ", low, " to ", high, why));
}

int64_t UnixMillis(absl::Time time) { return absl::ToUnixMillis(time); }

// The attention variant of SessionDefaults, into `config` (whose heads are
// known).
absl::Status ValidateVariant(const v1::SessionDefaults& defaults,
                             SessionConfig* config) {
  if (defaults.has_window_left()) {
    if (defaults.window_left() < -1) {
      return absl::InvalidArgumentError(
          absl::StrCat("defaults.window_left is ", defaults.window_left(),
                       ", expected -1 or absent (unbounded) or >= 0"));
    }
    config->window_left = defaults.window_left();
  }
  if (defaults.num_sink_tokens() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("defaults.num_sink_tokens is ", defaults.num_sink_tokens(),
                     ", expected >= 0"));
  }
  config->num_sink_tokens = defaults.num_sink_tokens();
  if (defaults.alibi_slopes_size() > 0) {
    if (defaults.alibi_slopes_size() != config->heads) {
      return absl::InvalidArgumentError(absl::StrCat(
          "defaults.alibi_slopes has ", defaults.alibi_slopes_size(),
          " slopes, expected ", config->heads, " (one per head, num_heads)"));
    }
    for (int h = 0; h < defaults.alibi_slopes_size(); ++h) {
      if (!std::isfinite(defaults.alibi_slopes(h))) {
        return absl::InvalidArgumentError(
            absl::StrCat("defaults.alibi_slopes[", h, "] is ",
                         defaults.alibi_slopes(h), ", expected finite"));
      }
    }
    config->alibi_slopes.assign(defaults.alibi_slopes().begin(),
                                defaults.alibi_slopes().end());
  }
  if (defaults.has_softcap()) {
    if (!IsValidSoftcap(defaults.softcap())) {
      return SoftcapRefusal("defaults.softcap", defaults.softcap());
    }
    config->softcap = defaults.softcap();
  }
  if (defaults.evict_outside_window() && config->window_left < 0) {
    return absl::InvalidArgumentError(
        "defaults.evict_outside_window is true without a window, expected "
        "defaults.window_left >= 0 (the tokens each query sees back)");
  }
  config->evict_outside_window = defaults.evict_outside_window();
  if (defaults.has_rope()) {
    config->rope = RotaryOf(defaults.rope());
    ATTNSERVE_RETURN_IF_ERROR(
        ValidateRotary(*config->rope, config->key_dim, "defaults.rope"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateSessionId(absl::string_view field, const std::string& id) {
  if (IsSessionId(id)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " is ", EchoText(id),
                   ", expected 32 lowercase hex digits (an id CreateSession "
                   "or ForkSession returned)"));
}

absl::StatusOr<SessionConfig> ValidateCreateSession(
    const v1::CreateSessionRequest& request, const SessionOptions& options) {
  if (!request.session_id().empty() && !IsSessionId(request.session_id())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session_id is ", EchoText(request.session_id()),
        ", expected empty (the server draws one) or 32 lowercase hex digits "
        "from a CSPRNG"));
  }
  SessionConfig config;
  if (absl::Status s =
          CheckRange("num_layers", request.num_layers(), 1,
                     options.max_session_layers, " (max_session_layers)");
      !s.ok()) {
    return s;
  }
  config.layers = request.num_layers();
  if (absl::Status s =
          CheckRange("num_heads", request.num_heads(), 1, kMaxHeads);
      !s.ok()) {
    return s;
  }
  config.heads = request.num_heads();
  config.kv_heads =
      request.num_kv_heads() == 0 ? config.heads : request.num_kv_heads();
  if (config.kv_heads < 1 || config.heads % config.kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_kv_heads is ", request.num_kv_heads(),
                     ", expected a divisor of num_heads ", config.heads,
                     " (0 means ", config.heads, ")"));
  }
  if (absl::Status s = CheckRange("key_dim", request.key_dim(), 1, kMaxHeadDim);
      !s.ok()) {
    return s;
  }
  config.key_dim = request.key_dim();
  config.value_dim =
      request.value_dim() == 0 ? config.key_dim : request.value_dim();
  if (absl::Status s = CheckRange("value_dim", config.value_dim, 1, kMaxHeadDim,
                                  " (0 means key_dim)");
      !s.ok()) {
    return s;
  }
  if (request.dtype() != v1::FLOAT32 && request.dtype() != v1::BFLOAT16 &&
      request.dtype() != v1::FLOAT16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dtype is ", DTypeName(request.dtype()),
        ", expected FLOAT32, BFLOAT16 or FLOAT16 (how the cache is stored)"));
  }
  config.dtype = ToDataType(request.dtype());
  config.max_tokens = request.max_tokens() == 0 ? options.max_session_tokens
                                                : request.max_tokens();
  if (absl::Status s = CheckRange("max_tokens", config.max_tokens, 1,
                                  options.max_session_tokens,
                                  " (max_session_tokens; 0 means it)");
      !s.ok()) {
    return s;
  }
  const int64_t ttl_cap = absl::ToInt64Seconds(options.session_ttl);
  if (absl::Status s =
          CheckRange("ttl_seconds", request.ttl_seconds(), 0, ttl_cap,
                     " (session_ttl_seconds; 0 means it)");
      !s.ok()) {
    return s;
  }
  config.ttl = request.ttl_seconds() == 0
                   ? options.session_ttl
                   : absl::Seconds(request.ttl_seconds());
  if (request.defaults().has_scale()) {
    if (!std::isfinite(request.defaults().scale())) {
      return absl::InvalidArgumentError(
          absl::StrCat("defaults.scale is ", request.defaults().scale(),
                       ", expected a finite number"));
    }
    config.scale = request.defaults().scale();
  }
  if (absl::Status s = ValidateVariant(request.defaults(), &config); !s.ok()) {
    return s;
  }
  const PageLayout layout = PageLayoutOf(config, options);
  const int64_t page_bytes = PageArena::Footprint(layout.PageBytes());
  // A session that could not hold its first page with its bookkeeping
  // could never take a token.
  const int64_t first_token = page_bytes + SessionBookkeepingBytes(config, 1);
  std::string over;
  if (page_bytes > options.max_page_bytes) {
    over = absl::StrCat("the page limit of ", options.max_page_bytes);
  } else if (first_token > options.kv_cache_bytes) {
    over = absl::StrCat("the KV cache budget (kv_cache_bytes) of ",
                        options.kv_cache_bytes);
  } else if (options.kv_cache_bytes_per_identity > 0 &&
             first_token > options.kv_cache_bytes_per_identity) {
    over = absl::StrCat("one caller's share (kv_cache_bytes_per_identity) of ",
                        options.kv_cache_bytes_per_identity);
  }
  if (!over.empty()) {
    return Permanent(absl::ResourceExhaustedError(absl::StrCat(
        "one page of this session (", layout.page_tokens,
        " tokens x num_kv_heads ", config.kv_heads, " x (key_dim ",
        config.key_dim, " + value_dim ", config.value_dim, ") x ",
        DataTypeBytes(config.dtype), " bytes) takes ", page_bytes, " bytes, ",
        first_token, " with the session's bookkeeping, over ", over,
        " bytes")));
  }
  return config;
}

absl::StatusOr<ForkPlan> ValidateForkSession(
    const v1::ForkSessionRequest& request, const SessionOptions& options) {
  if (absl::Status id = ValidateSessionId("session_id", request.session_id());
      !id.ok()) {
    return id;
  }
  ForkPlan plan;
  if (request.has_length()) {
    if (request.length() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("length is ", request.length(),
                       ", expected >= 0 (absent: every token)"));
    }
    plan.length = request.length();
  }
  if (absl::Status s =
          CheckRange("ttl_seconds", request.ttl_seconds(), 0,
                     absl::ToInt64Seconds(options.session_ttl),
                     " (session_ttl_seconds; 0 means the parent's)");
      !s.ok()) {
    return s;
  }
  plan.ttl = absl::Seconds(request.ttl_seconds());
  return plan;
}

absl::Status ValidateTruncateSession(
    const v1::TruncateSessionRequest& request) {
  if (absl::Status id = ValidateSessionId("session_id", request.session_id());
      !id.ok()) {
    return id;
  }
  if (request.length() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("length is ", request.length(), ", expected >= 0"));
  }
  return absl::OkStatus();
}

absl::Status CheckReplicaIncarnation(absl::string_view requested,
                                     const ReplicaIdentity& replica,
                                     absl::string_view what) {
  if (requested.empty() || requested == replica.incarnation) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "replica_incarnation is ", EchoText(requested), ", but this is replica ",
      replica.name, " incarnation ", replica.incarnation, ": ", what,
      " another process's (this replica restarted since, and its sessions went "
      "with it; or the call reached another replica: pin sessions to "
      "theirs)"));
}

void DescribeReplica(const ReplicaIdentity& replica,
                     v1::ReplicaIdentity* message) {
  message->set_name(replica.name);
  message->set_incarnation(replica.incarnation);
}

void DescribeSession(const SessionDescription& d, v1::SessionInfo* info) {
  const SessionConfig& c = d.config;
  info->set_session_id(d.id);
  info->set_num_layers(c.layers);
  info->set_num_heads(c.heads);
  info->set_num_kv_heads(c.kv_heads);
  info->set_key_dim(c.key_dim);
  info->set_value_dim(c.value_dim);
  info->set_dtype(c.dtype == DataType::kFloat32    ? v1::FLOAT32
                  : c.dtype == DataType::kBFloat16 ? v1::BFLOAT16
                                                   : v1::FLOAT16);
  info->set_max_tokens(c.max_tokens);
  info->set_ttl_seconds(absl::ToInt64Seconds(c.ttl));
  v1::SessionDefaults* defaults = info->mutable_defaults();
  if (c.scale) defaults->set_scale(*c.scale);
  if (c.window_left >= 0) defaults->set_window_left(c.window_left);
  defaults->set_num_sink_tokens(c.num_sink_tokens);
  for (const float slope : c.alibi_slopes) defaults->add_alibi_slopes(slope);
  if (c.softcap) defaults->set_softcap(*c.softcap);
  defaults->set_evict_outside_window(c.evict_outside_window);
  if (c.rope) {
    v1::RotaryEmbedding* rope = defaults->mutable_rope();
    rope->set_theta(c.rope->theta);
    rope->set_rotary_dim(c.rope->rotary_dim);
    rope->set_interleaved(c.rope->interleaved);
  }
  for (const int64_t length : d.lengths) info->add_lengths(length);
  info->set_bytes(d.bytes);
  info->set_shared_bytes(d.shared_bytes);
  info->set_created_unix_ms(UnixMillis(d.created));
  info->set_last_used_unix_ms(UnixMillis(d.last_used));
  info->set_forked_from(d.forked_from);
}

namespace {

// A page token: the last session's creation time (ns since the epoch) and id,
// the listing's order.
std::string PageToken(const SessionDescription& d) {
  return absl::StrCat(absl::ToUnixNanos(d.created), "-", d.id);
}

// Room in a message for what is not a session: the totals, the token, tags.
constexpr int64_t kListingOverheadBytes = 256;

}  // namespace

absl::Status ListSessionsPage(SessionStore& store, const std::string& owner,
                              const v1::ListSessionsRequest& request,
                              int64_t max_message_bytes,
                              v1::ListSessionsResponse* response) {
  if (request.page_size() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size is ", request.page_size(),
                     ", expected 0 (as many as fit) or more"));
  }
  std::optional<ListingPlace> after;
  if (!request.page_token().empty()) {
    const std::string& token = request.page_token();
    const size_t dash = token.find('-');
    after.emplace();
    after->id =
        dash == std::string::npos ? std::string() : token.substr(dash + 1);
    if (dash == std::string::npos ||
        !absl::SimpleAtoi(absl::string_view(token).substr(0, dash),
                          &after->created_ns) ||
        !IsSessionId(after->id)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "page_token is ", EchoText(token),
          ", expected empty or the next_page_token of a ListSessions answer"));
    }
  }
  const int64_t room = max_message_bytes - kListingOverheadBytes;
  int64_t used = 0;
  std::string last_token;  // Of the last session in the page.
  bool more = false;       // A session past the page.
  absl::Status status;
  const SessionListing listing =
      store.List(owner, after, [&](const SessionDescription& d) {
        if (request.page_size() > 0 &&
            response->sessions_size() >= request.page_size()) {
          more = true;
          return false;
        }
        v1::SessionInfo info;
        DescribeSession(d, &info);
        const int64_t bytes = static_cast<int64_t>(info.ByteSizeLong()) + 8;
        if (used + bytes > room) {
          if (response->sessions_size() == 0) {
            status = Permanent(absl::ResourceExhaustedError(absl::StrCat(
                "session ", d.id, " alone takes ", bytes,
                " bytes to describe, over the max_message_bytes limit of ",
                max_message_bytes, "; ask GetSession")));
          }
          more = true;
          return false;
        }
        used += bytes;
        *response->add_sessions() = std::move(info);
        last_token = PageToken(d);
        return true;
      });
  if (!status.ok()) {
    response->clear_sessions();
    return status;
  }
  response->set_total_bytes(listing.bytes);
  response->set_identity_held_bytes(listing.held_bytes);
  if (more) response->set_next_page_token(last_token);
  return absl::OkStatus();
}

}  // namespace attnserve
