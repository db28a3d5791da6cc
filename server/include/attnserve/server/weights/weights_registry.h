// Named, versioned projection weights for MultiHeadAttention's weights_name.
//
// A put replaces a name atomically; a call holds the shared_ptr of the version
// it started with, so a replacement or deletion never changes weights under a
// running call.
#ifndef ATTNSERVE_SERVER_WEIGHTS_WEIGHTS_REGISTRY_H_
#define ATTNSERVE_SERVER_WEIGHTS_WEIGHTS_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/core/attention_types.h"
#include "attnserve/server/weights/weights_validator.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// One immutable weight set, held as f32, with Q, K and V also stacked for a
// fused projection when E == Ekv. Thread-safe (immutable).
class WeightSet {
 public:
  // The bytes the set `weights` (validated, of `shape`) will hold, computed
  // before converting anything so that the registry's limit is checked first.
  static int64_t BytesFor(const WeightsShape& shape,
                          const v1::ProjectionWeights& weights);

  // Converts validated proto weights.
  static std::shared_ptr<const WeightSet> FromProto(
      const v1::ProjectionWeights& weights, const WeightsShape& shape);

  const WeightsShape& shape() const { return shape_; }
  const ProjectionWeights& views() const { return views_; }
  int64_t bytes() const { return bytes_; }
  bool has_bias() const { return has_bias_; }

 private:
  WeightsShape shape_;
  std::vector<float> w_q_, w_k_, w_v_, w_o_, b_q_, b_k_, b_v_, b_o_, w_qkv_,
      b_qkv_;
  ProjectionWeights views_;
  int64_t bytes_ = 0;
  bool has_bias_ = false;
};

// Thread-safe.
class WeightsRegistry {
 public:
  struct Entry {
    std::shared_ptr<const WeightSet> weights;
    int64_t version = 0;
  };

  // Holds at most `max_total_bytes` of weights in all.
  explicit WeightsRegistry(int64_t max_total_bytes)
      : max_total_bytes_(max_total_bytes) {}

  // RESOURCE_EXHAUSTED if storing `bytes` under `name` (replacing what it
  // holds) would pass the limit. Put checks again; this lets a caller refuse
  // before converting anything.
  absl::Status CheckCapacity(const std::string& name, int64_t bytes) const;

  // Stores `weights` under `name`, replacing any previous version, and returns
  // the new entry: at `version` if positive (a --weights_dir set's own), else
  // at the next of the registry's count of puts.
  absl::StatusOr<Entry> Put(const std::string& name,
                            std::shared_ptr<const WeightSet> weights,
                            int64_t version = 0);

  // NOT_FOUND for an unknown name.
  absl::StatusOr<Entry> Get(const std::string& name) const;
  absl::StatusOr<Entry> Delete(const std::string& name);

  // Every entry, sorted by name, and the bytes they hold, read at one instant.
  struct Listing {
    std::vector<std::pair<std::string, Entry>> entries;
    int64_t total_bytes = 0;
  };
  Listing List() const;

 private:
  absl::Status CheckCapacityLocked(const std::string& name, int64_t bytes) const
      ABSL_SHARED_LOCKS_REQUIRED(mutex_);

  const int64_t max_total_bytes_;
  mutable absl::Mutex mutex_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mutex_);
  int64_t total_bytes_ ABSL_GUARDED_BY(mutex_) = 0;
  int64_t last_version_ ABSL_GUARDED_BY(mutex_) = 0;
};

// Fills a WeightsInfo for `name`.
v1::WeightsInfo DescribeWeights(const std::string& name,
                                const WeightsRegistry::Entry& entry);

// Validates, converts and registers `request` (shared by PutWeights and the
// start-up loaders).
// `version` as for WeightsRegistry::Put.
absl::StatusOr<v1::PutWeightsResponse> PutWeightsInto(
    WeightsRegistry& registry, const v1::PutWeightsRequest& request,
    int64_t version = 0);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_WEIGHTS_WEIGHTS_REGISTRY_H_
