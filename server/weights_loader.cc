#include "weights_loader.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "attention_service.h"
#include "attnserve/common/npy.h"
#include "attnserve/common/status_macros.h"

namespace attnserve {
namespace {

v1::Tensor RandomTensor(std::vector<int64_t> shape, float bound,
                        std::mt19937_64& generator) {
  std::uniform_real_distribution<float> distribution(-bound, bound);
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values) value = distribution(generator);
  v1::Tensor tensor;
  tensor.set_dtype(v1::FLOAT32);
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  tensor.set_data(reinterpret_cast<const char*>(values.data()),
                  values.size() * sizeof(float));
  return tensor;
}

absl::StatusOr<v1::Tensor> NpyToTensor(NpyArray array,
                                       const std::string& path) {
  v1::Tensor tensor;
  tensor.mutable_shape()->Assign(array.shape.begin(), array.shape.end());
  switch (array.dtype) {
    case NpyDType::kFloat32:
      tensor.set_dtype(v1::FLOAT32);
      tensor.set_data(std::move(array.data));
      return tensor;
    case NpyDType::kFloat16:
      tensor.set_dtype(v1::FLOAT16);
      tensor.set_data(std::move(array.data));
      return tensor;
    case NpyDType::kFloat64: {
      const size_t count = array.data.size() / sizeof(double);
      std::vector<float> values(count);
      for (size_t i = 0; i < count; ++i) {
        double value;
        std::memcpy(&value, array.data.data() + i * sizeof(double),
                    sizeof(double));
        values[i] = static_cast<float>(value);
      }
      tensor.set_dtype(v1::FLOAT32);
      tensor.set_data(reinterpret_cast<const char*>(values.data()),
                      count * sizeof(float));
      return tensor;
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          path,
          " holds integers or booleans, expected float32, float16 or float64"));
  }
}

absl::Status ReadConfig(const std::string& path,
                        v1::ProjectionWeights* weights) {
  std::ifstream file(path);
  if (!file)
    return absl::NotFoundError(
        absl::StrCat(path, " is missing, expected num_heads=H"));
  std::string line;
  while (std::getline(file, line)) {
    const absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || text[0] == '#') continue;
    const std::pair<std::string, std::string> entry = absl::StrSplit(text, '=');
    int64_t value = 0;
    if (!absl::SimpleAtoi(entry.second, &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": '", text, "' is not key=integer"));
    }
    if (entry.first == "num_heads") {
      weights->set_num_heads(value);
    } else if (entry.first == "num_kv_heads") {
      weights->set_num_kv_heads(value);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": unknown key '", entry.first,
                       "', expected num_heads or num_kv_heads"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

v1::PutWeightsRequest DemoWeights() {
  constexpr int64_t kEmbed = 64, kHeads = 8, kHeadDim = 8;
  std::mt19937_64 generator(20261130);
  const float bound =
      1.0f / std::sqrt(static_cast<float>(kEmbed));  // nn.Linear's init range.
  v1::PutWeightsRequest request;
  request.set_name(kDemoWeightsName);
  v1::ProjectionWeights& w = *request.mutable_weights();
  w.set_num_heads(kHeads);
  w.set_num_kv_heads(kHeads);
  *w.mutable_w_q() =
      RandomTensor({kHeads * kHeadDim, kEmbed}, bound, generator);
  *w.mutable_w_k() =
      RandomTensor({kHeads * kHeadDim, kEmbed}, bound, generator);
  *w.mutable_w_v() =
      RandomTensor({kHeads * kHeadDim, kEmbed}, bound, generator);
  *w.mutable_w_o() =
      RandomTensor({kEmbed, kHeads * kHeadDim}, bound, generator);
  *w.mutable_b_q() = RandomTensor({kHeads * kHeadDim}, bound, generator);
  *w.mutable_b_k() = RandomTensor({kHeads * kHeadDim}, bound, generator);
  *w.mutable_b_v() = RandomTensor({kHeads * kHeadDim}, bound, generator);
  *w.mutable_b_o() = RandomTensor({kEmbed}, bound, generator);
  return request;
}

absl::StatusOr<v1::PutWeightsRequest> ReadWeightsFolder(
    const std::string& folder, int64_t max_file_bytes) {
  v1::PutWeightsRequest request;
  request.set_name(std::filesystem::path(folder).filename().string());
  v1::ProjectionWeights& w = *request.mutable_weights();
  ATTNSERVE_RETURN_IF_ERROR(ReadConfig(folder + "/config.txt", &w));
  const std::pair<const char*, v1::Tensor* (v1::ProjectionWeights::*)()>
      files[] = {{"w_q", &v1::ProjectionWeights::mutable_w_q},
                 {"w_k", &v1::ProjectionWeights::mutable_w_k},
                 {"w_v", &v1::ProjectionWeights::mutable_w_v},
                 {"w_o", &v1::ProjectionWeights::mutable_w_o},
                 {"b_q", &v1::ProjectionWeights::mutable_b_q},
                 {"b_k", &v1::ProjectionWeights::mutable_b_k},
                 {"b_v", &v1::ProjectionWeights::mutable_b_v},
                 {"b_o", &v1::ProjectionWeights::mutable_b_o}};
  for (const auto& [name, mutable_tensor] : files) {
    const std::string path = absl::StrCat(folder, "/", name, ".npy");
    const bool optional = name[0] == 'b';
    if (optional && !std::filesystem::exists(path)) continue;
    ATTNSERVE_ASSIGN_OR_RETURN(NpyArray array,
                               ReadNpyFile(path, max_file_bytes));
    ATTNSERVE_ASSIGN_OR_RETURN(*(w.*mutable_tensor)(),
                               NpyToTensor(std::move(array), path));
  }
  return request;
}

absl::StatusOr<std::vector<std::string>> LoadWeightsDir(
    const std::string& directory, int64_t max_file_bytes,
    WeightsRegistry& registry) {
  std::error_code error;
  std::vector<std::string> folders;
  for (const auto& entry :
       std::filesystem::directory_iterator(directory, error)) {
    if (entry.is_directory()) folders.push_back(entry.path().string());
  }
  if (error) {
    return absl::NotFoundError(absl::StrCat(
        "--weights_dir ", directory, " cannot be read: ", error.message()));
  }
  std::sort(folders.begin(), folders.end());
  std::vector<std::string> names;
  for (const std::string& folder : folders) {
    absl::StatusOr<v1::PutWeightsRequest> request =
        ReadWeightsFolder(folder, max_file_bytes);
    absl::Status status = request.status();
    if (status.ok()) status = PutWeightsInto(registry, *request).status();
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat("weights folder ", folder,
                                                      ": ", status.message()));
    }
    names.push_back(request->name());
  }
  return names;
}

}  // namespace attnserve
