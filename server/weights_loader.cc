#include "weights_loader.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>

#include "absl/strings/str_cat.h"
#include "attention_service.h"
#include "attnserve/common/npy.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/common/weights_config.h"

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
  ATTNSERVE_ASSIGN_OR_RETURN(const WeightsConfig config,
                             ReadWeightsConfig(folder + "/config.txt"));
  w.set_num_heads(config.num_heads);
  w.set_num_kv_heads(config.num_kv_heads);
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
