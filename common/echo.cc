#include "attnserve/common/echo.h"

#include <cstdint>
#include <optional>

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

// Whether the UTF-8 character at `text`'s start is one that steers how text
// shows without being seen: a C1 control (U+0080-U+009F, which terminals
// take as escape sequences) or a bidirectional mark, embedding, override or
// isolate (U+200E-U+200F, U+202A-U+202E, U+2066-U+2069). Its code point, if
// so.
std::optional<uint32_t> InvisibleControl(absl::string_view text) {
  const auto byte = [&text](size_t i) {
    return static_cast<unsigned char>(text[i]);
  };
  if (text.size() >= 2 && byte(0) == 0xC2 && byte(1) >= 0x80 &&
      byte(1) <= 0x9F) {
    return byte(1);
  }
  if (text.size() >= 3 && byte(0) == 0xE2) {
    const uint32_t point =
        0x2000 | (uint32_t{byte(1)} & 0x3F) << 6 | (uint32_t{byte(2)} & 0x3F);
    if ((byte(1) == 0x80 || byte(1) == 0x81) && (byte(2) & 0xC0) == 0x80 &&
        ((point >= 0x200E && point <= 0x200F) ||
         (point >= 0x202A && point <= 0x202E) ||
         (point >= 0x2066 && point <= 0x2069))) {
      return point;
    }
  }
  return std::nullopt;
}

// `text` with its control characters, quotes and backslashes escaped as in
// C, and the Unicode ones that steer a terminal or reorder a line as \uXXXX:
// a terminal or a log line shows them and is not steered by them.
std::string Escaped(absl::string_view text) {
  constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (const std::optional<uint32_t> point =
            InvisibleControl(text.substr(i))) {
      out += "\\u";
      for (int shift = 12; shift >= 0; shift -= 4) {
        out += kHex[(*point >> shift) & 0xF];
      }
      i += *point < 0x100 ? 1 : 2;
      continue;
    }
    const char c = text[i];
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
