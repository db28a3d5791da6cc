// A weight-set folder (docs/api.md, "Weights registry"), read into
// ProjectionWeights by the server's --weights_dir loader and by attnctl:
//   config.txt                        num_heads=H, optionally num_kv_heads=Hkv
//   w_q.npy w_k.npy w_v.npy w_o.npy   torch.nn.Linear layout ([out, in])
//   b_q.npy b_k.npy b_v.npy b_o.npy   optional biases
// Each side reads a .npy file into a Tensor its own way (limits, dtypes).
#ifndef ATTNSERVE_PROTO_WEIGHTS_FOLDER_H_
#define ATTNSERVE_PROTO_WEIGHTS_FOLDER_H_

#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// The tensors a folder holds, each as NAME.npy: the weights, then the
// optional biases.
inline constexpr const char* kWeightsFolderTensors[] = {
    "w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"};

// Reads the weight set in `folder`: the head counts from config.txt, each
// tensor through `read` (given the path of its .npy file; a bias whose file is
// absent stays unset). NOT_FOUND for a missing config.txt; otherwise the first
// error of ReadWeightsConfig or `read`. The shapes are left to
// ValidateProjectionWeights.
absl::StatusOr<v1::ProjectionWeights> ReadWeightsFolderWith(
    const std::string& folder,
    absl::FunctionRef<absl::StatusOr<v1::Tensor>(const std::string& path)>
        read);

}  // namespace attnserve

#endif  // ATTNSERVE_PROTO_WEIGHTS_FOLDER_H_
