// attnctl weights: the server's weights registry from the command line, and
// the reader of weight-set folders that `weights put` and `mha --weights_dir`
// share.
//
// A weight-set folder has the layout of the server's --weights_dir entries:
//   config.txt                        num_heads=H, optionally num_kv_heads=Hkv
//   w_q.npy w_k.npy w_v.npy w_o.npy   torch.nn.Linear layout ([out, in])
//   b_q.npy b_k.npy b_v.npy b_o.npy   optional biases
// Arrays are float32, float16 or float64 (rounded to float32), or bfloat16 as
// uint16 with --bf16_as_uint16.
#ifndef ATTNSERVE_CLIENT_ATTNCTL_WEIGHTS_H_
#define ATTNSERVE_CLIENT_ATTNCTL_WEIGHTS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attnserve/client/client.h"
#include "attnserve/v1/attention.pb.h"
#include "tensor_io.h"

namespace attnserve {

// Reads the weight set in `folder`. NOT_FOUND for a missing config.txt or
// w_*.npy, INVALID_ARGUMENT (naming the file) for one that does not parse;
// the arrays' shapes are left to the server to check.
absl::StatusOr<v1::ProjectionWeights> ReadWeightsFolder(
    const std::string& folder, const TensorReadOptions& options);

// The dimensions of `weights` (num_heads, num_kv_heads, embed_dim,
// kv_embed_dim, key_dim, value_dim, has_bias); name, version and bytes stay
// unset. INVALID_ARGUMENT if num_heads is not positive or a w_* is not 2-d.
absl::StatusOr<v1::WeightsInfo> DescribeWeights(
    const v1::ProjectionWeights& weights);

// The registered weight set `name`: ListWeights' error if the call fails,
// NOT_FOUND if no set has that name.
absl::StatusOr<v1::WeightsInfo> FindWeights(Client& client,
                                            const std::string& name);

// The dimensions of the weights `request` uses: DescribeWeights of inline
// weights, or FindWeights of its weights_name.
absl::StatusOr<v1::WeightsInfo> WeightsInfoFor(
    Client& client, const v1::MultiHeadAttentionRequest& request);

// One line describing `info`, as `attnctl weights list` prints it:
// "NAME version=V E=.. Ekv=.. H=.. Hkv=.. Dk=.. Dv=.. bias=0|1 bytes=..".
std::string FormatWeightsInfo(const v1::WeightsInfo& info);

// Runs `attnctl weights ARGS...`: no argument or `list`, `put NAME FOLDER`,
// `delete NAME`; `put` reads the folder with `options`. Returns the exit
// status.
int RunWeights(Client& client, const std::vector<std::string>& args,
               const TensorReadOptions& options);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTNCTL_WEIGHTS_H_
