#include "attnserve/server/weights/weights_registry.h"

#include <malloc.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnserve/common/echo.h"
#include "attnserve/common/refusals.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/server/tensors/tensor_codec.h"

namespace attnserve {
namespace {

std::vector<float> ToVector(const v1::Tensor& tensor) {
  std::vector<float> storage;
  const absl::Span<const float> values = FloatElements(tensor, &storage);
  if (storage.empty()) storage.assign(values.begin(), values.end());
  return storage;
}

absl::Span<const float> View(const std::vector<float>& values) {
  return values;
}

// Frees `tensor`'s bytes (when releasing), once they have been converted, and
// hands them back to the system: the server's malloc keeps what is freed for
// the next calls (main.cc), so without the trim the bytes would stay resident
// beside the set being built.
void Release(v1::Tensor* tensor) {
  if (tensor == nullptr) return;
  std::string().swap(*tensor->mutable_data());
  malloc_trim(0);
}

}  // namespace

int64_t WeightSet::BytesFor(const WeightsShape& s,
                            const v1::ProjectionWeights& w) {
  const int64_t q = s.heads * s.key_dim, k = s.kv_heads * s.key_dim,
                v = s.kv_heads * s.value_dim;
  int64_t floats = q * s.embed_dim + (k + v) * s.kv_embed_dim +
                   s.embed_dim * s.heads * s.value_dim;
  const bool qkv_bias = w.has_b_q() || w.has_b_k() || w.has_b_v();
  floats += (w.has_b_q() ? q : 0) + (w.has_b_k() ? k : 0) +
            (w.has_b_v() ? v : 0) + (w.has_b_o() ? s.embed_dim : 0);
  if (s.embed_dim == s.kv_embed_dim && qkv_bias) {
    // The stacked bias of the fused projection (the weights are stacked in
    // place: one copy).
    floats += q + k + v;
  }
  return floats * int64_t{sizeof(float)} + kWeightSetOverheadBytes;
}

std::shared_ptr<const WeightSet> WeightSet::FromProto(
    const v1::ProjectionWeights& weights, const WeightsShape& shape) {
  return Build(weights, shape, nullptr);
}

std::shared_ptr<const WeightSet> WeightSet::FromProto(
    v1::ProjectionWeights* weights, const WeightsShape& shape) {
  return Build(*weights, shape, weights);
}

std::shared_ptr<const WeightSet> WeightSet::Build(
    const v1::ProjectionWeights& w, const WeightsShape& shape,
    v1::ProjectionWeights* release) {
  // The tensor of `release` matching `field` of w, or null.
  const auto releasing =
      [release](v1::Tensor* (v1::ProjectionWeights::*field)()) -> v1::Tensor* {
    return release ? (release->*field)() : nullptr;
  };
  auto set = std::make_shared<WeightSet>();
  set->shape_ = shape;
  const bool stacked = shape.embed_dim == shape.kv_embed_dim;
  if (stacked) {
    // Self-attention projects Q, K and V in one GEMM over the stacked rows:
    // they are stored stacked, once, and each is a view of its rows.
    const int64_t rows = shape.heads * shape.key_dim +
                         shape.kv_heads * (shape.key_dim + shape.value_dim);
    set->w_qkv_.reserve(static_cast<size_t>(rows * shape.embed_dim));
    // (The reserved rows take memory only as they are written, each part's
    // bytes freed after it.)
    using Field = v1::Tensor* (v1::ProjectionWeights::*)();
    const std::pair<const v1::Tensor*, Field> parts[] = {
        {&w.w_q(), &v1::ProjectionWeights::mutable_w_q},
        {&w.w_k(), &v1::ProjectionWeights::mutable_w_k},
        {&w.w_v(), &v1::ProjectionWeights::mutable_w_v}};
    for (const auto& [part, field] : parts) {
      {
        std::vector<float> storage;
        const absl::Span<const float> values = FloatElements(*part, &storage);
        set->w_qkv_.insert(set->w_qkv_.end(), values.begin(), values.end());
      }
      Release(releasing(field));
    }
  } else {
    set->w_q_ = ToVector(w.w_q());
    Release(releasing(&v1::ProjectionWeights::mutable_w_q));
    set->w_k_ = ToVector(w.w_k());
    Release(releasing(&v1::ProjectionWeights::mutable_w_k));
    set->w_v_ = ToVector(w.w_v());
    Release(releasing(&v1::ProjectionWeights::mutable_w_v));
  }
  set->w_o_ = ToVector(w.w_o());
  Release(releasing(&v1::ProjectionWeights::mutable_w_o));
  if (w.has_b_q()) set->b_q_ = ToVector(w.b_q());
  if (w.has_b_k()) set->b_k_ = ToVector(w.b_k());
  if (w.has_b_v()) set->b_v_ = ToVector(w.b_v());
  if (w.has_b_o()) set->b_o_ = ToVector(w.b_o());
  set->has_bias_ = w.has_b_q() || w.has_b_k() || w.has_b_v() || w.has_b_o();
  ProjectionWeights& views = set->views_;
  if (w.has_rope()) views.rope = RotaryOf(w.rope());
  if (stacked) {
    const absl::Span<const float> all = View(set->w_qkv_);
    const size_t q =
        static_cast<size_t>(shape.heads * shape.key_dim * shape.embed_dim);
    const size_t k =
        static_cast<size_t>(shape.kv_heads * shape.key_dim * shape.embed_dim);
    views.w_q = all.subspan(0, q);
    views.w_k = all.subspan(q, k);
    views.w_v = all.subspan(q + k);
    views.w_qkv = all;
  } else {
    views.w_q = View(set->w_q_);
    views.w_k = View(set->w_k_);
    views.w_v = View(set->w_v_);
  }
  views.w_o = View(set->w_o_);
  views.b_q = View(set->b_q_);
  views.b_k = View(set->b_k_);
  views.b_v = View(set->b_v_);
  views.b_o = View(set->b_o_);
  if (stacked) {
    if (w.has_b_q() || w.has_b_k() || w.has_b_v()) {
      const int64_t rows[3] = {shape.heads * shape.key_dim,
                               shape.kv_heads * shape.key_dim,
                               shape.kv_heads * shape.value_dim};
      const std::vector<float>* parts[3] = {&set->b_q_, &set->b_k_, &set->b_v_};
      for (int i = 0; i < 3; ++i) {
        if (parts[i]->empty()) {
          set->b_qkv_.insert(set->b_qkv_.end(), static_cast<size_t>(rows[i]),
                             0.0f);
        } else {
          set->b_qkv_.insert(set->b_qkv_.end(), parts[i]->begin(),
                             parts[i]->end());
        }
      }
      views.b_qkv = View(set->b_qkv_);
    }
  }
  set->bytes_ = BytesFor(shape, w);
  return set;
}

absl::Status WeightsRegistry::CheckCapacity(const std::string& name,
                                            int64_t bytes) const {
  absl::ReaderMutexLock lock(&mutex_);
  return CheckCapacityLocked(name, bytes);
}

absl::Status WeightsRegistry::CheckCapacityLocked(const std::string& name,
                                                  int64_t bytes) const {
  const auto existing = entries_.find(name);
  const int64_t freed =
      existing == entries_.end() ? 0 : existing->second.weights->bytes();
  if (total_bytes_ - freed + bytes <= max_total_bytes_) return absl::OkStatus();
  if (bytes > max_total_bytes_) {
    return Permanent(absl::ResourceExhaustedError(
        absl::StrCat("weights '", name, "' need ", bytes,
                     " bytes, more than the whole max_weights_bytes limit of ",
                     max_total_bytes_)));
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "weights '", name, "' need ", bytes, " bytes; the registry holds ",
      total_bytes_, " of its max_weights_bytes limit of ", max_total_bytes_));
}

absl::StatusOr<WeightsRegistry::Entry> WeightsRegistry::Put(
    const std::string& name, std::shared_ptr<const WeightSet> weights,
    int64_t version) {
  absl::MutexLock lock(&mutex_);
  const absl::Status capacity = CheckCapacityLocked(name, weights->bytes());
  if (!capacity.ok()) return capacity;
  Entry& entry = entries_[name];
  if (entry.weights != nullptr) total_bytes_ -= entry.weights->bytes();
  total_bytes_ += weights->bytes();
  entry.weights = std::move(weights);
  // A folder's own version moves the counter too, so that a later put (of
  // any name) never gets a version a folder's set has, or a lower one: a
  // weights_version pin names one set of weights.
  entry.version = version > 0 ? version : ++last_version_;
  last_version_ = std::max(last_version_, entry.version);
  return entry;
}

absl::StatusOr<WeightsRegistry::Entry> WeightsRegistry::Get(
    const std::string& name) const {
  absl::ReaderMutexLock lock(&mutex_);
  const auto it = entries_.find(name);
  if (it == entries_.end()) {
    return absl::NotFoundError(
        absl::StrCat("weights_name '", name,
                     "' is not registered (ListWeights shows the names)"));
  }
  return it->second;
}

absl::StatusOr<WeightsRegistry::Entry> WeightsRegistry::Delete(
    const std::string& name, std::optional<int64_t> only_version) {
  absl::MutexLock lock(&mutex_);
  const auto it = entries_.find(name);
  if (it == entries_.end()) {
    return absl::NotFoundError(
        absl::StrCat("name '", name, "' is not registered"));
  }
  if (only_version && it->second.version != *only_version) {
    return absl::FailedPreconditionError(
        absl::StrCat("weights '", name, "' are at version ", it->second.version,
                     ", not ", *only_version, "; kept"));
  }
  Entry entry = std::move(it->second);
  entries_.erase(it);
  total_bytes_ -= entry.weights->bytes();
  return entry;
}

WeightsRegistry::Listing WeightsRegistry::List(const std::string& after,
                                               int64_t max_entries) const {
  absl::ReaderMutexLock lock(&mutex_);
  Listing listing;
  listing.total_bytes = total_bytes_;
  listing.total_sets = static_cast<int64_t>(entries_.size());
  auto it = after.empty() ? entries_.begin() : entries_.upper_bound(after);
  for (; it != entries_.end(); ++it) {
    if (static_cast<int64_t>(listing.entries.size()) >= max_entries) {
      listing.more = true;
      break;
    }
    listing.entries.emplace_back(it->first, it->second);
  }
  return listing;
}

v1::WeightsInfo DescribeWeights(const std::string& name,
                                const WeightsRegistry::Entry& entry) {
  const WeightsShape& s = entry.weights->shape();
  v1::WeightsInfo info;
  info.set_name(name);
  info.set_version(entry.version);
  info.set_bytes(entry.weights->bytes());
  info.set_num_heads(s.heads);
  info.set_num_kv_heads(s.kv_heads);
  info.set_embed_dim(s.embed_dim);
  info.set_kv_embed_dim(s.kv_embed_dim);
  info.set_key_dim(s.key_dim);
  info.set_value_dim(s.value_dim);
  info.set_has_bias(entry.weights->has_bias());
  return info;
}

namespace {

// Room in a message for what is not a set: the total, the token, tags.
constexpr int64_t kListingOverheadBytes = 256;

}  // namespace

absl::Status ListWeightsPage(const WeightsRegistry& registry,
                             const v1::ListWeightsRequest& request,
                             int64_t max_message_bytes,
                             v1::ListWeightsResponse* response) {
  if (request.page_size() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size is ", request.page_size(),
                     ", expected 0 (as many as fit) or more"));
  }
  // A token is the name the previous page ended with.
  if (!request.page_token().empty() &&
      !ValidateWeightsName("page_token", request.page_token()).ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page_token is ", EchoText(request.page_token()),
        ", expected empty or the next_page_token of a ListWeights answer"));
  }
  const int64_t most = request.page_size() > 0
                           ? std::min(request.page_size(), kMaxWeightsPage)
                           : kMaxWeightsPage;
  const WeightsRegistry::Listing listing =
      registry.List(request.page_token(), most);
  response->set_total_bytes(listing.total_bytes);
  const int64_t room = max_message_bytes - kListingOverheadBytes;
  int64_t used = 0;
  bool more = listing.more;
  for (const auto& [name, entry] : listing.entries) {
    v1::WeightsInfo info = DescribeWeights(name, entry);
    const int64_t bytes = static_cast<int64_t>(info.ByteSizeLong()) + 8;
    if (used + bytes > room) {
      if (response->weights_size() == 0) {
        return Permanent(absl::ResourceExhaustedError(absl::StrCat(
            "weights '", name, "' alone take ", bytes,
            " bytes to describe, over the max_message_bytes limit of ",
            max_message_bytes)));
      }
      more = true;
      break;
    }
    used += bytes;
    *response->add_weights() = std::move(info);
  }
  if (more && response->weights_size() > 0) {
    response->set_next_page_token(
        response->weights(response->weights_size() - 1).name());
  }
  return absl::OkStatus();
}

namespace {

// PutWeightsInto's work; `release`, if given, is `request` to empty once it
// is accepted.
absl::StatusOr<v1::PutWeightsResponse> PutWeights(
    WeightsRegistry& registry, const v1::PutWeightsRequest& request,
    int64_t version, v1::PutWeightsRequest* release) {
  ATTNSERVE_RETURN_IF_ERROR(ValidateWeightsName("name", request.name()));
  if (!request.has_weights()) {
    return absl::InvalidArgumentError(
        "weights is missing, expected ProjectionWeights");
  }
  ATTNSERVE_ASSIGN_OR_RETURN(
      const WeightsShape shape,
      ValidateProjectionWeights(request.weights(), "weights"));
  ATTNSERVE_RETURN_IF_ERROR(registry.CheckCapacity(
      request.name(), WeightSet::BytesFor(shape, request.weights())));
  ATTNSERVE_ASSIGN_OR_RETURN(
      const WeightsRegistry::Entry entry,
      registry.Put(request.name(),
                   release != nullptr
                       ? WeightSet::FromProto(release->mutable_weights(), shape)
                       : WeightSet::FromProto(request.weights(), shape),
                   version));
  v1::PutWeightsResponse response;
  response.set_version(entry.version);
  response.set_bytes(entry.weights->bytes());
  return response;
}

}  // namespace

absl::StatusOr<v1::PutWeightsResponse> PutWeightsInto(
    WeightsRegistry& registry, const v1::PutWeightsRequest& request,
    int64_t version) {
  return PutWeights(registry, request, version, nullptr);
}

absl::StatusOr<v1::PutWeightsResponse> PutWeightsInto(
    WeightsRegistry& registry, v1::PutWeightsRequest* request,
    int64_t version) {
  return PutWeights(registry, *request, version, request);
}

}  // namespace attnserve
