#include "attnserve/server/attention/response_tensors.h"

#include <utility>

namespace attnserve {

AttentionOptions BindOptions(const OptionsPlan& plan,
                             const v1::AttentionOptions& proto,
                             std::vector<float>* mask_storage) {
  AttentionOptions options = RoutedOptions(plan);
  options.key_lengths =
      absl::MakeConstSpan(proto.key_lengths().data(), proto.key_lengths_size());
  options.query_positions = absl::MakeConstSpan(proto.query_positions().data(),
                                                proto.query_positions_size());
  options.key_positions = absl::MakeConstSpan(proto.key_positions().data(),
                                              proto.key_positions_size());
  if (plan.mask_dims) {
    AttentionMask mask;
    mask.dims = *plan.mask_dims;
    if (proto.attn_mask().dtype() == v1::BOOL) {
      mask.allowed =
          reinterpret_cast<const uint8_t*>(proto.attn_mask().data().data());
    } else {
      mask.bias = FloatElements(proto.attn_mask(), mask_storage).data();
    }
    options.mask = mask;
  }
  return options;
}

AttentionResponseTensors::AttentionResponseTensors(
    const OptionsPlan& plan, const AttentionShape& heads,
    absl::Span<const int64_t> output_shape, v1::Tensor* output,
    v1::Tensor* weights, v1::Tensor* lse)
    : output_(plan.output_dtype, output_shape, output) {
  const AttentionShape& s = heads;
  if (plan.options.weights == AttentionWeightsMode::kPerHead) {
    const int64_t shape[] = {s.batch, s.heads, s.query_len, s.key_len};
    weights_.emplace(plan.output_dtype, shape, weights);
  } else if (plan.options.weights == AttentionWeightsMode::kHeadMean) {
    const int64_t shape[] = {s.batch, s.query_len, s.key_len};
    weights_.emplace(plan.output_dtype, shape, weights);
  }
  if (plan.options.return_lse) {
    const int64_t shape[] = {s.batch, s.heads, s.query_len};
    lse_.emplace(v1::FLOAT32, shape, lse);
  }
}

AttentionOutputs AttentionResponseTensors::outputs() {
  return AttentionOutputs(output_.values(),
                          weights_ ? weights_->values() : absl::Span<float>(),
                          lse_ ? lse_->values() : absl::Span<float>());
}

void AttentionResponseTensors::Finish() {
  output_.Finish();
  if (weights_) weights_->Finish();
  if (lse_) lse_->Finish();
}

}  // namespace attnserve
