// Weight sets the server registers: the built-in `demo` set, and folders of
// .npy files (--weights_dir, kept in step by weights_dir_watcher.h).
//
// --weights_dir layout: one folder per weight-set name, holding
//   config.txt                        num_heads=H, optionally num_kv_heads=Hkv
//                                     and version=N, one key=value a line
//   w_q.npy w_k.npy w_v.npy w_o.npy   torch.nn.Linear layout ([out, in])
//   b_q.npy b_k.npy b_v.npy b_o.npy   optional biases
// Arrays may be float32, float16 or float64 ('<f4', '<f2', '<f8'); float64 is
// rounded to float32. A PyTorch nn.MultiheadAttention state dict fits after
// cutting in_proj_weight in three.
#ifndef ATTNSERVE_SERVER_WEIGHTS_WEIGHTS_LOADER_H_
#define ATTNSERVE_SERVER_WEIGHTS_WEIGHTS_LOADER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attnserve/server/weights/weights_registry.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// The name of the built-in weight set.
inline constexpr char kDemoWeightsName[] = "demo";

// The built-in `demo` weight set: E = 64, H = Hkv = 8, Dk = Dv = 8, with
// biases; values drawn from a fixed seed, so every server holds the same
// numbers.
v1::PutWeightsRequest DemoWeights();

// What `directory` holds: its set folders (sorted), skipping hidden entries
// (Kubernetes' ..data), and the entries refused, each with INVALID_ARGUMENT
// naming it. Every entry, and everything in each folder, must be a folder or a
// regular file, or a symbolic link resolving to one inside `directory`; a
// set's file directly in `directory` is refused too. A folder refused for what
// it holds, or an entry refused as a link that dangles or leads out (a set's
// folder swapped to a target not there yet), is listed by its name in
// `refused_sets` (its set keeps its last good version while the server runs).
struct WeightsDirListing {
  std::vector<std::string> folders;
  std::vector<absl::Status> refused;
  std::vector<std::string> refused_sets;
};
// NOT_FOUND if `directory` cannot be read.
absl::StatusOr<WeightsDirListing> WeightsFolders(const std::string& directory);

// Reads the weight set in `folder` (named by its last path component) as a
// PutWeights request. The set is refused before anything is read if its
// files hold more than twice `max_file_bytes` (the registry's
// max_weights_bytes: float64 files halve when converted), and so is each file
// over twice it; the registry then checks what the set holds.
absl::StatusOr<v1::PutWeightsRequest> ReadWeightsFolder(
    const std::string& folder, int64_t max_file_bytes);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_WEIGHTS_WEIGHTS_LOADER_H_
