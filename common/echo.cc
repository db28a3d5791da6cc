#include "attnserve/common/echo.h"

#include <cstdint>
#include <optional>
#include <utility>

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

// Characters that steer how text shows without being seen: C1 controls
// (U+0080-U+009F, which terminals take as escape sequences), the soft hyphen,
// bidirectional marks, embeddings, overrides and isolates (U+061C, U+200E-F,
// U+202A-E, U+2066-9), the line and paragraph separators (U+2028-9, a new
// line to some viewers), and the zero-width ones that make two names look
// alike (U+180E, U+200B-D, U+2060-4, variation selectors U+FE00-F, U+FEFF,
// tags U+E0000-7F).
constexpr struct {
  uint32_t first;
  uint32_t last;
} kInvisible[] = {{0x80, 0x9F},     {0xAD, 0xAD},      {0x61C, 0x61C},
                  {0x180E, 0x180E}, {0x200B, 0x200F},  {0x2028, 0x202E},
                  {0x2060, 0x2064}, {0x2066, 0x2069},  {0xFE00, 0xFE0F},
                  {0xFEFF, 0xFEFF}, {0xE0000, 0xE007F}};

// The code point of the well-formed multi-byte UTF-8 character at `text`'s
// start, with its length; nullopt for anything else.
std::optional<std::pair<uint32_t, size_t>> MultiByteCharacter(
    absl::string_view text) {
  const auto byte = [&text](size_t i) {
    return static_cast<unsigned char>(text[i]);
  };
  const auto continuation = [&](size_t i) {
    return i < text.size() && (byte(i) & 0xC0) == 0x80;
  };
  if (text.empty()) return std::nullopt;
  if (byte(0) >= 0xC2 && byte(0) <= 0xDF && continuation(1)) {
    return std::make_pair((uint32_t{byte(0)} & 0x1F) << 6 | (byte(1) & 0x3F),
                          size_t{2});
  }
  if ((byte(0) & 0xF0) == 0xE0 && continuation(1) && continuation(2)) {
    const uint32_t point = (uint32_t{byte(0)} & 0x0F) << 12 |
                           (uint32_t{byte(1)} & 0x3F) << 6 | (byte(2) & 0x3F);
    if (point >= 0x800) return std::make_pair(point, size_t{3});
  }
  if (byte(0) >= 0xF0 && byte(0) <= 0xF4 && continuation(1) &&
      continuation(2) && continuation(3)) {
    const uint32_t point = (uint32_t{byte(0)} & 0x07) << 18 |
                           (uint32_t{byte(1)} & 0x3F) << 12 |
                           (uint32_t{byte(2)} & 0x3F) << 6 | (byte(3) & 0x3F);
    if (point >= 0x10000 && point <= 0x10FFFF) {
      return std::make_pair(point, size_t{4});
    }
  }
  return std::nullopt;
}

// The code point of the character at `text`'s start and its length in bytes,
// if it is one of kInvisible.
std::optional<std::pair<uint32_t, size_t>> InvisibleControl(
    absl::string_view text) {
  const std::optional<std::pair<uint32_t, size_t>> character =
      MultiByteCharacter(text);
  if (!character) return std::nullopt;
  for (const auto& range : kInvisible) {
    if (character->first >= range.first && character->first <= range.last) {
      return character;
    }
  }
  return std::nullopt;
}

// `text` with its control characters, quotes and backslashes escaped as in
// C, and the Unicode ones that steer a terminal or reorder a line as \uXXXX
// (\UXXXXXXXX past U+FFFF):
// a terminal or a log line shows them and is not steered by them.
std::string Escaped(absl::string_view text) {
  constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (const std::optional<std::pair<uint32_t, size_t>> invisible =
            InvisibleControl(text.substr(i))) {
      // \uXXXX, or \UXXXXXXXX past the Basic Multilingual Plane.
      const bool wide = invisible->first > 0xFFFF;
      out += wide ? "\\U" : "\\u";
      for (int shift = wide ? 28 : 12; shift >= 0; shift -= 4) {
        out += kHex[(invisible->first >> shift) & 0xF];
      }
      i += invisible->second - 1;
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

std::optional<std::pair<uint32_t, size_t>> InvisibleCharacterAt(
    absl::string_view text) {
  return InvisibleControl(text);
}

}  // namespace attnserve
