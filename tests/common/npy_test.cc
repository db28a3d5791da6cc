#include "attnserve/common/npy.h"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

// Real .npy files, byte for byte as numpy wrote them, so that the parser is
// checked against numpy's own output and not only against files built below.
// Generated with numpy 1.24.2; each comment gives the call that wrote it.
// np.save(f, np.arange(6, dtype='<f4').reshape(2, 3))
constexpr char kNumpyFloat32Matrix[] =
    "\223NUMPY\001\000v\000"
    "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"
    "                                                          \n"
    "\000\000\000\000\000\000\200\077\000\000\000@\000\000@@"
    "\000\000\200@\000\000\240@";

// np.save(f, np.array([1.0, -2.5, 0.5], dtype='<f2'))
constexpr char kNumpyFloat16Vector[] =
    "\223NUMPY\001\000v\000"
    "{'descr': '<f2', 'fortran_order': False, 'shape': (3,), }"
    "                                                            \n"
    "\000<\000\301\0008";

// np.save(f, np.array([True, False, True]))
constexpr char kNumpyBoolVector[] =
    "\223NUMPY\001\000v\000"
    "{'descr': '|b1', 'fortran_order': False, 'shape': (3,), }"
    "                                                            \n"
    "\001\000\001";

// np.save(f, np.float64(3.25))
constexpr char kNumpyFloat64Scalar[] =
    "\223NUMPY\001\000v\000"
    "{'descr': '<f8', 'fortran_order': False, 'shape': (), }"
    "                                                            "
    "  \n"
    "\000\000\000\000\000\000\012@";

// np.lib.format.write_array(f, np.array([1.5, -2.0]), version=(2, 0))
constexpr char kNumpyFloat64VectorV2[] =
    "\223NUMPY\002\000t\000\000\000"
    "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }"
    "                                                          \n"
    "\000\000\000\000\000\000\370\077\000\000\000\000\000\000\000\300";

// np.lib.format.write_array(f, np.arange(4, dtype='<f4').reshape(1, 2, 2),
//                           version=(3, 0))
constexpr char kNumpyFloat32CubeV3[] =
    "\223NUMPY\003\000t\000\000\000"
    "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2, 2), }"
    "                                                     \n"
    "\000\000\000\000\000\000\200\077\000\000\000@\000\000@@";

template <size_t N>
std::string Bytes(const char (&literal)[N]) {
  return std::string(literal, N - 1);
}

// Assembles a .npy file: the magic, version major.minor, the header length
// (uint16 for version 1, uint32 otherwise), `header` exactly as given, `data`.
std::string RawNpy(int major, int minor, absl::string_view header,
                   absl::string_view data) {
  std::string file =
      absl::StrCat("\x93NUMPY", std::string(1, major), std::string(1, minor));
  const int length_bytes = major == 1 ? 2 : 4;
  for (int i = 0; i < length_bytes; ++i) {
    file.push_back(static_cast<char>((header.size() >> (8 * i)) & 0xff));
  }
  return absl::StrCat(file, header, data);
}

// A well-formed .npy file of version major.0 whose header is `dict` padded
// with spaces and a '\n' to a multiple of 64 bytes, as numpy pads it.
std::string Npy(absl::string_view dict, absl::string_view data, int major = 1) {
  const size_t preamble = major == 1 ? 10 : 12;
  std::string header(dict);
  while ((preamble + header.size() + 1) % 64 != 0) header.push_back(' ');
  header.push_back('\n');
  return RawNpy(major, 0, header, data);
}

std::string Float32Bytes(const std::vector<float>& values) {
  std::string bytes(values.size() * sizeof(float), '\0');
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

std::string Float64Bytes(const std::vector<double>& values) {
  std::string bytes(values.size() * sizeof(double), '\0');
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// 1.0, -2.5 and 0.5 as IEEE 754 binary16: 0x3c00, 0xc100, 0x3800.
constexpr char kHalfOneMinusTwoPointFiveHalf[] = "\x00\x3c\x00\xc1\x00\x38";

// Names each parameterised test after its table entry.
template <typename Case>
std::string CaseName(const ::testing::TestParamInfo<Case>& case_info) {
  return case_info.param.name;
}

struct ValidCase {
  std::string name;
  std::string file;
  NpyDType dtype;
  std::vector<int64_t> shape;
  std::string data;
};

std::vector<ValidCase> ValidCases() {
  const std::string f4_2x3 = Float32Bytes({0, 1, 2, 3, 4, 5});
  return {
      {"ParsesNumpyFloat32Matrix",
       Bytes(kNumpyFloat32Matrix),
       NpyDType::kFloat32,
       {2, 3},
       f4_2x3},
      {"ParsesNumpyFloat16Vector",
       Bytes(kNumpyFloat16Vector),
       NpyDType::kFloat16,
       {3},
       Bytes(kHalfOneMinusTwoPointFiveHalf)},
      {"ParsesNumpyBoolVector",
       Bytes(kNumpyBoolVector),
       NpyDType::kBool,
       {3},
       std::string("\x01\x00\x01", 3)},
      {"ParsesNumpyFloat64Scalar",
       Bytes(kNumpyFloat64Scalar),
       NpyDType::kFloat64,
       {},
       Float64Bytes({3.25})},
      {"ParsesNumpyVersionTwoFloat64Vector",
       Bytes(kNumpyFloat64VectorV2),
       NpyDType::kFloat64,
       {2},
       Float64Bytes({1.5, -2.0})},
      {"ParsesNumpyVersionThreeFloat32Cube",
       Bytes(kNumpyFloat32CubeV3),
       NpyDType::kFloat32,
       {1, 2, 2},
       Float32Bytes({0, 1, 2, 3})},
      {"ParsesVersionOneFloat32Matrix",
       Npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
           f4_2x3),
       NpyDType::kFloat32,
       {2, 3},
       f4_2x3},
      {"ParsesVersionTwoFloat32Matrix",
       Npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
           f4_2x3, /*major=*/2),
       NpyDType::kFloat32,
       {2, 3},
       f4_2x3},
      {"ParsesFloat16Vector",
       Npy("{'descr': '<f2', 'fortran_order': False, 'shape': (3,), }",
           Bytes(kHalfOneMinusTwoPointFiveHalf)),
       NpyDType::kFloat16,
       {3},
       Bytes(kHalfOneMinusTwoPointFiveHalf)},
      {"ParsesFloat64ThreeDimensionalArray",
       Npy("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 1, 2), }",
           Float64Bytes({1, 2, 3, 4})),
       NpyDType::kFloat64,
       {2, 1, 2},
       Float64Bytes({1, 2, 3, 4})},
      {"ParsesZeroDimensionalFloat32",
       Npy("{'descr': '<f4', 'fortran_order': False, 'shape': (), }",
           Float32Bytes({7})),
       NpyDType::kFloat32,
       {},
       Float32Bytes({7})},
      {"ParsesEmptyArrayWithZeroDimension",
       Npy("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 3), }", ""),
       NpyDType::kFloat32,
       {0, 3},
       ""},
      {"ParsesBoolWithNativeByteOrder",
       Npy("{'descr': '=b1', 'fortran_order': False, 'shape': (2,), }",
           std::string("\x00\x01", 2)),
       NpyDType::kBool,
       {2},
       std::string("\x00\x01", 2)},
      {"ParsesBoolWithLittleEndianByteOrder",
       Npy("{'descr': '<b1', 'fortran_order': False, 'shape': (1,), }",
           std::string("\x01", 1)),
       NpyDType::kBool,
       {1},
       std::string("\x01", 1)},
      {"ParsesBoolWithBigEndianMarkSinceOneByteHasNoOrder",
       Npy("{'descr': '>b1', 'fortran_order': False, 'shape': (1,), }",
           std::string("\x01", 1)),
       NpyDType::kBool,
       {1},
       std::string("\x01", 1)},
      {"ParsesKeysInAnyOrder",
       Npy("{'shape': (2,), 'fortran_order': False, 'descr': '<f4'}",
           Float32Bytes({1, 2})),
       NpyDType::kFloat32,
       {2},
       Float32Bytes({1, 2})},
      {"ParsesHeaderWithoutSpacesOrPadding",
       RawNpy(1, 0, "{'descr':'<f4','fortran_order':False,'shape':(2,1,)}\n",
              Float32Bytes({1, 2})),
       NpyDType::kFloat32,
       {2, 1},
       Float32Bytes({1, 2})},
      {"ParsesDoubleQuotesAndExtraWhitespace",
       Npy("{ \"descr\" : \"<f4\" ,\n 'fortran_order' :False ,'shape':( 2 , ) "
           ",}",
           Float32Bytes({1, 2})),
       NpyDType::kFloat32,
       {2},
       Float32Bytes({1, 2})},
  };
}

void PrintTo(const ValidCase& test_case, std::ostream* os) {
  *os << test_case.name;
}

class NpyValidTest : public ::testing::TestWithParam<ValidCase> {};

TEST_P(NpyValidTest, MatchesExpectedArray) {
  const ValidCase& test_case = GetParam();
  absl::StatusOr<NpyArray> array = ParseNpy(test_case.file);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->dtype, test_case.dtype);
  EXPECT_EQ(array->shape, test_case.shape);
  EXPECT_EQ(array->data, test_case.data);
}

INSTANTIATE_TEST_SUITE_P(Npy, NpyValidTest, ::testing::ValuesIn(ValidCases()),
                         CaseName<ValidCase>);

struct InvalidCase {
  std::string name;
  std::string file;
  std::string message;
};

std::string F4Header(absl::string_view shape) {
  return absl::StrCat(
      "{'descr': '<f4', 'fortran_order': False, 'shape': ", shape, ", }");
}

std::vector<InvalidCase> InvalidCases() {
  const std::string good_header = F4Header("(2,)");
  const std::string two_floats = Float32Bytes({1, 2});
  std::string bad_magic = Npy(good_header, two_floats);
  bad_magic[1] = 'X';
  const std::string numpy_matrix = Bytes(kNumpyFloat32Matrix);
  return {
      {"RejectsEmptyFile", "", "magic is nothing, expected \"\\x93NUMPY\""},
      {"RejectsBadMagic", bad_magic, "magic is \"\\x93XUMPY\""},
      {"RejectsFileEndingAfterMagic", "\x93NUMPY\x01",
       "header is truncated: file is 7 bytes"},
      {"RejectsUnsupportedMajorVersion", RawNpy(4, 0, "", ""),
       "version is 4.0, expected 1.0, 2.0 or 3.0"},
      {"RejectsUnsupportedMinorVersion", RawNpy(1, 1, "", ""),
       "version is 1.1, expected 1.0, 2.0 or 3.0"},
      {"RejectsTruncatedHeaderLength", std::string("\x93NUMPY\x02\x00\x10", 9),
       "header is truncated: file is 9 bytes, expected at least 12"},
      {"RejectsHeaderLongerThanFile", numpy_matrix.substr(0, 50),
       "its length field says 118 bytes, but only 40 follow"},
      {"RejectsHeaderNotEndingInNewline", RawNpy(1, 0, good_header, two_floats),
       "header ends in \"}\""},
      {"RejectsHeaderThatIsNotADict", Npy("['descr', '<f4']", two_floats),
       "expected '{' at offset 0, found \"['descr', '<f4']\""},
      {"RejectsUnquotedKey",
       Npy("{descr: '<f4', 'fortran_order': False, 'shape': (2,)}", two_floats),
       "expected a quoted string for a key at offset 1"},
      {"RejectsUnknownKey",
       Npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), "
           "'extra': 1}",
           two_floats),
       "header has key 'extra', expected only 'descr', 'fortran_order', "
       "'shape'"},
      {"RejectsMissingKey", Npy("{'descr': '<f4', 'shape': (2,)}", two_floats),
       "header lacks key 'fortran_order'"},
      {"RejectsRepeatedKey",
       Npy("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, "
           "'shape': (2,)}",
           two_floats),
       "header repeats key 'descr'"},
      {"RejectsMissingCommaBetweenEntries",
       Npy("{'descr': '<f4' 'fortran_order': False, 'shape': (2,)}",
           two_floats),
       "expected '}' at offset 16"},
      {"RejectsTextAfterDict", Npy(good_header + " x", two_floats),
       "expected only spaces after '}'"},
      {"RejectsStructuredDescr",
       Npy("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,)}",
           two_floats),
       "expected a quoted string for 'descr' at offset 10"},
      {"RejectsUnsupportedDescr",
       Npy("{'descr': '<i4', 'fortran_order': False, 'shape': (2,)}",
           two_floats),
       "'descr' is \"<i4\", expected one of '<f4', '<f2', '<f8', '|b1', '<i8', "
       "'<u2'"},
      {"RejectsBigEndianFloat",
       Npy("{'descr': '>f4', 'fortran_order': False, 'shape': (2,)}",
           two_floats),
       "'descr' is '>f4', big-endian, expected little-endian '<f4'"},
      {"RejectsNativeByteOrderFloat",
       Npy("{'descr': '=f8', 'fortran_order': False, 'shape': (1,)}",
           Float64Bytes({1})),
       "'descr' is \"=f8\", expected one of"},
      {"RejectsFortranOrder",
       Npy("{'descr': '<f4', 'fortran_order': True, 'shape': (2,)}",
           two_floats),
       "'fortran_order' is True, expected False"},
      {"RejectsFortranOrderThatIsNotABool",
       Npy("{'descr': '<f4', 'fortran_order': 0, 'shape': (2,)}", two_floats),
       "expected True or False for 'fortran_order' at offset 34"},
      {"RejectsShapeThatIsNotATuple",
       Npy("{'descr': '<f4', 'fortran_order': False, 'shape': [2]}",
           two_floats),
       "expected '(' at offset 50, found \"[2]}\""},
      {"RejectsParenthesisedIntegerShape", Npy(F4Header("(2)"), two_floats),
       "'shape' is (2), an integer, expected the tuple (2,)"},
      {"RejectsMissingCommaBetweenDimensions",
       Npy(F4Header("(1 2)"), two_floats),
       "expected ')' at offset 53, found \"2)"},
      {"RejectsNegativeDimension", Npy(F4Header("(2, -1)"), two_floats),
       "'shape'[1] is -1, expected a non-negative integer"},
      {"RejectsDimensionBeyondInt64",
       Npy(F4Header("(99999999999999999999,)"), two_floats),
       "expected an int64 for 'shape'[0] at offset 51"},
      {"RejectsShapeWhoseElementCountOverflows",
       Npy(F4Header("(4294967296, 4294967296)"), two_floats),
       "'shape' (4294967296, 4294967296) of '<f4' has a byte size that "
       "overflows int64"},
      {"RejectsShapeWhoseByteSizeOverflows",
       Npy(F4Header("(2305843009213693952,)"), two_floats),
       "has a byte size that overflows int64"},
      {"RejectsDataShorterThanShape", numpy_matrix.substr(0, 150),
       "data is 22 bytes, expected 24 for 'shape' (2, 3) of '<f4'"},
      {"RejectsDataLongerThanShape", numpy_matrix + "x",
       "data is 25 bytes, expected 24"},
  };
}

void PrintTo(const InvalidCase& test_case, std::ostream* os) {
  *os << test_case.name;
}

class NpyInvalidTest : public ::testing::TestWithParam<InvalidCase> {};

TEST_P(NpyInvalidTest, ReturnsInvalidArgumentThatSaysWhatWasFound) {
  const InvalidCase& test_case = GetParam();
  absl::StatusOr<NpyArray> array = ParseNpy(test_case.file);
  ASSERT_FALSE(array.ok());
  EXPECT_EQ(array.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(array.status().message()),
              HasSubstr(test_case.message));
}

INSTANTIATE_TEST_SUITE_P(Npy, NpyInvalidTest,
                         ::testing::ValuesIn(InvalidCases()),
                         CaseName<InvalidCase>);

TEST(NpyElementBytesTest, MatchesNumpyItemsize) {
  EXPECT_EQ(NpyElementBytes(NpyDType::kFloat32), 4);
  EXPECT_EQ(NpyElementBytes(NpyDType::kFloat16), 2);
  EXPECT_EQ(NpyElementBytes(NpyDType::kFloat64), 8);
  EXPECT_EQ(NpyElementBytes(NpyDType::kBool), 1);
}

// Writes `contents` to a new file in the test temporary directory, which
// gtest gives with a trailing slash.
std::string WriteTempFile(absl::string_view name, absl::string_view contents) {
  const std::string path = absl::StrCat(::testing::TempDir(), name);
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  EXPECT_TRUE(file.good()) << path;
  return path;
}

TEST(ReadNpyFileTest, ReadsNumpyFileFromDisk) {
  const std::string path =
      WriteTempFile("npy_test_matrix.npy", Bytes(kNumpyFloat32Matrix));
  absl::StatusOr<NpyArray> array = ReadNpyFile(path, 1 << 20);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->dtype, NpyDType::kFloat32);
  EXPECT_EQ(array->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(array->data, Float32Bytes({0, 1, 2, 3, 4, 5}));
}

TEST(ReadNpyFileTest, AcceptsFileOfExactlyTheLimit) {
  const std::string path =
      WriteTempFile("npy_test_at_limit.npy", Bytes(kNumpyBoolVector));
  EXPECT_TRUE(ReadNpyFile(path, sizeof(kNumpyBoolVector) - 1).ok());
}

TEST(ReadNpyFileTest, ReturnsResourceExhaustedBeforeParsingAFileOverTheLimit) {
  // Not a valid .npy file: the size must be refused before the bytes are read.
  const std::string path =
      WriteTempFile("npy_test_too_large.npy", std::string(1000, 'x'));
  absl::StatusOr<NpyArray> array = ReadNpyFile(path, 999);
  EXPECT_EQ(array.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(array.status().message()),
              HasSubstr("is 1000 bytes, over the limit of 999 bytes"));
}

TEST(ReadNpyFileTest, ReturnsNotFoundForMissingFile) {
  const std::string path =
      absl::StrCat(::testing::TempDir(), "npy_test_does_not_exist.npy");
  absl::StatusOr<NpyArray> array = ReadNpyFile(path, 1 << 20);
  EXPECT_EQ(array.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(array.status().message()), HasSubstr(path));
}

TEST(ReadNpyFileTest, PrefixesParseErrorsWithThePath) {
  const std::string path =
      WriteTempFile("npy_test_bad_magic.npy", "not a numpy file");
  absl::StatusOr<NpyArray> array = ReadNpyFile(path, 1 << 20);
  EXPECT_EQ(array.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(array.status().message()),
              HasSubstr(absl::StrCat(path, ": .npy magic is \"not a \"")));
}

TEST(ReadNpyFileTest, RejectsDirectory) {
  absl::StatusOr<NpyArray> array = ReadNpyFile(::testing::TempDir(), 1 << 20);
  EXPECT_EQ(array.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(array.status().message()),
              HasSubstr("expected a regular"));
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

TEST(NpyWriteTest, SerializedArraysParseBackUnchanged) {
  const NpyArray arrays[] = {
      {NpyDType::kFloat32, {2, 3}, std::string(24, '\x01')},
      {NpyDType::kFloat16, {5}, std::string(10, '\x02')},
      {NpyDType::kUInt16, {1, 1, 4}, std::string(8, '\x03')},
      {NpyDType::kBool, {3}, std::string("\x01\x00\x01", 3)},
      {NpyDType::kInt64, {}, std::string(8, '\x04')},
      {NpyDType::kFloat64, {0, 2}, std::string()},
  };
  for (const NpyArray& array : arrays) {
    const std::string bytes = SerializeNpy(array);
    EXPECT_EQ((bytes.size() - array.data.size()) % 64, 0u)
        << "header not 64-byte aligned";
    absl::StatusOr<NpyArray> parsed = ParseNpy(bytes);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(parsed->dtype, array.dtype);
    EXPECT_EQ(parsed->shape, array.shape);
    EXPECT_EQ(parsed->data, array.data);
  }
}

TEST(NpyWriteTest, WrittenFileReadsBack) {
  const std::string path = ::testing::TempDir() + "/written.npy";
  const NpyArray array{NpyDType::kFloat32, {2, 2}, std::string(16, '\x07')};
  ASSERT_TRUE(WriteNpyFile(path, array).ok());
  absl::StatusOr<NpyArray> read = ReadNpyFile(path, 1 << 20);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->shape, array.shape);
  EXPECT_EQ(read->data, array.data);
  EXPECT_FALSE(WriteNpyFile("/nonexistent-dir/x.npy", array).ok());
}

}  // namespace
}  // namespace attnserve
