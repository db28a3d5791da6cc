// The Open Inference Protocol's side of attnserve (KServe "v2",
// inference.GRPCInferenceService): its models and their translation to and
// from the native requests, so that ModelInfer runs the native path's
// validation, limits and compute.
//
// Models:
//   sdpa          inputs QUERY, KEY, VALUE (FP32, FP16, BF16; [B, H, L, D] as
//                 attnserve.v1's Attend), optional ATTN_MASK (BOOL or float)
//                 and KEY_LENGTHS (INT64 [B]); outputs OUTPUT, and LSE and
//                 WEIGHTS when asked; version "1".
//   <weight set>  every registered weight set: INPUT [B, Lq, E], optional
//                 KV_INPUT [B, Lk, Ekv], output OUTPUT [B, Lq, E] (and LSE,
//                 WEIGHTS); its version is the set's.
// Options travel as request parameters: causal (bool), causal_alignment
// ("top_left", "bottom_right"), scale (double or int64), window_left,
// window_right and num_sink_tokens (int64), softcap (double or int64),
// return_lse (bool),
// return_weights ("none", "per_head", "head_mean"), precision ("f32",
// "bf16"), output_dtype ("FP32", "FP16", "BF16"). Triton's own request
// parameters (priority, timeout, sequence_*) are ignored; any other is
// INVALID_ARGUMENT naming it, as is any parameter of an input or an output
// but an output's binary_data (HTTP's).
#ifndef ATTNSERVE_SERVER_OIP_INFERENCE_MODELS_H_
#define ATTNSERVE_SERVER_OIP_INFERENCE_MODELS_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnserve/server/weights/weights_validator.h"
#include "attnserve/v1/attention.pb.h"
#include "inference/grpc_service.pb.h"

namespace attnserve::oip {

inline constexpr char kSdpaModel[] = "sdpa";
// The longest request id a ModelInfer may carry: the answer echoes it, within
// the framing the response size check allows (request_validator.cc).
inline constexpr size_t kMaxInferIdBytes = 512;
inline constexpr char kSdpaVersion[] = "1";
inline constexpr char kPlatform[] = "attnserve";

// The outputs a ModelInfer returns, in this order.
struct RequestedOutputs {
  bool output = true;
  bool lse = false;
  bool weights = false;
};

// The bytes the translation packs typed contents into, beside the parsed
// values (raw_input_contents move, and cost nothing more).
int64_t TypedContentsBytes(const inference::ModelInferRequest& request);

// An sdpa request as the native Attend request. The tensors' bytes are moved
// out of `request` (raw_input_contents, or packed from typed contents).
// INVALID_ARGUMENT naming the input or parameter at fault; the shapes and
// sizes are the native validator's to check.
absl::StatusOr<v1::AttendRequest> AttendRequestFrom(
    inference::ModelInferRequest& request, RequestedOutputs* outputs);

// A weight set's request as the native MultiHeadAttention request for
// `weights_name` (the model), at the version the request names, if any.
absl::StatusOr<v1::MultiHeadAttentionRequest> MultiHeadRequestFrom(
    inference::ModelInferRequest& request, RequestedOutputs* outputs);

// Moves the native answer's tensors into `response` (raw_output_contents), for
// the outputs asked.
void FillInferResponse(const inference::ModelInferRequest& request,
                       const std::string& version,
                       const RequestedOutputs& outputs, v1::Tensor* output,
                       v1::Tensor* lse, v1::Tensor* weights,
                       inference::ModelInferResponse* response);

// `status` with the native request's field names replaced by the model's
// input and parameter names ("query.shape[3]" → "QUERY.shape[3]").
absl::Status InProtocolNames(const absl::Status& status, bool weight_set);

// ModelMetadata and ModelConfig of sdpa, and of a weight set.
inference::ModelMetadataResponse SdpaMetadata();
inference::ModelMetadataResponse WeightSetMetadata(const std::string& name,
                                                   int64_t version,
                                                   const WeightsShape& shape);
inference::ModelConfig SdpaConfig();
inference::ModelConfig WeightSetConfig(const std::string& name,
                                       const WeightsShape& shape);

// Per model and version, what Triton's ModelStatistics reports: calls that
// succeeded and failed with their durations, and the queue and compute times
// of those that computed. Holds at most kMaxModels (model, version) pairs:
// past that, the pair recorded least recently goes (a set re-put many times
// leaves its old versions behind, and the current one must still count).
class InferenceStatistics {
 public:
  static constexpr size_t kMaxModels = 4096;

  void Record(const std::string& model, const std::string& version,
              bool succeeded, absl::Duration total, int64_t queue_us,
              int64_t compute_us, absl::Time when) ABSL_LOCKS_EXCLUDED(mutex_);

  // The statistics of `model` at `version` (zeros if none was recorded).
  inference::ModelStatistics Of(const std::string& model,
                                const std::string& version) const
      ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  struct Entry {
    inference::ModelStatistics stats;
    uint64_t recorded = 0;  // recorded_ when last recorded
  };

  mutable absl::Mutex mutex_;
  std::map<std::pair<std::string, std::string>, Entry> models_
      ABSL_GUARDED_BY(mutex_);
  uint64_t recorded_ ABSL_GUARDED_BY(mutex_) = 0;  // Records so far.
};

}  // namespace attnserve::oip

#endif  // ATTNSERVE_SERVER_OIP_INFERENCE_MODELS_H_
