#include "attnserve/client/sharded_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/common/checked_math.h"
#include "attnserve/proto/tensors.h"
#include "shard_merge.h"

namespace attnserve {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

// The product of dimensions [from, to) and `factor`; nullopt for a negative
// dimension or past 2^63.
std::optional<int64_t> Product(const v1::Tensor& tensor, int from, int to,
                               int64_t factor = 1) {
  std::vector<int64_t> factors(tensor.shape().begin() + from,
                               tensor.shape().begin() + to);
  factors.push_back(factor);
  for (const int64_t f : factors) {
    if (f < 0) return std::nullopt;
  }
  return CheckedProduct(factors);
}

// The user's mask broadcast to [B, H, Lq, Lk]: its additive value at (b, h, i,
// j).
class MaskReader {
 public:
  MaskReader(const v1::Tensor& mask) : mask_(mask) {
    const int rank = mask.shape_size();
    for (int d = 0; d < 4; ++d)
      dims_[d] = d < 4 - rank ? 1 : mask.shape(d - (4 - rank));
    values_ = FloatValues(mask).value_or(std::vector<float>());
  }

  double At(int64_t b, int64_t h, int64_t i, int64_t j) const {
    const int64_t at[4] = {b, h, i, j};
    int64_t index = 0;
    for (int d = 0; d < 4; ++d)
      index = index * dims_[d] + (dims_[d] == 1 ? 0 : at[d]);
    if (mask_.dtype() == v1::BOOL)
      return mask_.data()[index] != 0 ? 0.0 : -kInfinity;
    return values_[index];
  }

 private:
  const v1::Tensor& mask_;
  int64_t dims_[4];
  std::vector<float> values_;
};

struct Dims {
  int64_t batch, heads, query_len, key_len, value_dim;
};

absl::Status Validate(const v1::AttendRequest& request, int shards,
                      size_t clients, int64_t max_message_bytes) {
  for (const v1::Tensor* tensor :
       {&request.query(), &request.key(), &request.value()}) {
    if (tensor->shape_size() != 4 || DTypeBytes(tensor->dtype()) == 1 ||
        Product(*tensor, 0, 4, DTypeBytes(tensor->dtype())) !=
            static_cast<int64_t>(tensor->data().size())) {
      return absl::InvalidArgumentError(
          "query, key and value must be float tensors of rank 4 whose bytes "
          "match their shapes");
    }
  }
  // Key and value are cut along Lk together: they must agree up to it (a
  // shorter value was read past its end, a longer one cut silently).
  for (int d = 0; d < 3; ++d) {
    if (request.value().shape(d) != request.key().shape(d)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "value.shape[", d, "] is ", request.value().shape(d), ", expected ",
          request.key().shape(d), " (key.shape[", d, "])"));
    }
  }
  if (absl::Status dtype =
          internal::CheckOutputDtype(request.options().output_dtype());
      !dtype.ok()) {
    return dtype;
  }
  if (clients == 0)
    return absl::InvalidArgumentError(
        "clients is empty, expected at least one");
  // The mask and key_lengths are read here, to cut them per shard: checked
  // first, as the server would check them.
  const v1::AttentionOptions& options = request.options();
  const int64_t full[4] = {request.query().shape(0), request.query().shape(1),
                           request.query().shape(2), request.key().shape(2)};
  if (options.has_attn_mask()) {
    const v1::Tensor& mask = options.attn_mask();
    const int rank = mask.shape_size();
    bool valid = rank >= 1 && rank <= 4 &&
                 (mask.dtype() == v1::BOOL || mask.dtype() == v1::FLOAT32 ||
                  mask.dtype() == v1::BFLOAT16 || mask.dtype() == v1::FLOAT16);
    for (int d = 0; valid && d < rank; ++d) {
      const int64_t dim = mask.shape(d);
      valid = dim == 1 || dim == full[4 - rank + d];
    }
    if (!valid || Product(mask, 0, rank, DTypeBytes(mask.dtype())) !=
                      static_cast<int64_t>(mask.data().size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "options.attn_mask must be BOOL or a float dtype, of rank 1 to 4, "
          "each dimension 1 or [B, H, Lq, Lk] = [",
          full[0], ", ", full[1], ", ", full[2], ", ", full[3],
          "] (aligned right), its bytes matching its shape"));
    }
  }
  if (options.key_lengths_size() != 0 &&
      options.key_lengths_size() != full[0]) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.key_lengths holds ", options.key_lengths_size(),
                     " lengths, expected none or B = ", full[0]));
  }
  // Cut per shard, a length past Lk or below 0 would be clipped to one the
  // server takes (a negative one: every row 0), where one call refuses it.
  for (int b = 0; b < options.key_lengths_size(); ++b) {
    if (options.key_lengths(b) < 0 || options.key_lengths(b) > full[3]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "options.key_lengths[", b, "] is ", options.key_lengths(b),
          ", expected 0 to ", full[3], " (Lk)"));
    }
  }
  if (shards < 1 || shards > request.key().shape(2)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shards is ", shards, ", expected 1 to ",
                     request.key().shape(2), " (Lk)"));
  }
  // What the widest shard's request holds, the mask built for causality
  // included ([B, H, Lq, width] floats with a mask of the caller's, [B or
  // 1, 1, Lq, width] bools without), against what a client sends: checked
  // before any of it is built.
  const int64_t width = (full[3] + shards - 1) / shards;
  const int64_t mask_batches =
      options.causal_alignment() == v1::AttentionOptions::BOTTOM_RIGHT &&
              options.key_lengths_size() > 0
          ? full[0]
          : 1;
  // Without causality a mask over every key is cut to the shard's keys.
  const v1::Tensor& mask = options.attn_mask();
  const bool mask_cut = mask.shape_size() > 0 &&
                        mask.shape(mask.shape_size() - 1) == full[3] &&
                        full[3] > 1;
  const std::optional<int64_t> mask_bytes =
      !options.causal()
          ? std::optional<int64_t>(
                mask_cut
                    ? static_cast<int64_t>(mask.data().size()) / full[3] * width
                    : static_cast<int64_t>(mask.data().size()))
      : options.has_attn_mask()
          ? CheckedProduct({full[0], full[1], full[2], width, 4})
          : CheckedProduct({mask_batches, full[2], width});
  const std::optional<int64_t> shard_bytes = CheckedSum(
      {static_cast<int64_t>(request.query().data().size()),
       CheckedProduct({static_cast<int64_t>(request.key().data().size()) /
                           std::max<int64_t>(full[3], 1),
                       width}),
       CheckedProduct({static_cast<int64_t>(request.value().data().size()) /
                           std::max<int64_t>(full[3], 1),
                       width}),
       mask_bytes});
  if (!shard_bytes || *shard_bytes > max_message_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a shard's request would hold ",
                     shard_bytes ? absl::StrCat(*shard_bytes, " bytes")
                                 : std::string("more than 2^63 bytes"),
                     ", over the client's max_message_bytes of ",
                     max_message_bytes, "; use more shards",
                     options.causal() ? " (causality is sent as a mask)" : ""));
  }
  if (request.options().return_weights() != v1::AttentionOptions::NONE) {
    return absl::InvalidArgumentError(
        "options.return_weights must be NONE for sharded attention: each shard "
        "sees only its "
        "keys");
  }
  // A shard's key indices start at 0, so what depends on a key's global
  // position (softcap does not) would be drawn in the wrong place.
  const v1::AttentionOptions& o = request.options();
  if ((o.has_window_left() && o.window_left() != -1) ||
      (o.has_window_right() && o.window_right() != -1) ||
      o.num_sink_tokens() != 0 || o.has_alibi_slopes()) {
    return absl::InvalidArgumentError(
        "options.window_left, window_right, num_sink_tokens and alibi_slopes "
        "must be unset for sharded attention: they depend on each key's "
        "position in the whole sequence, which a shard does not see");
  }
  return absl::OkStatus();
}

// The request for keys [begin, end).
v1::AttendRequest ShardRequest(const v1::AttendRequest& request, const Dims& d,
                               int64_t begin, int64_t end) {
  const v1::AttentionOptions& options = request.options();
  v1::AttendRequest shard;
  *shard.mutable_query() = request.query();
  *shard.mutable_key() = internal::Slice(request.key(), 2, begin, end);
  *shard.mutable_value() = internal::Slice(request.value(), 2, begin, end);
  v1::AttentionOptions& o = *shard.mutable_options();
  o = options;
  o.set_return_lse(true);
  o.set_output_dtype(v1::FLOAT32);
  o.clear_key_lengths();
  for (int64_t length : options.key_lengths()) {
    o.add_key_lengths(std::clamp<int64_t>(length - begin, 0, end - begin));
  }
  const int64_t width = end - begin;
  if (options.causal()) {
    // Causality by global key position, as a mask over this shard's keys.
    o.set_causal(false);
    const bool bottom_right =
        options.causal_alignment() == v1::AttentionOptions::BOTTOM_RIGHT;
    const auto visible = [&](int64_t b, int64_t i, int64_t j) {
      const int64_t length =
          options.key_lengths_size() > 0 ? options.key_lengths(b) : d.key_len;
      return bottom_right ? j <= i + length - d.query_len : j <= i;
    };
    if (!options.has_attn_mask()) {
      const int64_t batches =
          bottom_right && options.key_lengths_size() > 0 ? d.batch : 1;
      std::vector<bool> allowed;
      for (int64_t b = 0; b < batches; ++b)
        for (int64_t i = 0; i < d.query_len; ++i)
          for (int64_t j = begin; j < end; ++j)
            allowed.push_back(visible(b, i, j));
      *o.mutable_attn_mask() =
          MakeBoolTensor({batches, 1, d.query_len, width}, allowed);
    } else {
      const MaskReader mask(options.attn_mask());
      std::vector<float> values;
      values.reserve(
          static_cast<size_t>(d.batch * d.heads * d.query_len * width));
      for (int64_t b = 0; b < d.batch; ++b)
        for (int64_t h = 0; h < d.heads; ++h)
          for (int64_t i = 0; i < d.query_len; ++i)
            for (int64_t j = begin; j < end; ++j)
              values.push_back(visible(b, i, j)
                                   ? static_cast<float>(mask.At(b, h, i, j))
                                   : -std::numeric_limits<float>::infinity());
      *o.mutable_attn_mask() =
          MakeFloat32Tensor({d.batch, d.heads, d.query_len, width}, values);
    }
  } else if (options.has_attn_mask()) {
    const v1::Tensor& mask = options.attn_mask();
    const int last = mask.shape_size() - 1;
    if (last >= 0 && mask.shape(last) == d.key_len && d.key_len > 1) {
      *o.mutable_attn_mask() = internal::Slice(mask, last, begin, end);
    }
  }
  return shard;
}

}  // namespace

absl::StatusOr<v1::AttendResponse> ShardedAttend(
    absl::Span<Client* const> clients, const v1::AttendRequest& request,
    int shards, absl::Duration timeout) {
  const absl::Status valid =
      Validate(request, shards, clients.size(),
               clients.empty() ? 0 : clients[0]->options().max_message_bytes);
  if (!valid.ok()) return valid;
  const Dims d{request.query().shape(0), request.query().shape(1),
               request.query().shape(2), request.key().shape(2),
               request.value().shape(3)};
  std::vector<std::future<absl::StatusOr<v1::AttendResponse>>> pending;
  for (int s = 0; s < shards; ++s) {
    const int64_t begin = d.key_len * s / shards;
    const int64_t end = d.key_len * (s + 1) / shards;
    pending.push_back(clients[s % clients.size()]->AttendFuture(
        ShardRequest(request, d, begin, end), timeout));
  }
  std::vector<v1::AttendResponse> parts;
  absl::Status first_error;
  for (auto& future : pending) {
    absl::StatusOr<v1::AttendResponse> part = future.get();
    if (!part.ok() && first_error.ok()) first_error = part.status();
    if (part.ok()) parts.push_back(*std::move(part));
  }
  if (!first_error.ok()) return first_error;

  const int64_t rows = d.batch * d.heads * d.query_len;
  std::vector<std::vector<float>> outputs, lses;
  v1::ServerTiming timing;
  for (const v1::AttendResponse& part : parts) {
    outputs.push_back(
        FloatValues(part.output()).value_or(std::vector<float>()));
    lses.push_back(FloatValues(part.lse()).value_or(std::vector<float>()));
    if (static_cast<int64_t>(outputs.back().size()) != rows * d.value_dim ||
        static_cast<int64_t>(lses.back().size()) != rows) {
      return absl::InternalError(
          "a shard's output or lse does not have the expected size");
    }
    timing.set_queue_us(std::max(timing.queue_us(), part.timing().queue_us()));
    timing.set_compute_us(
        std::max(timing.compute_us(), part.timing().compute_us()));
  }
  std::vector<float> output, lse;
  internal::MergeByLse(outputs, lses, rows, d.value_dim, &output, &lse);

  const v1::DType dtype =
      request.options().output_dtype() == v1::DTYPE_UNSPECIFIED
          ? request.query().dtype()
          : request.options().output_dtype();
  v1::AttendResponse response;
  *response.mutable_output() =
      MakeTensor(dtype, {d.batch, d.heads, d.query_len, d.value_dim}, output);
  if (request.options().return_lse()) {
    *response.mutable_lse() =
        MakeFloat32Tensor({d.batch, d.heads, d.query_len}, lse);
  }
  *response.mutable_timing() = timing;
  return response;
}

}  // namespace attnserve
