#include "attnserve/server/attention/attention_compute.h"

#include <cmath>
#include <vector>

#include "attnserve/common/dtype.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/server/attention/response_tensors.h"
#include "attnserve/server/tensors/tensor_codec.h"

namespace attnserve {
namespace {

// The response's weights and lse tensors, created only when the options ask for
// them.
template <typename Response>
v1::Tensor* WeightsTensor(const OptionsPlan& plan, Response* response) {
  return plan.options.weights == AttentionWeightsMode::kNone
             ? nullptr
             : response->mutable_weights();
}

template <typename Response>
v1::Tensor* LseTensor(const OptionsPlan& plan, Response* response) {
  return plan.options.return_lse ? response->mutable_lse() : nullptr;
}

// Computes a request AttendReadsKeysInPlace takes through the paged kernel,
// each batch entry's key and value tensors read as one page in their dtype
// where they lie in the request: no widened f32 copy of them (which for a
// decode call costs more than its attention). The query is widened (one row per
// head).
absl::Status AttendInPlace(AttentionEngine& engine, const AttendWork& work,
                           const v1::AttendRequest& request,
                           const StopCheck& stop, AttentionOutputs outputs) {
  const AttentionShape& s = work.shape;
  std::vector<float> query_copy;
  const absl::Span<const float> query =
      FloatElements(request.query(), &query_copy);
  PageLayout layout;
  layout.page_tokens = s.key_len;
  layout.kv_heads = s.kv_heads;
  layout.key_dim = s.key_dim;
  layout.value_dim = s.value_dim;
  layout.dtype = ToDataType(request.key().dtype());
  const float scale = work.plan.options.scale.value_or(
      1.0f / std::sqrt(static_cast<float>(s.key_dim)));
  const auto& key_lengths = request.options().key_lengths();
  const size_t batch = static_cast<size_t>(s.batch);
  std::vector<const char*> key_pages(batch), value_pages(batch);
  std::vector<PagedAttend> items(batch);
  for (size_t b = 0; b < batch; ++b) {
    key_pages[b] = request.key().data().data() + b * layout.KeyBytes();
    value_pages[b] = request.value().data().data() + b * layout.ValueBytes();
    PagedAttend& item = items[b];
    item.layout = layout;
    item.pages = absl::MakeConstSpan(&key_pages[b], 1);
    item.value_pages = absl::MakeConstSpan(&value_pages[b], 1);
    item.length =
        key_lengths.empty() ? s.key_len : key_lengths[static_cast<int>(b)];
    item.heads = s.heads;
    item.query_len = 1;
    item.query = query.subspan(b * s.heads * s.key_dim, s.heads * s.key_dim);
    item.scale = scale;
    item.precision = work.plan.options.precision;
    item.output = outputs.output.subspan(b * s.heads * s.value_dim,
                                         s.heads * s.value_dim);
    if (!outputs.lse.empty())
      item.lse = outputs.lse.subspan(b * s.heads, s.heads);
  }
  return engine.AttendPaged(items, stop);
}

}  // namespace

bool AttendReadsKeysInPlace(const AttendWork& work,
                            const v1::AttendRequest& request) {
  const AttentionOptions& options = work.plan.options;
  const v1::DType dtype = request.key().dtype();
  return work.shape.query_len == 1 &&
         (dtype == v1::BFLOAT16 || dtype == v1::FLOAT16) &&
         request.value().dtype() == dtype && !work.plan.mask_dims &&
         options.weights == AttentionWeightsMode::kNone &&
         (!options.causal ||
          options.causal_alignment == CausalAlignment::kBottomRight);
}

absl::Status ComputeAttend(AttentionEngine& engine, const AttendWork& work,
                           const v1::AttendRequest& request,
                           const StopCheck& stop,
                           v1::AttendResponse* response) {
  std::vector<float> query_copy, key_copy, value_copy, mask_copy;
  const AttentionShape& s = work.shape;
  const int64_t output_shape[] = {s.batch, s.heads, s.query_len, s.value_dim};
  AttentionResponseTensors tensors(
      work.plan, s, output_shape, response->mutable_output(),
      WeightsTensor(work.plan, response), LseTensor(work.plan, response));
  if (AttendReadsKeysInPlace(work, request)) {
    ATTNSERVE_RETURN_IF_ERROR(
        AttendInPlace(engine, work, request, stop, tensors.outputs()));
    tensors.Finish();
    return absl::OkStatus();
  }
  AttentionOptions options =
      BindOptions(work.plan, request.options(), &mask_copy);
  options.stop = stop;
  ATTNSERVE_RETURN_IF_ERROR(engine.Attend(
      s, options, FloatElements(request.query(), &query_copy),
      FloatElements(request.key(), &key_copy),
      FloatElements(request.value(), &value_copy), tensors.outputs()));
  tensors.Finish();
  return absl::OkStatus();
}

absl::Status ComputeMultiHead(AttentionEngine& engine,
                              const MultiHeadWork& work,
                              const ProjectionWeights& weights,
                              const v1::MultiHeadAttentionRequest& request,
                              const StopCheck& stop,
                              v1::MultiHeadAttentionResponse* response) {
  std::vector<float> query_copy, kv_copy, mask_copy;
  const MultiHeadShape& s = work.shape;
  const int64_t output_shape[] = {s.batch, s.query_len, s.embed_dim};
  AttentionResponseTensors tensors(
      work.plan, s.Heads(), output_shape, response->mutable_output(),
      WeightsTensor(work.plan, response), LseTensor(work.plan, response));
  AttentionOptions options =
      BindOptions(work.plan, request.options(), &mask_copy);
  options.stop = stop;
  ATTNSERVE_RETURN_IF_ERROR(engine.MultiHeadAttention(
      s, weights, options, FloatElements(request.query_input(), &query_copy),
      work.self_attention ? absl::Span<const float>()
                          : FloatElements(request.kv_input(), &kv_copy),
      tensors.outputs()));
  tensors.Finish();
  return absl::OkStatus();
}

}  // namespace attnserve
