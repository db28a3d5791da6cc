#include "weights.h"

#include <cstdio>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/proto/weights_folder.h"
#include "cli.h"

namespace attnserve {
namespace {

int RunList(Client& client) {
  absl::StatusOr<v1::ListWeightsResponse> list =
      client.ListWeights(CallTimeout());
  if (!list.ok()) return Fail(list.status());
  for (const v1::WeightsInfo& info : list->weights()) {
    std::printf("%s\n", FormatWeightsInfo(info).c_str());
  }
  return kExitOk;
}

int RunPut(Client& client, const std::string& name, const std::string& folder,
           const TensorReadOptions& options) {
  v1::PutWeightsRequest request;
  request.set_name(name);
  absl::StatusOr<v1::ProjectionWeights> weights =
      ReadWeightsFolder(folder, options);
  if (!weights.ok()) return UsageError(weights.status());
  *request.mutable_weights() = *std::move(weights);
  absl::StatusOr<v1::PutWeightsResponse> response =
      client.PutWeights(request, CallTimeout());
  if (!response.ok()) return Fail(response.status());
  std::printf("%s version=%lld bytes=%lld\n", name.c_str(),
              static_cast<long long>(response->version()),
              static_cast<long long>(response->bytes()));
  return kExitOk;
}

int RunDelete(Client& client, const std::string& name) {
  absl::StatusOr<v1::DeleteWeightsResponse> response =
      client.DeleteWeights(name, CallTimeout());
  if (!response.ok()) return Fail(response.status());
  std::printf("deleted %s\n", FormatWeightsInfo(response->deleted()).c_str());
  return kExitOk;
}

}  // namespace

absl::StatusOr<v1::ProjectionWeights> ReadWeightsFolder(
    const std::string& folder, const TensorReadOptions& options) {
  return ReadWeightsFolderWith(folder, [&options](const std::string& path) {
    return ReadTensorFile(path, options);
  });
}

absl::StatusOr<v1::WeightsInfo> DescribeWeights(
    const v1::ProjectionWeights& weights) {
  if (weights.num_heads() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_heads is ", weights.num_heads(), ", expected a positive count"));
  }
  for (const auto& [name, tensor] :
       {std::pair<const char*, const v1::Tensor*>{"w_q", &weights.w_q()},
        {"w_k", &weights.w_k()},
        {"w_v", &weights.w_v()},
        {"w_o", &weights.w_o()}}) {
    if (tensor->shape_size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " has ", tensor->shape_size(),
                       " dimensions, expected 2 ([out, in])"));
    }
  }
  v1::WeightsInfo info;
  const int64_t kv_heads =
      weights.num_kv_heads() > 0 ? weights.num_kv_heads() : weights.num_heads();
  info.set_num_heads(weights.num_heads());
  info.set_num_kv_heads(kv_heads);
  info.set_embed_dim(weights.w_q().shape(1));
  info.set_kv_embed_dim(weights.w_k().shape(1));
  info.set_key_dim(weights.w_q().shape(0) / weights.num_heads());
  info.set_value_dim(weights.w_v().shape(0) / kv_heads);
  info.set_has_bias(weights.has_b_q() || weights.has_b_k() ||
                    weights.has_b_v() || weights.has_b_o());
  return info;
}

absl::StatusOr<v1::WeightsInfo> FindWeights(Client& client,
                                            const std::string& name) {
  ATTNSERVE_ASSIGN_OR_RETURN(v1::ListWeightsResponse list,
                             client.ListWeights(CallTimeout()));
  for (const v1::WeightsInfo& info : list.weights()) {
    if (info.name() == name) return info;
  }
  return absl::NotFoundError(
      absl::StrCat("no weight set named '", name, "' on the server"));
}

absl::StatusOr<v1::WeightsInfo> WeightsInfoFor(
    Client& client, const v1::MultiHeadAttentionRequest& request) {
  if (request.has_weights()) return DescribeWeights(request.weights());
  return FindWeights(client, request.weights_name());
}

std::string FormatWeightsInfo(const v1::WeightsInfo& info) {
  return absl::StrCat(info.name(), " version=", info.version(),
                      " E=", info.embed_dim(), " Ekv=", info.kv_embed_dim(),
                      " H=", info.num_heads(), " Hkv=", info.num_kv_heads(),
                      " Dk=", info.key_dim(), " Dv=", info.value_dim(),
                      " bias=", info.has_bias() ? 1 : 0,
                      " bytes=", info.bytes());
}

int RunWeights(Client& client, const std::vector<std::string>& args,
               const TensorReadOptions& options) {
  if (args.empty() || (args.size() == 1 && args[0] == "list")) {
    return RunList(client);
  }
  if (args.size() == 3 && args[0] == "put") {
    return RunPut(client, args[1], args[2], options);
  }
  if (args.size() == 2 && args[0] == "delete") {
    return RunDelete(client, args[1]);
  }
  return UsageError(absl::InvalidArgumentError(
      "weights takes no argument, list, put NAME FOLDER, or delete NAME"));
}

}  // namespace attnserve
