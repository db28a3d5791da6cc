// EchoText and EchoDims: client text in error messages stays bounded, cut on a
// UTF-8 character boundary, with its length said, and shows as text.
#include "attnserve/common/echo.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

TEST(EchoTextTest, ShortTextIsQuotedWhole) {
  EXPECT_EQ(EchoText("demo"), "\"demo\"");
  EXPECT_EQ(EchoText(""), "\"\"");
  EXPECT_EQ(EchoText(std::string(kMaxEchoBytes, 'a')),
            "\"" + std::string(kMaxEchoBytes, 'a') + "\"");
}

TEST(EchoTextTest, LongTextIsCutAndItsLengthSaid) {
  const std::string text(60 << 20, 'x');
  EXPECT_EQ(EchoText(text),
            "\"" + std::string(kMaxEchoBytes, 'x') + "…\" (62914560 bytes)");
}

TEST(EchoTextTest, CutFallsOnACharacterBoundary) {
  // "é" is two bytes (C3 A9); the second one would be byte kMaxEchoBytes + 1.
  for (size_t ascii : {kMaxEchoBytes - 1, kMaxEchoBytes - 2}) {
    SCOPED_TRACE(ascii);
    std::string text(ascii, 'a');
    while (text.size() < 2 * kMaxEchoBytes) text += "é";
    const std::string echoed = EchoText(text);
    const std::string kept = echoed.substr(1, echoed.find("…") - 1);
    EXPECT_LE(kept.size(), kMaxEchoBytes);
    EXPECT_GE(kept.size(), kMaxEchoBytes - 1);
    // Whole characters only: the kept bytes end after an "é", or in ASCII.
    EXPECT_TRUE(kept.back() == 'a' || kept.substr(kept.size() - 2) == "é")
        << echoed;
    EXPECT_NE(echoed.find("(" + std::to_string(text.size()) + " bytes)"),
              std::string::npos);
  }
}

TEST(EchoTextTest, ControlCharactersQuotesAndBackslashesAreEscaped) {
  // A value that would print a fake log line and colour a terminal.
  EXPECT_EQ(EchoText("x\nattnserve listening\x1b[31m\r\t\x7f"),
            "\"x\\nattnserve listening\\x1b[31m\\r\\t\\x7f\"");
  EXPECT_EQ(EchoText("a\"b\\c"), "\"a\\\"b\\\\c\"");
  EXPECT_EQ(EchoText(std::string("\0", 1)), "\"\\x00\"");
  // UTF-8 is text, not escaped, but for the characters that steer a terminal
  // (C1 controls: U+009B is CSI) or reorder a line (bidirectional overrides).
  EXPECT_EQ(EchoText("é"), "\"é\"");
  EXPECT_EQ(EchoText("a\xc2\x9b"
                     "31mb\xe2\x80\xae"
                     "c\xe2\x81\xa6"
                     "d\xe2\x80\x8f"
                     "e"),
            "\"a\\u009b31mb\\u202ec\\u2066d\\u200fe\"");
  EXPECT_EQ(EchoText("\xe2\x80\x94\xc2\xa0"), "\"\xe2\x80\x94\xc2\xa0\"");
  // Zero-width and other invisible format characters, which make two names
  // look alike (until 2026-12-07 they were echoed as they came): ZWSP, ZWNJ,
  // ZWJ, the word joiner, BOM, soft hyphen, Arabic letter mark, Mongolian
  // vowel separator.
  EXPECT_EQ(EchoText("a\xe2\x80\x8b"
                     "b\xe2\x80\x8c\xe2\x80\x8d"
                     "c\xe2\x81\xa0\xe2\x81\xa4"
                     "d\xef\xbb\xbf"
                     "e\xc2\xad"
                     "f\xd8\x9c"
                     "g\xe1\xa0\x8e"),
            "\"a\\u200bb\\u200c\\u200dc\\u2060\\u2064d\\ufeffe\\u00adf\\u061cg"
            "\\u180e\"");
  // Line and paragraph separators, variation selectors, tags (four bytes).
  EXPECT_EQ(EchoText("a\xe2\x80\xa8"
                     "b\xe2\x80\xa9"
                     "c\xef\xb8\x8f"
                     "d\xf3\xa0\x80\x81"
                     "e"),
            "\"a\\u2028b\\u2029c\\ufe0fd\\U000e0001e\"");
  // Other four-byte characters are text: an emoji.
  EXPECT_EQ(EchoText("\xf0\x9f\x98\x80"), "\"\xf0\x9f\x98\x80\"");
  // Their neighbours, and characters cut short or ill-formed, pass as bytes.
  EXPECT_EQ(EchoText("\xe2\x81\xa5\xe2\x80\x8a\xef\xbb\xbe\xd8\x9b"),
            "\"\xe2\x81\xa5\xe2\x80\x8a\xef\xbb\xbe\xd8\x9b\"");
  EXPECT_EQ(EchoText("\xe2\x80"), "\"\xe2\x80\"");
  EXPECT_EQ(EchoText("\xc2"), "\"\xc2\"");
  // The cut counts the text's own bytes, before escaping.
  const std::string newlines(kMaxEchoBytes + 1, '\n');
  std::string escaped;
  for (size_t i = 0; i < kMaxEchoBytes; ++i) escaped += "\\n";
  EXPECT_EQ(EchoText(newlines), "\"" + escaped + "…\" (257 bytes)");
}

TEST(EchoDimsTest, FewDimsInFullManyCounted) {
  EXPECT_EQ(EchoDims({1, 2, 3}), "[1, 2, 3]");
  EXPECT_EQ(EchoDims({}), "[]");
  const std::vector<int64_t> many(5'000'000, 7);
  EXPECT_EQ(EchoDims(many), "[7, 7, 7, 7, 7, 7, 7, 7, … 5000000 dimensions]");
}

}  // namespace
}  // namespace attnserve
