#include "attend_batch.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/common/status_macros.h"
#include "tensor_codec.h"

namespace attnserve {
namespace {

// Appends the f32 elements of a validated float tensor.
void AppendFloats(const v1::Tensor& tensor, std::vector<float>* out) {
  std::vector<float> storage;
  const absl::Span<const float> values = FloatElements(tensor, &storage);
  out->insert(out->end(), values.begin(), values.end());
}

// Copies `count` values from `source` at `offset` into `destination`.
void CopySlice(const std::vector<float>& source, size_t offset,
               absl::Span<float> destination) {
  std::copy(
      source.begin() + static_cast<ptrdiff_t>(offset),
      source.begin() + static_cast<ptrdiff_t>(offset + destination.size()),
      destination.begin());
}

}  // namespace

std::string AttendBatchKey(const v1::AttendRequest& request,
                           const AttendWork& work) {
  const v1::AttentionOptions& options = request.options();
  if (options.key_lengths_size() > 0) return "";
  if (work.plan.mask_dims && (*work.plan.mask_dims)[0] != 1) return "";
  const AttentionShape& s = work.shape;
  return absl::StrCat("attend:", request.query().dtype(), ",",
                      request.key().dtype(), ",", request.value().dtype(), ":",
                      s.heads, ",", s.kv_heads, ",", s.query_len, ",",
                      s.key_len, ",", s.key_dim, ",", s.value_dim, ":",
                      options.SerializeAsString());
}

absl::Status ComputeAttendBatch(AttentionEngine& engine,
                                absl::Span<const AttendBatchItem> items) {
  const AttendWork& first = *items.front().work;
  AttentionShape shape = first.shape;
  shape.batch = 0;
  for (const AttendBatchItem& item : items)
    shape.batch += item.work->shape.batch;
  std::vector<float> query, key, value, mask_copy;
  query.reserve(static_cast<size_t>(shape.QueryElements()));
  key.reserve(static_cast<size_t>(shape.KeyElements()));
  value.reserve(static_cast<size_t>(shape.ValueElements()));
  for (const AttendBatchItem& item : items) {
    AppendFloats(item.request->query(), &query);
    AppendFloats(item.request->key(), &key);
    AppendFloats(item.request->value(), &value);
  }
  const AttentionOptions options =
      BindOptions(first.plan, items.front().request->options(), &mask_copy);
  const int64_t weights_elements =
      options.weights == AttentionWeightsMode::kPerHead
          ? shape.WeightsElements()
      : options.weights == AttentionWeightsMode::kHeadMean
          ? shape.HeadMeanWeightsElements()
          : 0;
  std::vector<float> output(static_cast<size_t>(shape.OutputElements()));
  std::vector<float> weights(static_cast<size_t>(weights_elements));
  std::vector<float> lse(
      options.return_lse ? static_cast<size_t>(shape.LseElements()) : 0);
  ATTNSERVE_RETURN_IF_ERROR(engine.Attend(
      shape, options, query, key, value,
      AttentionOutputs(absl::MakeSpan(output), absl::MakeSpan(weights),
                       absl::MakeSpan(lse))));

  size_t output_at = 0, weights_at = 0, lse_at = 0;
  for (const AttendBatchItem& item : items) {
    const AttentionShape& s = item.work->shape;
    const int64_t output_shape[] = {s.batch, s.heads, s.query_len, s.value_dim};
    v1::AttendResponse* response = item.response;
    AttentionResponseTensors tensors(
        item.work->plan, s, output_shape, response->mutable_output(),
        options.weights != AttentionWeightsMode::kNone
            ? response->mutable_weights()
            : nullptr,
        options.return_lse ? response->mutable_lse() : nullptr);
    const AttentionOutputs slices = tensors.outputs();
    CopySlice(output, output_at, slices.output);
    CopySlice(weights, weights_at, slices.weights);
    CopySlice(lse, lse_at, slices.lse);
    output_at += slices.output.size();
    weights_at += slices.weights.size();
    lse_at += slices.lse.size();
    tensors.Finish();
  }
  return absl::OkStatus();
}

}  // namespace attnserve
