#include "attnserve/common/npy.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "attnserve/common/checked_math.h"
#include "attnserve/common/files.h"
#include "attnserve/common/status_macros.h"

namespace attnserve {
namespace {

constexpr absl::string_view kMagic("\x93NUMPY", 6);
constexpr absl::string_view kKeys[] = {"descr", "fortran_order", "shape"};
constexpr char kExpectedKeys[] = "'descr', 'fortran_order', 'shape'";

// Every descr accepted. A bool may carry any byte-order mark: it has one byte.
constexpr struct {
  absl::string_view descr;
  NpyDType dtype;
} kDescrs[] = {{"<f4", NpyDType::kFloat32}, {"<f2", NpyDType::kFloat16},
               {"<f8", NpyDType::kFloat64}, {"|b1", NpyDType::kBool},
               {"<b1", NpyDType::kBool},    {"=b1", NpyDType::kBool},
               {">b1", NpyDType::kBool},    {"<i8", NpyDType::kInt64},
               {"<u2", NpyDType::kUInt16}};

absl::Status Invalid(absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(".npy ", message));
}

// Up to 16 bytes of `text` in double quotes, unprintable bytes as \xNN, for an
// error message.
std::string Quoted(absl::string_view text) {
  if (text.empty()) return "nothing";
  std::string quoted = "\"";
  for (char c : text.substr(0, 16)) {
    if (absl::ascii_isprint(c) && c != '"' && c != '\\') {
      quoted.push_back(c);
    } else {
      absl::StrAppend(
          &quoted, "\\x",
          absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
    }
  }
  return absl::StrCat(quoted, text.size() > 16 ? "...\"" : "\"");
}

// The shape as Python writes the tuple: (), (5,), (2, 3).
std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("(", absl::StrJoin(shape, ", "),
                      shape.size() == 1 ? ",)" : ")");
}

struct NpyHeader {
  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

// Reads a header dict literal such as
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// by recursive descent: keys in any order, whitespace between any two tokens
// and an optional trailing comma. `text` ends at the closing brace.
class HeaderParser {
 public:
  explicit HeaderParser(absl::string_view text) : text_(text) {}

  absl::StatusOr<NpyHeader> Parse() {
    NpyHeader header;
    bool seen[3] = {false, false, false};
    ATTNSERVE_RETURN_IF_ERROR(Expect('{'));
    while (!Consume('}')) {
      ATTNSERVE_ASSIGN_OR_RETURN(std::string key, ParseString("a key"));
      const int index = std::find(kKeys, kKeys + 3, key) - kKeys;
      if (index == 3) {
        return Invalid(absl::StrCat("header has key '", key,
                                    "', expected only ", kExpectedKeys));
      }
      if (seen[index]) {
        return Invalid(absl::StrCat("header repeats key '", key, "'"));
      }
      seen[index] = true;
      ATTNSERVE_RETURN_IF_ERROR(Expect(':'));
      if (index == 0) {
        ATTNSERVE_ASSIGN_OR_RETURN(header.descr, ParseString("'descr'"));
      } else if (index == 1) {
        ATTNSERVE_ASSIGN_OR_RETURN(header.fortran_order, ParseBool());
      } else {
        ATTNSERVE_ASSIGN_OR_RETURN(header.shape, ParseShape());
      }
      if (!Consume(',')) {
        ATTNSERVE_RETURN_IF_ERROR(Expect('}'));
        break;
      }
    }
    if (pos_ != text_.size()) return Error("only spaces after '}'");
    for (int index = 0; index < 3; ++index) {
      if (!seen[index]) {
        return Invalid(absl::StrCat("header lacks key '", kKeys[index],
                                    "', expected keys ", kExpectedKeys));
      }
    }
    return header;
  }

 private:
  void SkipSpace() {
    while (pos_ < text_.size() && absl::ascii_isspace(text_[pos_])) ++pos_;
  }

  // Skips whitespace, then consumes `token` if it is next.
  bool Consume(char token) {
    SkipSpace();
    if (pos_ == text_.size() || text_[pos_] != token) return false;
    ++pos_;
    return true;
  }

  absl::Status Expect(char token) {
    if (Consume(token)) return absl::OkStatus();
    return Error(absl::StrCat("'", std::string(1, token), "'"));
  }

  absl::Status Error(absl::string_view expected) const {
    return Invalid(absl::StrCat("header is not a dict literal: expected ",
                                expected, " at offset ", pos_, ", found ",
                                Quoted(text_.substr(pos_))));
  }

  // A quoted string without escapes: 'text' or "text".
  absl::StatusOr<std::string> ParseString(absl::string_view what) {
    const bool quoted = Consume('\'') || Consume('"');
    const size_t end = quoted ? text_.find(text_[pos_ - 1], pos_) : pos_;
    const absl::string_view value = text_.substr(pos_, end - pos_);
    if (!quoted || end == absl::string_view::npos ||
        absl::StrContains(value, '\\')) {
      pos_ -= quoted ? 1 : 0;
      return Error(absl::StrCat("a quoted string for ", what));
    }
    pos_ = end + 1;
    return std::string(value);
  }

  absl::StatusOr<bool> ParseBool() {
    SkipSpace();
    for (const bool value : {false, true}) {
      const absl::string_view word = value ? "True" : "False";
      if (absl::StartsWith(text_.substr(pos_), word)) {
        pos_ += word.size();
        return value;
      }
    }
    return Error("True or False for 'fortran_order'");
  }

  // A tuple of non-negative integers: (), (5,), (2, 3) or (2, 3,).
  absl::StatusOr<std::vector<int64_t>> ParseShape() {
    ATTNSERVE_RETURN_IF_ERROR(Expect('('));
    std::vector<int64_t> shape;
    bool trailing_comma = false;
    while (!Consume(')')) {
      const size_t start = pos_;
      while (pos_ < text_.size() &&
             (absl::ascii_isdigit(text_[pos_]) || text_[pos_] == '-')) {
        ++pos_;
      }
      int64_t dim;
      if (!absl::SimpleAtoi(text_.substr(start, pos_ - start), &dim)) {
        pos_ = start;
        return Error(absl::StrCat("an int64 for 'shape'[", shape.size(), "]"));
      }
      if (dim < 0) {
        return Invalid(absl::StrCat("'shape'[", shape.size(), "] is ", dim,
                                    ", expected a non-negative integer"));
      }
      shape.push_back(dim);
      trailing_comma = Consume(',');
      if (!trailing_comma) {
        ATTNSERVE_RETURN_IF_ERROR(Expect(')'));
        break;
      }
    }
    if (shape.size() == 1 && !trailing_comma) {
      return Invalid(absl::StrCat("'shape' is (", shape[0], "), an integer, ",
                                  "expected the tuple (", shape[0], ",)"));
    }
    return shape;
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

absl::StatusOr<NpyDType> DTypeFromDescr(absl::string_view descr) {
  for (const auto& accepted : kDescrs) {
    if (descr == accepted.descr) return accepted.dtype;
  }
  const std::string little_endian = absl::StrCat("<", descr.substr(1));
  if (absl::StartsWith(descr, ">") && DTypeFromDescr(little_endian).ok()) {
    return Invalid(absl::StrCat("'descr' is '", descr, "', big-endian, ",
                                "expected little-endian '", little_endian,
                                "'"));
  }
  return Invalid(absl::StrCat(
      "'descr' is ", Quoted(descr),
      ", expected one of '<f4', '<f2', '<f8', '|b1', '<i8', '<u2'"));
}

}  // namespace

int64_t NpyElementBytes(NpyDType dtype) {
  constexpr int64_t kBytes[] = {4, 2, 8, 1, 8, 2};  // In NpyDType's order.
  return kBytes[static_cast<int>(dtype)];
}

absl::StatusOr<NpyArray> ParseNpy(absl::string_view bytes) {
  if (!absl::StartsWith(bytes, kMagic)) {
    return Invalid(absl::StrCat("magic is ", Quoted(bytes.substr(0, 6)),
                                ", expected \"\\x93NUMPY\""));
  }
  if (bytes.size() < 8) {
    return Invalid(absl::StrCat("header is truncated: file is ", bytes.size(),
                                " bytes, expected a version after the magic"));
  }
  const int major = static_cast<unsigned char>(bytes[6]);
  const int minor = static_cast<unsigned char>(bytes[7]);
  if (major < 1 || major > 3 || minor != 0) {
    return Invalid(absl::StrCat("version is ", major, ".", minor,
                                ", expected 1.0, 2.0 or 3.0"));
  }
  // The header length is a uint16 in version 1.0 and a uint32 after it.
  const size_t header_start = major == 1 ? 10 : 12;
  if (bytes.size() < header_start) {
    return Invalid(absl::StrCat("header is truncated: file is ", bytes.size(),
                                " bytes, expected at least ", header_start,
                                " for version ", major, ".0"));
  }
  size_t header_length = 0;
  for (size_t i = header_start; i-- > 8;) {
    header_length = header_length << 8 | static_cast<unsigned char>(bytes[i]);
  }
  if (bytes.size() - header_start < header_length) {
    return Invalid(absl::StrCat("header is truncated: its length field says ",
                                header_length, " bytes, but only ",
                                bytes.size() - header_start, " follow"));
  }
  absl::string_view header_text = bytes.substr(header_start, header_length);
  if (!absl::ConsumeSuffix(&header_text, "\n")) {
    const size_t last = std::max<size_t>(header_text.size(), 1) - 1;
    return Invalid(absl::StrCat("header ends in ",
                                Quoted(header_text.substr(last)),
                                ", expected \"\\n\""));
  }
  ATTNSERVE_ASSIGN_OR_RETURN(
      NpyHeader header,
      HeaderParser(absl::StripTrailingAsciiWhitespace(header_text)).Parse());
  NpyArray array;
  ATTNSERVE_ASSIGN_OR_RETURN(array.dtype, DTypeFromDescr(header.descr));
  if (header.fortran_order) {
    return Invalid("'fortran_order' is True, expected False (C order)");
  }
  array.shape = std::move(header.shape);
  const std::optional<int64_t> elements = CheckedProduct(array.shape);
  const std::optional<int64_t> data_bytes =
      elements ? CheckedMultiply(*elements, NpyElementBytes(array.dtype))
               : std::nullopt;
  const std::string layout = absl::StrCat("'shape' ", ShapeString(array.shape),
                                          " of '", header.descr, "'");
  if (!data_bytes) {
    return Invalid(
        absl::StrCat(layout, " has a byte size that overflows int64"));
  }
  const absl::string_view data = bytes.substr(header_start + header_length);
  if (static_cast<int64_t>(data.size()) != *data_bytes) {
    return Invalid(absl::StrCat("data is ", data.size(), " bytes, expected ",
                                *data_bytes, " for ", layout));
  }
  array.data = std::string(data);
  return array;
}

absl::StatusOr<NpyArray> ReadNpyFile(const std::string& path,
                                     int64_t max_file_bytes) {
  ATTNSERVE_ASSIGN_OR_RETURN(const std::string bytes,
                             ReadRegularFile(path, max_file_bytes));
  absl::StatusOr<NpyArray> array = ParseNpy(bytes);
  if (!array.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", array.status().message()));
  }
  return array;
}

std::string SerializeNpy(const NpyArray& array) {
  const char* descr = "<f4";
  for (const auto& entry : kDescrs) {
    if (entry.dtype == array.dtype) {
      descr = entry.descr.data();
      break;
    }
  }
  std::string shape = "(";
  for (int64_t dim : array.shape) absl::StrAppend(&shape, dim, ", ");
  if (array.shape.size() > 1)
    shape.resize(shape.size() - 2);  // "(2, 3)", but "(5,)".
  if (array.shape.size() == 1) shape.resize(shape.size() - 1);
  shape += ")";
  std::string header =
      absl::StrCat("{'descr': '", absl::string_view(descr, 3),
                   "', 'fortran_order': False, 'shape': ", shape, ", }");
  // Magic (6) + version (2) + length (2) + header + '\n', padded to 64 bytes.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::string bytes(kMagic);
  bytes.push_back('\x01');
  bytes.push_back('\x00');
  bytes.push_back(static_cast<char>(header.size() & 0xff));
  bytes.push_back(static_cast<char>(header.size() >> 8));
  bytes += header;
  bytes += array.data;
  return bytes;
}

absl::Status WriteNpyFile(const std::string& path, const NpyArray& array) {
  return WriteOutputFile(path, SerializeNpy(array));
}

}  // namespace attnserve
