#include "attnserve/server/attention/attention_compute.h"

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

// Attend over packed sequences: output [total_q, H, Dv], lse [H, total_q].
absl::Status ComputePacked(AttentionEngine& engine, const AttendWork& work,
                           const v1::AttendRequest& request,
                           const StopCheck& stop,
                           v1::AttendResponse* response) {
  std::vector<float> query_copy, key_copy, value_copy, mask_copy;
  const AttentionShape& s = work.shape;
  const int64_t output_shape[] = {s.query_len, s.heads, s.value_dim};
  AttentionResponseTensors tensors(work.plan, s, output_shape,
                                   response->mutable_output(), nullptr,
                                   LseTensor(work.plan, response));
  AttentionOptions options =
      BindOptions(work.plan, request.options(), &mask_copy);
  options.stop = stop;
  PackedShape packed;
  packed.heads = s.heads;
  packed.kv_heads = s.kv_heads;
  packed.key_dim = s.key_dim;
  packed.value_dim = s.value_dim;
  packed.cu_seqlens_q = request.options().cu_seqlens_q();
  packed.cu_seqlens_k = request.options().cu_seqlens_k();
  if (work.inputs_in_place) {
    ATTNSERVE_RETURN_IF_ERROR(engine.AttendPackedHalf(
        packed, options, ToDataType(request.query().dtype()),
        absl::MakeConstSpan(request.query().data()),
        absl::MakeConstSpan(request.key().data()),
        absl::MakeConstSpan(request.value().data()), tensors.outputs()));
  } else {
    ATTNSERVE_RETURN_IF_ERROR(engine.AttendPacked(
        packed, options, FloatElements(request.query(), &query_copy),
        FloatElements(request.key(), &key_copy),
        FloatElements(request.value(), &value_copy), tensors.outputs()));
  }
  tensors.Finish();
  if (response->has_lse()) {  // [1, H, total_q] as written: [H, total_q].
    response->mutable_lse()->mutable_shape()->Clear();
    response->mutable_lse()->add_shape(s.heads);
    response->mutable_lse()->add_shape(s.query_len);
  }
  return absl::OkStatus();
}

}  // namespace

bool AttendReadsKeysInPlace(const AttentionEngine& engine,
                            const AttendWork& work,
                            const v1::AttendRequest& request) {
  const v1::DType dtype = request.key().dtype();
  return !work.packed && (dtype == v1::BFLOAT16 || dtype == v1::FLOAT16) &&
         request.value().dtype() == dtype && !work.plan.mask_dims &&
         engine.DecodeReadsInPlace(work.shape, RoutedOptions(work.plan));
}

absl::Status ComputeAttend(AttentionEngine& engine, const AttendWork& work,
                           const v1::AttendRequest& request,
                           const StopCheck& stop,
                           v1::AttendResponse* response) {
  std::vector<float> query_copy, key_copy, value_copy, mask_copy;
  const AttentionShape& s = work.shape;
  if (work.packed) return ComputePacked(engine, work, request, stop, response);
  const int64_t output_shape[] = {s.batch, s.heads, s.query_len, s.value_dim};
  AttentionResponseTensors tensors(
      work.plan, s, output_shape, response->mutable_output(),
      WeightsTensor(work.plan, response), LseTensor(work.plan, response));
  AttentionOptions options =
      BindOptions(work.plan, request.options(), &mask_copy);
  options.stop = stop;
  if (work.inputs_in_place) {
    ATTNSERVE_RETURN_IF_ERROR(engine.AttendHalf(
        s, options, ToDataType(request.query().dtype()),
        absl::MakeConstSpan(request.query().data()),
        absl::MakeConstSpan(request.key().data()),
        absl::MakeConstSpan(request.value().data()), tensors.outputs()));
    tensors.Finish();
    return absl::OkStatus();
  }
  if (AttendReadsKeysInPlace(engine, work, request)) {
    ATTNSERVE_RETURN_IF_ERROR(engine.AttendDecode(
        s, options, FloatElements(request.query(), &query_copy),
        ToDataType(request.key().dtype()),
        absl::MakeConstSpan(request.key().data()),
        absl::MakeConstSpan(request.value().data()), tensors.outputs()));
    tensors.Finish();
    return absl::OkStatus();
  }
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
