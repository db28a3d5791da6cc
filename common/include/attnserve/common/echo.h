// Client-supplied names and text: names checked against one character set, and
// text quoted in error messages bounded, so that a hostile client cannot make
// the server build (and send back) a message as large as its request.
//
//   return absl::InvalidArgumentError(
//       absl::StrCat("name is ", EchoText(name), ", expected ..."));
#ifndef ATTNSERVE_COMMON_ECHO_H_
#define ATTNSERVE_COMMON_ECHO_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace attnserve {

// The most bytes of client text an error message quotes.
inline constexpr size_t kMaxEchoBytes = 256;

// Whether `name` is at most `max_bytes` characters of [A-Za-z0-9._-] (the
// characters of weight-set and gRPC service names). Empty is a name here;
// callers that need one check that apart.
bool IsPlainName(absl::string_view name, size_t max_bytes);

// `text`'s first `max_bytes` at most, cut on a UTF-8 character boundary.
absl::string_view CutText(absl::string_view text, size_t max_bytes);

// `text` in double quotes, its control characters, quotes and backslashes
// escaped as in C ("a\nb\x1b[31m"), and the Unicode characters that steer a
// terminal, reorder a line or hide in a name (C1 controls, bidirectional
// marks and overrides, line separators, zero-width ones) as \uXXXX: a fake
// log line, a terminal's escape sequence or a look-alike name shows as text.
// Past kMaxEchoBytes it is cut on a UTF-8 character boundary, and its length
// follows: "abc…" (70000 bytes).
std::string EchoText(absl::string_view text);

// If `text` starts with one of the Unicode characters EchoText escapes (C1
// controls, bidirectional marks and overrides, line separators, zero-width
// ones), its code point and its length in bytes; for a JSON writer that
// escapes them too.
std::optional<std::pair<uint32_t, size_t>> InvisibleCharacterAt(
    absl::string_view text);

// "[1, 2, 3]"; past `max_dims` dimensions, the first ones and their count:
// "[1, 2, 3, 4, 5, 6, 7, 8, … 5000000 dimensions]".
std::string EchoDims(absl::Span<const int64_t> dims, size_t max_dims = 8);

}  // namespace attnserve

#endif  // ATTNSERVE_COMMON_ECHO_H_
