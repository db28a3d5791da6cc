// Named, versioned projection weights for MultiHeadAttention's weights_name.
//
// A put replaces a name atomically; a call holds the shared_ptr of the version
// it started with, so a replacement or deletion never changes weights under a
// running call.
#ifndef ATTNSERVE_SERVER_WEIGHTS_WEIGHTS_REGISTRY_H_
#define ATTNSERVE_SERVER_WEIGHTS_WEIGHTS_REGISTRY_H_

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/core/attention_types.h"
#include "attnserve/server/weights/weights_validator.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// One immutable weight set, held as f32; when E == Ekv, Q, K and V are held
// stacked (once) for a fused projection, each a view of its rows.
// Thread-safe (immutable).
class WeightSet {
 public:
  // The bytes the set `weights` (validated, of `shape`) will hold, computed
  // before converting anything so that the registry's limit is checked first.
  static int64_t BytesFor(const WeightsShape& shape,
                          const v1::ProjectionWeights& weights);

  // Converts validated proto weights.
  static std::shared_ptr<const WeightSet> FromProto(
      const v1::ProjectionWeights& weights, const WeightsShape& shape);
  // The same, emptying each tensor of `weights` once it is converted, so that
  // the proto's bytes and the set are held together for one tensor, not the
  // whole set (a reload of a large set from weights_dir).
  static std::shared_ptr<const WeightSet> FromProto(
      v1::ProjectionWeights* weights, const WeightsShape& shape);

  const WeightsShape& shape() const { return shape_; }
  const ProjectionWeights& views() const { return views_; }
  int64_t bytes() const { return bytes_; }
  bool has_bias() const { return has_bias_; }

 private:
  // FromProto's conversion; `release`, if given, is `w` to empty as it goes.
  static std::shared_ptr<const WeightSet> Build(const v1::ProjectionWeights& w,
                                                const WeightsShape& shape,
                                                v1::ProjectionWeights* release);

  WeightsShape shape_;
  // w_q_, w_k_ and w_v_ stay empty when they are stacked in w_qkv_.
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

  // The limit on the bytes of every set together.
  int64_t max_total_bytes() const { return max_total_bytes_; }

  // NOT_FOUND for an unknown name.
  absl::StatusOr<Entry> Get(const std::string& name) const;
  // With `only_version`, FAILED_PRECONDITION (and nothing deleted) when the
  // set is at another version: a put since it was read stands.
  absl::StatusOr<Entry> Delete(
      const std::string& name,
      std::optional<int64_t> only_version = std::nullopt);

  // A page of entries, sorted by name, and the registry's totals, read at one
  // instant.
  struct Listing {
    std::vector<std::pair<std::string, Entry>> entries;
    int64_t total_bytes = 0;  // Of every set, not the page's alone.
    int64_t total_sets = 0;
    bool more = false;  // Sets follow the page's last.
  };
  // The entries named after `after` ("": from the first), at most
  // `max_entries` of them (0: none, the totals only).
  Listing List(const std::string& after = "",
               int64_t max_entries = std::numeric_limits<int64_t>::max()) const;

 private:
  absl::Status CheckCapacityLocked(const std::string& name, int64_t bytes) const
      ABSL_SHARED_LOCKS_REQUIRED(mutex_);

  const int64_t max_total_bytes_;
  mutable absl::Mutex mutex_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mutex_);
  int64_t total_bytes_ ABSL_GUARDED_BY(mutex_) = 0;
  int64_t last_version_ ABSL_GUARDED_BY(mutex_) = 0;
};

// What a weight set costs beyond its f32 values: the set, its name and its
// entry in the registry (measured under 1 KiB), so that many tiny sets are
// bounded by --max_weights_bytes too.
inline constexpr int64_t kWeightSetOverheadBytes = 1024;

// The most sets one ListWeights answer holds, whatever its page_size.
inline constexpr int64_t kMaxWeightsPage = 4096;

// Fills a WeightsInfo for `name`.
v1::WeightsInfo DescribeWeights(const std::string& name,
                                const WeightsRegistry::Entry& entry);

// ListWeights: the sets after request.page_token, as many as fit in a
// message of `max_message_bytes` (and at most page_size, and
// kMaxWeightsPage), with next_page_token set when more follow.
// INVALID_ARGUMENT for a negative page_size or a token that is not a name.
absl::Status ListWeightsPage(const WeightsRegistry& registry,
                             const v1::ListWeightsRequest& request,
                             int64_t max_message_bytes,
                             v1::ListWeightsResponse* response);

// Validates, converts and registers `request` (shared by PutWeights and the
// start-up loaders).
// `version` as for WeightsRegistry::Put.
absl::StatusOr<v1::PutWeightsResponse> PutWeightsInto(
    WeightsRegistry& registry, const v1::PutWeightsRequest& request,
    int64_t version = 0);
// The same, emptying `request`'s tensors as they are converted once it is
// accepted (a request refused is left whole).
absl::StatusOr<v1::PutWeightsResponse> PutWeightsInto(
    WeightsRegistry& registry, v1::PutWeightsRequest* request,
    int64_t version = 0);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_WEIGHTS_WEIGHTS_REGISTRY_H_
