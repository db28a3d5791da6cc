// attnctl's .npy <-> Tensor conversion: which element types map to which
// dtypes, and what is refused.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attnctl/tensor_io.h"
#include "attnserve/common/npy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

NpyArray Array(NpyDType dtype, std::vector<int64_t> shape, std::string data) {
  return NpyArray{dtype, std::move(shape), std::move(data)};
}

TEST(NpyToTensorTest, KeepsWireTypesAsTheyAre) {
  struct Case {
    NpyDType npy;
    v1::DType wire;
  };
  TensorReadOptions options;
  options.bf16_as_uint16 = true;
  options.allow_bool = true;
  for (const Case& c : {Case{NpyDType::kFloat32, v1::FLOAT32},
                        Case{NpyDType::kFloat16, v1::FLOAT16},
                        Case{NpyDType::kUInt16, v1::BFLOAT16},
                        Case{NpyDType::kBool, v1::BOOL}}) {
    SCOPED_TRACE(v1::DType_Name(c.wire));
    const std::string data(2 * 3 * NpyElementBytes(c.npy), '\x01');
    absl::StatusOr<v1::Tensor> tensor =
        NpyToTensor(Array(c.npy, {2, 3}, data), "x.npy", options);
    ASSERT_TRUE(tensor.ok()) << tensor.status();
    EXPECT_EQ(tensor->dtype(), c.wire);
    EXPECT_EQ(tensor->data(), data);
    EXPECT_EQ(
        std::vector<int64_t>(tensor->shape().begin(), tensor->shape().end()),
        (std::vector<int64_t>{2, 3}));
  }
}

// Rounded to float32; an infinity stays one, but a finite value past
// float32's range is refused rather than sent as one.
TEST(NpyToTensorTest, RoundsFloat64ToFloat32) {
  const double inf = std::numeric_limits<double>::infinity();
  const double values[] = {0.1, -2.5, -inf};
  std::string data(sizeof(values), '\0');
  std::memcpy(data.data(), values, sizeof(values));
  absl::StatusOr<v1::Tensor> tensor =
      NpyToTensor(Array(NpyDType::kFloat64, {3}, data), "x.npy", {});
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  ASSERT_EQ(tensor->dtype(), v1::FLOAT32);
  ASSERT_EQ(tensor->data().size(), 3 * sizeof(float));
  float floats[3];
  std::memcpy(floats, tensor->data().data(), sizeof(floats));
  EXPECT_EQ(floats[0], 0.1f);
  EXPECT_EQ(floats[1], -2.5f);
  EXPECT_EQ(floats[2], -std::numeric_limits<float>::infinity());
  const double past[] = {0.5, 1e300};
  std::string past_data(sizeof(past), '\0');
  std::memcpy(past_data.data(), past, sizeof(past));
  const absl::Status refused =
      NpyToTensor(Array(NpyDType::kFloat64, {2}, past_data), "x.npy", {})
          .status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.message()),
              ::testing::HasSubstr("x.npy holds 1e+300 at flat index 1, past "
                                   "float32's range"));
}

TEST(NpyToTensorTest, RefusesWhatTheOptionsDoNotAllow) {
  struct Case {
    NpyArray array;
    const char* message;
  };
  const Case cases[] = {
      {Array(NpyDType::kUInt16, {2}, std::string(4, '\0')),
       "pass --bf16_as_uint16"},
      {Array(NpyDType::kBool, {2}, std::string(2, '\0')),
       "only a mask may be bool"},
      {Array(NpyDType::kInt64, {1}, std::string(8, '\0')), "holds int64"},
      {Array(NpyDType::kFloat32, {}, std::string(4, '\0')), "0-d array"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    absl::StatusOr<v1::Tensor> tensor = NpyToTensor(c.array, "in.npy", {});
    ASSERT_FALSE(tensor.ok());
    EXPECT_EQ(tensor.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(tensor.status().message().find(c.message), std::string::npos)
        << tensor.status();
    EXPECT_NE(tensor.status().message().find("in.npy"), std::string::npos);
  }
}

TEST(TensorToNpyTest, WritesBFloat16AsUInt16BitPatterns) {
  v1::Tensor tensor;
  tensor.set_dtype(v1::BFLOAT16);
  tensor.add_shape(2);
  tensor.set_data(std::string("\x80\x3f\x00\x40", 4));  // 1.0, 2.0.
  absl::StatusOr<NpyArray> array = TensorToNpy(tensor);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->dtype, NpyDType::kUInt16);
  EXPECT_EQ(array->data, tensor.data());
  EXPECT_NE(SerializeNpy(*array).find("'descr': '<u2'"), std::string::npos);
}

TEST(TensorToNpyTest, RefusesDataThatDoesNotMatchTheShape) {
  v1::Tensor tensor;
  tensor.set_dtype(v1::FLOAT16);
  tensor.add_shape(3);
  tensor.set_data(std::string(4, '\0'));
  EXPECT_FALSE(TensorToNpy(tensor).ok());
  tensor.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_FALSE(TensorToNpy(tensor).ok());
}

TEST(TensorFileTest, RoundTripsThroughAFile) {
  v1::Tensor tensor;
  tensor.set_dtype(v1::FLOAT32);
  tensor.add_shape(1);
  tensor.add_shape(2);
  const float values[] = {1.5f, -3.0f};
  tensor.set_data(reinterpret_cast<const char*>(values), sizeof(values));
  const std::string path = testing::TempDir() + "/attnctl_round_trip.npy";
  ASSERT_TRUE(WriteTensorFile(path, tensor).ok());
  absl::StatusOr<v1::Tensor> read = ReadTensorFile(path, {});
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->SerializeAsString(), tensor.SerializeAsString());
}

}  // namespace
}  // namespace attnserve
