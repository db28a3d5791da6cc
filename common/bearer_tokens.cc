#include "attnserve/common/bearer_tokens.h"

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attnserve {

absl::StatusOr<std::vector<std::string>> ParseBearerTokens(
    absl::string_view option, absl::string_view path, absl::string_view text) {
  std::vector<std::string> tokens;
  int line_number = 0;
  for (const absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    const absl::string_view token = absl::StripAsciiWhitespace(line);
    // Blank lines and comments.
    if (token.empty() || token[0] == '#') continue;
    if (token.size() > kMaxBearerTokenBytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s holds a token of %d bytes on line %d, expected at most %d "
          "(a client sends it in an HTTP header, which gRPC bounds at 8 KiB "
          "with the others)",
          option, path, static_cast<int>(token.size()), line_number,
          static_cast<int>(kMaxBearerTokenBytes)));
    }
    for (size_t i = 0; i < token.size(); ++i) {
      const unsigned char c = static_cast<unsigned char>(token[i]);
      if (c < 0x20 || c > 0x7e) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: %s holds byte 0x%02x at offset %d of the token on line %d, "
            "expected one token per line of printable ASCII (a client sends "
            "the token in an HTTP header)",
            option, path, c, static_cast<int>(i), line_number));
      }
    }
    tokens.emplace_back(token);
  }
  return tokens;
}

}  // namespace attnserve
