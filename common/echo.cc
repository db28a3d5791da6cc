#include "attnserve/common/echo.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attnserve {

bool IsPlainName(absl::string_view name, size_t max_bytes) {
  if (name.size() > max_bytes) return false;
  for (char c : name) {
    if (!(absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-')) {
      return false;
    }
  }
  return true;
}

absl::string_view CutText(absl::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  size_t cut = max_bytes;
  // Back up over UTF-8 continuation bytes (10xxxxxx) to a character's start.
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) {
    --cut;
  }
  return text.substr(0, cut);
}

namespace {

// `text` with its control characters, quotes and backslashes escaped as in
// C: a terminal or a log line shows them and is not steered by them.
std::string Escaped(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const unsigned char byte = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (byte < 0x20 || byte == 0x7f) {
          constexpr char kHex[] = "0123456789abcdef";
          out += "\\x";
          out += kHex[byte >> 4];
          out += kHex[byte & 0xf];
        } else {
          out += c;
        }
    }
  }
  return out;
}

}  // namespace

std::string EchoText(absl::string_view text) {
  if (text.size() <= kMaxEchoBytes) {
    return absl::StrCat("\"", Escaped(text), "\"");
  }
  return absl::StrCat("\"", Escaped(CutText(text, kMaxEchoBytes)), "…\" (",
                      text.size(), " bytes)");
}

std::string EchoDims(absl::Span<const int64_t> dims, size_t max_dims) {
  if (dims.size() <= max_dims) {
    return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
  }
  return absl::StrCat("[", absl::StrJoin(dims.subspan(0, max_dims), ", "),
                      ", … ", dims.size(), " dimensions]");
}

}  // namespace attnserve
