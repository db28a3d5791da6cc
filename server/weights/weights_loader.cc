#include "attnserve/server/weights/weights_loader.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "attnserve/common/npy.h"
#include "attnserve/common/refusals.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/proto/tensors.h"
#include "attnserve/proto/weights_folder.h"

namespace attnserve {
namespace {

v1::Tensor RandomTensor(std::vector<int64_t> shape, float bound,
                        std::mt19937_64& generator) {
  std::uniform_real_distribution<float> distribution(-bound, bound);
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values) value = distribution(generator);
  return MakeFloat32Tensor(shape, values);
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

// OK if `path` is a folder or regular file, or a symbolic link that resolves to
// one inside `root` (a canonical path): how Kubernetes mounts a volume, with
// links through `..data`. A link out of the folder, or to anything else, fails
// start-up naming the path, never what it points at.
absl::Status CheckStaysInside(const std::filesystem::path& root,
                              const std::filesystem::path& path) {
  std::error_code error;
  const std::filesystem::file_status link =
      std::filesystem::symlink_status(path, error);
  if (!error && link.type() != std::filesystem::file_type::symlink) {
    if (std::filesystem::is_directory(link) ||
        std::filesystem::is_regular_file(link)) {
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat(
        path.string(), " is not a folder or a regular file (weights_dir)"));
  }
  const std::filesystem::path target = std::filesystem::canonical(path, error);
  const std::string inside = root.string() + "/";
  if (error || target.string().rfind(inside, 0) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(),
                     " is a symbolic link that does not resolve inside "
                     "weights_dir; expected folders and regular files"));
  }
  return CheckStaysInside(root, target);
}

// INVALID_ARGUMENT if `file`, directly in weights_dir, is one that belongs in a
// weight set's folder: weights_dir was pointed at one set (the layout attnctl
// --weights_dir takes) rather than at the folder holding the sets.
absl::Status CheckNotOneSet(const std::string& directory,
                            const std::filesystem::path& file) {
  const std::string name = file.filename().string();
  if (name != "config.txt" && file.extension() != ".npy") {
    return absl::OkStatus();
  }
  std::filesystem::path set =
      std::filesystem::path(directory).lexically_normal();
  if (set.filename().empty()) set = set.parent_path();
  return absl::InvalidArgumentError(absl::StrCat(
      "weights_dir ", directory, " holds ", name,
      ": it is one weight set's folder; expected the folder holding one "
      "folder per weight set (its parent, to register it as '",
      set.filename().string(), "')"));
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

absl::StatusOr<WeightsDirListing> WeightsFolders(const std::string& directory) {
  std::error_code error;
  const std::filesystem::path root =
      std::filesystem::canonical(directory, error);
  WeightsDirListing listing;
  if (!error) {
    // Every call here takes an error code: one that throws (as the range
    // for's increment and directory_entry::is_directory() do, on ELOOP, EIO,
    // an NFS volume's ESTALE, a link swapped after the check) would end the
    // watcher's thread, and the process with it.
    for (std::filesystem::directory_iterator it(root, error), end;
         !error && it != end; it.increment(error)) {
      const std::filesystem::directory_entry& entry = *it;
      if (entry.path().filename().string().rfind('.', 0) == 0) continue;
      if (absl::Status inside = CheckStaysInside(root, entry.path());
          !inside.ok()) {
        listing.refused.push_back(inside);
        // A link that dangles or leads out may be a set's folder mid-swap (its
        // new target not there yet): its set keeps what it held.
        listing.refused_sets.push_back(entry.path().filename().string());
        continue;
      }
      std::error_code type_error;
      const bool folder = entry.is_directory(type_error);
      if (type_error) {
        // Checked a moment ago: a link swapped since, or a file system
        // error. Its set keeps what it held; the next look sees it again.
        listing.refused.push_back(absl::InvalidArgumentError(absl::StrCat(
            entry.path().string(), " cannot be read: ", type_error.message())));
        listing.refused_sets.push_back(entry.path().filename().string());
        continue;
      }
      if (!folder) {
        if (absl::Status file = CheckNotOneSet(directory, entry.path());
            !file.ok()) {
          listing.refused.push_back(file);
        }
        continue;
      }
      absl::Status held = absl::OkStatus();
      std::error_code folder_error;
      for (std::filesystem::directory_iterator file(entry.path(), folder_error),
           files_end;
           !folder_error && file != files_end; file.increment(folder_error)) {
        held = CheckStaysInside(root, file->path());
        if (!held.ok()) break;
      }
      if (folder_error) {
        held = absl::InvalidArgumentError(
            absl::StrCat(entry.path().string(),
                         " cannot be read: ", folder_error.message()));
      }
      if (!held.ok()) {
        listing.refused.push_back(held);
        listing.refused_sets.push_back(entry.path().filename().string());
        continue;
      }
      listing.folders.push_back(entry.path().string());
    }
  }
  if (error) {
    return absl::NotFoundError(absl::StrCat(
        "weights_dir ", directory, " cannot be read: ", error.message()));
  }
  std::sort(listing.folders.begin(), listing.folders.end());
  return listing;
}

absl::StatusOr<v1::PutWeightsRequest> ReadWeightsFolder(
    const std::string& folder, int64_t max_file_bytes) {
  // The files' sizes first: a set larger than the registry could hold is
  // refused before any of it is read. A float64 file halves when converted,
  // so twice the limit is the most that can still fit.
  int64_t total = 0;
  for (const char* name : kWeightsFolderTensors) {
    std::error_code error;
    const std::uintmax_t size = std::filesystem::file_size(
        absl::StrCat(folder, "/", name, ".npy"), error);
    if (!error)
      total += static_cast<int64_t>(std::min<std::uintmax_t>(
          size, std::numeric_limits<int64_t>::max() / 16));
  }
  if (total / 2 > max_file_bytes) {
    return Permanent(absl::ResourceExhaustedError(absl::StrCat(
        "its .npy files hold ", total,
        " bytes, more than twice max_weights_bytes (", max_file_bytes,
        "), more than the registry could hold even from float64; nothing "
        "was read")));
  }
  v1::PutWeightsRequest request;
  request.set_name(std::filesystem::path(folder).filename().string());
  ATTNSERVE_ASSIGN_OR_RETURN(
      *request.mutable_weights(),
      ReadWeightsFolderWith(
          folder,
          [max_file_bytes](
              const std::string& path) -> absl::StatusOr<v1::Tensor> {
            // A float64 file may be twice what its set holds once converted.
            const int64_t most =
                max_file_bytes > std::numeric_limits<int64_t>::max() / 2
                    ? std::numeric_limits<int64_t>::max()
                    : 2 * max_file_bytes;
            ATTNSERVE_ASSIGN_OR_RETURN(NpyArray array, ReadNpyFile(path, most));
            return NpyToTensor(std::move(array), path);
          }));
  return request;
}

}  // namespace attnserve
