#include "attnserve/proto/weights_folder.h"

#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/common/weights_config.h"

namespace attnserve {

absl::StatusOr<v1::ProjectionWeights> ReadWeightsFolderWith(
    const std::string& folder,
    absl::FunctionRef<absl::StatusOr<v1::Tensor>(const std::string& path)>
        read) {
  v1::ProjectionWeights weights;
  ATTNSERVE_ASSIGN_OR_RETURN(const WeightsConfig config,
                             ReadWeightsConfig(folder + "/config.txt"));
  weights.set_num_heads(config.num_heads);
  weights.set_num_kv_heads(config.num_kv_heads);
  if (config.rope_theta > 0) {
    weights.mutable_rope()->set_theta(static_cast<float>(config.rope_theta));
    weights.mutable_rope()->set_rotary_dim(config.rotary_dim);
    weights.mutable_rope()->set_interleaved(config.rope_interleaved);
  }
  const std::pair<const char*, v1::Tensor* (v1::ProjectionWeights::*)()>
      files[] = {
          {kWeightsFolderTensors[0], &v1::ProjectionWeights::mutable_w_q},
          {kWeightsFolderTensors[1], &v1::ProjectionWeights::mutable_w_k},
          {kWeightsFolderTensors[2], &v1::ProjectionWeights::mutable_w_v},
          {kWeightsFolderTensors[3], &v1::ProjectionWeights::mutable_w_o},
          {kWeightsFolderTensors[4], &v1::ProjectionWeights::mutable_b_q},
          {kWeightsFolderTensors[5], &v1::ProjectionWeights::mutable_b_k},
          {kWeightsFolderTensors[6], &v1::ProjectionWeights::mutable_b_v},
          {kWeightsFolderTensors[7], &v1::ProjectionWeights::mutable_b_o}};
  for (const auto& [name, mutable_tensor] : files) {
    const std::string path = absl::StrCat(folder, "/", name, ".npy");
    const bool optional = name[0] == 'b';
    if (optional) {
      // Absent only if no entry has the name: a link that loops or leads
      // nowhere is read, and refused naming it (std::filesystem::exists
      // threw on a loop, which ended attnctl).
      std::error_code error;
      if (std::filesystem::symlink_status(path, error).type() ==
          std::filesystem::file_type::not_found) {
        continue;
      }
    }
    ATTNSERVE_ASSIGN_OR_RETURN(*(weights.*mutable_tensor)(), read(path));
  }
  return weights;
}

}  // namespace attnserve
