// Bearer-token files, as the server (--auth_token_file,
// --weights_admin_token_file) and attnctl (--auth_token_file) read them: one
// token per line without surrounding whitespace; blank lines and lines
// starting with '#' are skipped.
#ifndef ATTNSERVE_COMMON_BEARER_TOKENS_H_
#define ATTNSERVE_COMMON_BEARER_TOKENS_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnserve {

// The longest bearer token a token file may hold: gRPC bounds a call's
// headers at 8 KiB in all.
inline constexpr size_t kMaxBearerTokenBytes = 4096;

// The tokens of `text`, the contents of the file `path` that the option
// `option` names (none if it holds none). INVALID_ARGUMENT naming both for a
// token longer than kMaxBearerTokenBytes or with anything but printable ASCII
// (which no client could send in an authorization header); the message gives
// the line (and the offending byte's offset), never the token.
absl::StatusOr<std::vector<std::string>> ParseBearerTokens(
    absl::string_view option, absl::string_view path, absl::string_view text);

}  // namespace attnserve

#endif  // ATTNSERVE_COMMON_BEARER_TOKENS_H_
