// An attention call's tensors on their way between a validated request and
// its response: the options bound to the request's mask and key lengths, and
// the response tensors the engine writes.
#ifndef ATTNSERVE_SERVER_ATTENTION_RESPONSE_TENSORS_H_
#define ATTNSERVE_SERVER_ATTENTION_RESPONSE_TENSORS_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/types/span.h"
#include "attnserve/core/attention_types.h"
#include "attnserve/server/attention/request_validator.h"
#include "attnserve/server/tensors/tensor_codec.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// Returns the options of `plan` with the mask and key lengths pointed at the
// request's `proto` (a BOOL mask and the key lengths without a copy; a float
// mask through `mask_storage`).
AttentionOptions BindOptions(const OptionsPlan& plan,
                             const v1::AttentionOptions& proto,
                             std::vector<float>* mask_storage);

// The response tensors of an attention call: output, and weights and lse as
// `plan` asks.
class AttentionResponseTensors {
 public:
  // `heads` is the SDPA shape (for the weights and lse), `output_shape` the
  // output's. The tensors must outlive this object; `weights` and `lse` may be
  // null when not asked for.
  AttentionResponseTensors(const OptionsPlan& plan, const AttentionShape& heads,
                           absl::Span<const int64_t> output_shape,
                           v1::Tensor* output, v1::Tensor* weights,
                           v1::Tensor* lse);

  AttentionOutputs outputs();
  void Finish();

 private:
  OutputTensor output_;
  std::optional<OutputTensor> weights_;
  std::optional<OutputTensor> lse_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_RESPONSE_TENSORS_H_
