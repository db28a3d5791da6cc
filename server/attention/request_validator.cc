#include "attnserve/server/attention/request_validator.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attnserve/common/checked_math.h"
#include "attnserve/common/refusals.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/core/attention_types.h"
#include "attnserve/server/tensors/tensor_checks.h"
#include "attnserve/server/tensors/tensor_codec.h"
#include "google/protobuf/descriptor.h"

namespace attnserve {
namespace {

using Options = v1::AttentionOptions;

constexpr v1::DType kMaskDTypes[] = {v1::BOOL, v1::FLOAT32, v1::BFLOAT16,
                                     v1::FLOAT16};

// A dimension that must equal a dimension of an earlier tensor of an
// AttendRequest.
struct DimensionMatch {
  const char* field;
  int dim;
  const char* dim_name;
  const char* reference;
  int reference_dim;
};

constexpr DimensionMatch kAttendDimensionMatches[] = {
    {"key", 0, "B", "query", 0},  {"key", 3, "Dk", "query", 3},
    {"value", 0, "B", "key", 0},  {"value", 1, "Hkv", "key", 1},
    {"value", 2, "Lk", "key", 2},
};

const v1::Tensor& AttendTensor(const v1::AttendRequest& request,
                               absl::string_view field) {
  if (field == "query") return request.query();
  return field == "key" ? request.key() : request.value();
}

// INVALID_ARGUMENT naming the enum's values unless `value` is one of them.
absl::Status CheckEnum(const char* field, int value,
                       const google::protobuf::EnumDescriptor* values) {
  if (values->FindValueByNumber(value) != nullptr) return absl::OkStatus();
  std::vector<std::string> names;
  for (int i = 0; i < values->value_count(); ++i) {
    names.push_back(absl::StrCat(values->value(i)->name(), " (",
                                 values->value(i)->number(), ")"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, " is ", value, ", expected ", absl::StrJoin(names, ", ")));
}

absl::Status ValidateMask(const v1::Tensor& mask, const AttentionShape& s,
                          std::array<int64_t, 4>* dims) {
  ATTNSERVE_RETURN_IF_ERROR(
      CheckTensorOfRank("options.attn_mask", mask, kMaskDTypes, 1, 4));
  const int64_t full[4] = {s.batch, s.heads, s.query_len, s.key_len};
  const char* names[4] = {"B", "H", "Lq", "Lk"};
  const int rank = mask.shape_size();
  for (int d = 0; d < 4; ++d) {
    const int mask_dim = d - (4 - rank);
    (*dims)[d] = mask_dim < 0 ? 1 : mask.shape(mask_dim);
    if ((*dims)[d] != 1 && (*dims)[d] != full[d]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "options.attn_mask.shape[", mask_dim, "] is ", (*dims)[d],
          ", expected 1 or ", full[d], " (", names[d],
          "): the mask must broadcast to [B, H, Lq, Lk] = [", full[0], ", ",
          full[1], ", ", full[2], ", ", full[3], "]"));
    }
  }
  return absl::OkStatus();
}

// The window, sinks, ALiBi slopes (decoded into plan->alibi_slopes) and
// softcap.
absl::Status ValidateVariants(const Options& proto, const AttentionShape& s,
                              OptionsPlan* plan) {
  AttentionOptions& options = plan->options;
  for (const auto& [field, has, value, target] :
       {std::tuple{"options.window_left", proto.has_window_left(),
                   proto.window_left(), &options.window_left},
        std::tuple{"options.window_right", proto.has_window_right(),
                   proto.window_right(), &options.window_right}}) {
    if (!has) continue;
    if (value < -1) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " is ", value, ", expected -1 or absent (unbounded) or >= 0"));
    }
    *target = value;
  }
  if (proto.num_sink_tokens() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.num_sink_tokens is ", proto.num_sink_tokens(),
                     ", expected >= 0"));
  }
  options.num_sink_tokens = proto.num_sink_tokens();
  if (proto.has_softcap()) {
    if (!IsValidSoftcap(proto.softcap())) {
      return SoftcapRefusal("options.softcap", proto.softcap());
    }
    options.softcap = proto.softcap();
  }
  if (proto.has_alibi_slopes()) {
    const v1::Tensor& slopes = proto.alibi_slopes();
    constexpr v1::DType kFloat32[] = {v1::FLOAT32};
    ATTNSERVE_RETURN_IF_ERROR(
        CheckTensorOfRank("options.alibi_slopes", slopes, kFloat32, 1, 1));
    ATTNSERVE_RETURN_IF_ERROR(CheckDimEquals("options.alibi_slopes.shape[0]",
                                             slopes.shape(0), s.heads,
                                             "one slope per query head, H"));
    plan->alibi_slopes.resize(static_cast<size_t>(s.heads));
    std::memcpy(plan->alibi_slopes.data(), slopes.data().data(),
                plan->alibi_slopes.size() * sizeof(float));
    for (size_t h = 0; h < plan->alibi_slopes.size(); ++h) {
      if (!std::isfinite(plan->alibi_slopes[h])) {
        return absl::InvalidArgumentError(
            absl::StrCat("options.alibi_slopes[", h, "] is ",
                         plan->alibi_slopes[h], ", expected a finite number"));
      }
    }
  }
  return absl::OkStatus();
}

// RoPE's positions on a MultiHeadAttention: none unless the weights carry
// RoPE (`rope`), else B * L entries each, in [0, kMaxRotaryPosition].
absl::Status ValidatePositions(const Options& proto, const MultiHeadShape& s,
                               bool rope) {
  if (!rope &&
      (proto.query_positions_size() > 0 || proto.key_positions_size() > 0)) {
    return absl::InvalidArgumentError(
        "options.query_positions and key_positions are given without RoPE "
        "(weights.rope), expected none");
  }
  for (const auto& [field, positions, length] :
       {std::tuple{"options.query_positions", &proto.query_positions(),
                   s.query_len},
        std::tuple{"options.key_positions", &proto.key_positions(),
                   s.key_len}}) {
    if (positions->empty()) continue;
    ATTNSERVE_RETURN_IF_ERROR(CheckDimEquals(
        absl::StrCat(field, " size"), positions->size(), s.batch * length,
        "B x L, one per token of each batch item, or none"));
    for (int i = 0; i < positions->size(); ++i) {
      if ((*positions)[i] < 0 || (*positions)[i] > kMaxRotaryPosition) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, "[", i, "] is ", (*positions)[i],
                         ", expected 0 to ", kMaxRotaryPosition));
      }
    }
  }
  return absl::OkStatus();
}

// cu_seqlens_q or cu_seqlens_k: `total` rows in all; sets `*longest` to the
// longest sequence's.
absl::Status CheckOffsets(const char* field,
                          const google::protobuf::RepeatedField<int64_t>& cu,
                          int64_t total, int64_t* longest) {
  *longest = 0;
  if (cu[0] != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, "[0] is ", cu[0], ", expected 0"));
  }
  for (int i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1] || cu[i] > total) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, "[", i, "] is ", cu[i], ", expected ", cu[i - 1], " to ",
          total, " (offsets never decrease and end at the tensor's rows)"));
    }
    *longest = std::max(*longest, cu[i] - cu[i - 1]);
  }
  if (cu[cu.size() - 1] != total) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, "[", cu.size() - 1, "] is ", cu[cu.size() - 1],
                     ", expected ", total, ", the tensor's rows"));
  }
  return absl::OkStatus();
}

absl::StatusOr<OptionsPlan> ValidateOptions(const Options& proto,
                                            const AttentionShape& s,
                                            v1::DType input_dtype) {
  OptionsPlan plan;
  AttentionOptions& options = plan.options;
  if (proto.has_scale()) {
    if (!std::isfinite(proto.scale())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "options.scale is ", proto.scale(), ", expected a finite number"));
    }
    options.scale = proto.scale();
  }
  ATTNSERVE_RETURN_IF_ERROR(CheckEnum("options.causal_alignment",
                                      proto.causal_alignment(),
                                      Options::CausalAlignment_descriptor()));
  ATTNSERVE_RETURN_IF_ERROR(CheckEnum("options.return_weights",
                                      proto.return_weights(),
                                      Options::ReturnWeights_descriptor()));
  ATTNSERVE_RETURN_IF_ERROR(CheckEnum("options.precision", proto.precision(),
                                      Options::Precision_descriptor()));
  options.causal = proto.causal();
  options.causal_alignment = proto.causal_alignment() == Options::BOTTOM_RIGHT
                                 ? CausalAlignment::kBottomRight
                                 : CausalAlignment::kTopLeft;
  options.weights = proto.return_weights() == Options::PER_HEAD
                        ? AttentionWeightsMode::kPerHead
                    : proto.return_weights() == Options::HEAD_MEAN
                        ? AttentionWeightsMode::kHeadMean
                        : AttentionWeightsMode::kNone;
  options.return_lse = proto.return_lse();
  options.precision = proto.precision() == Options::BF16 ? Precision::kBFloat16
                                                         : Precision::kFloat32;

  if (proto.key_lengths_size() > 0) {
    ATTNSERVE_RETURN_IF_ERROR(CheckDimEquals("options.key_lengths size",
                                             proto.key_lengths_size(), s.batch,
                                             "one entry per batch item, B"));
    for (int b = 0; b < proto.key_lengths_size(); ++b) {
      if (proto.key_lengths(b) < 0 || proto.key_lengths(b) > s.key_len) {
        return absl::InvalidArgumentError(absl::StrCat(
            "options.key_lengths[", b, "] is ", proto.key_lengths(b),
            ", expected 0 to ", s.key_len, " (Lk)"));
      }
    }
  }
  if (proto.has_attn_mask()) {
    std::array<int64_t, 4> dims;
    ATTNSERVE_RETURN_IF_ERROR(ValidateMask(proto.attn_mask(), s, &dims));
    plan.mask_dims = dims;
  }
  ATTNSERVE_RETURN_IF_ERROR(ValidateVariants(proto, s, &plan));
  if (proto.output_dtype() == v1::DTYPE_UNSPECIFIED) {
    plan.output_dtype = input_dtype;
  } else if (proto.output_dtype() == v1::FLOAT32 ||
             proto.output_dtype() == v1::BFLOAT16 ||
             proto.output_dtype() == v1::FLOAT16) {
    plan.output_dtype = proto.output_dtype();
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.output_dtype is ", DTypeName(proto.output_dtype()),
        ", expected FLOAT32, BFLOAT16, FLOAT16 or unset (the input's dtype)"));
  }
  return plan;
}

// Bytes of a response beyond its tensors' data: each tensor's tags, lengths,
// dtype and shape (under 100 bytes), the timing, a stream answer's index,
// an Open Inference Protocol answer's names and echoed id (at most 128 and
// oip::kMaxInferIdBytes = 512 bytes).
constexpr int64_t kResponseFramingBytes = 1024;

// The response must fit in a message: output, weights and lse together, with
// their framing (gRPC refuses to send a message over the limit, and an
// AttendStream would end there).
absl::Status CheckResponseSize(const AttentionShape& s, const OptionsPlan& plan,
                               int64_t output_elements,
                               const RequestChecks& checks) {
  const int64_t element_bytes = plan.output_dtype == v1::FLOAT32 ? 4 : 2;
  if (!checks.response_carries_output) output_elements = 0;
  const int64_t weights_elements =
      plan.options.weights == AttentionWeightsMode::kPerHead
          ? s.WeightsElements()
      : plan.options.weights == AttentionWeightsMode::kHeadMean
          ? s.HeadMeanWeightsElements()
          : 0;
  // Each count is a product of validated dimensions that fits in int64 (checked
  // above or by the tensors they come from); their sum in bytes is checked
  // here.
  int64_t elements = 0;
  std::optional<int64_t> bytes;
  if (!__builtin_add_overflow(output_elements, weights_elements, &elements)) {
    bytes = CheckedProduct({elements, element_bytes});
  }
  if (bytes && plan.options.return_lse &&
      __builtin_add_overflow(*bytes, 4 * s.LseElements(), &*bytes)) {
    bytes.reset();
  }
  if (bytes && __builtin_add_overflow(*bytes, kResponseFramingBytes, &*bytes)) {
    bytes.reset();
  }
  if (!bytes || *bytes > checks.max_message_bytes) {
    return Permanent(absl::ResourceExhaustedError(absl::StrCat(
        "the response (", checks.response_carries_output ? "output, " : "",
        weights_elements > 0 ? "weights, " : "",
        plan.options.return_lse ? "lse, " : "", "framing) would need ",
        bytes ? absl::StrCat(*bytes, " bytes") : std::string("over 2^63 bytes"),
        ", over the server's max_message_bytes limit of ",
        checks.max_message_bytes)));
  }
  return absl::OkStatus();
}

// RESOURCE_EXHAUSTED if `tensor` has more elements than the limit.
absl::Status CheckElements(absl::string_view field, const v1::Tensor& tensor,
                           const RequestChecks& checks) {
  return CheckElementLimit(field, tensor, checks.limits.max_elements);
}

// The attention's scratch bytes: the engine's own figure, which depends on its
// kernel and threads (infinite if it overflows). With `half_inputs`, an
// AttendHalf's: its scratch and whatever f32 copies of its inputs it makes.
double ScratchBytes(const AttentionShape& s, const AttentionOptions& options,
                    const RequestChecks& checks,
                    std::optional<DataType> half_inputs) {
  const std::optional<int64_t> bytes =
      half_inputs
          ? checks.engine->AttendHalfWorkspaceBytes(s, options, *half_inputs)
          : checks.engine->AttendWorkspaceBytes(s, options);
  return bytes ? static_cast<double>(*bytes)
               : std::numeric_limits<double>::infinity();
}

// The bytes the compute would allocate, or RESOURCE_EXHAUSTED if that is more
// than the limit. `extra_bytes` covers what the caller knows beyond SDPA (MHA's
// projections); `half_inputs`, an Attend computed by AttendHalf.
absl::StatusOr<int64_t> CheckRequestMemory(
    const AttentionShape& s, const OptionsPlan& plan, int64_t output_elements,
    double extra_bytes, double converted_input_elements,
    const RequestChecks& checks,
    std::optional<DataType> half_inputs = std::nullopt) {
  const AttentionOptions options = RoutedOptions(plan);
  const double scratch_bytes = ScratchBytes(s, options, checks, half_inputs);
  if (scratch_bytes >
      static_cast<double>(checks.engine->options().max_workspace_bytes)) {
    return Permanent(absl::ResourceExhaustedError(absl::StrCat(
        "attention for shape ", s.DebugString(), " needs ",
        scratch_bytes < 9e18 ? absl::StrCat(static_cast<int64_t>(scratch_bytes))
                             : std::string("more than 2^63"),
        " bytes of scratch, over the engine's workspace limit of ",
        checks.engine->options().max_workspace_bytes,
        " bytes (max_workspace_bytes)")));
  }
  const double weights_elements =
      options.weights == AttentionWeightsMode::kPerHead
          ? static_cast<double>(s.WeightsElements())
      : options.weights == AttentionWeightsMode::kHeadMean
          ? static_cast<double>(s.HeadMeanWeightsElements())
          : 0.0;
  const double lse_elements =
      options.return_lse ? static_cast<double>(s.LseElements()) : 0.0;
  const double bytes = 4.0 * (output_elements + weights_elements +
                              lse_elements + converted_input_elements) +
                       scratch_bytes + extra_bytes;
  if (bytes <= static_cast<double>(checks.limits.max_request_memory_bytes))
    return static_cast<int64_t>(bytes);
  return Permanent(absl::ResourceExhaustedError(absl::StrCat(
      "the request would allocate about ", static_cast<int64_t>(bytes),
      " bytes (outputs, weights, conversions, scratch), over the "
      "max_request_memory_bytes "
      "limit of ",
      checks.limits.max_request_memory_bytes)));
}

// Whether query, key and value are all BFLOAT16 or all FLOAT16: what
// AttendHalf and AttendPackedHalf read where they lie.
bool InOneHalfDtype(const v1::Tensor& query, const v1::Tensor& key,
                    const v1::Tensor& value) {
  const v1::DType dtype = query.dtype();
  return (dtype == v1::BFLOAT16 || dtype == v1::FLOAT16) &&
         key.dtype() == dtype && value.dtype() == dtype;
}

// Elements that arrive as BFLOAT16/FLOAT16 and are widened to f32 on the
// server.
double ConvertedElements(std::initializer_list<const v1::Tensor*> tensors) {
  double elements = 0;
  for (const v1::Tensor* tensor : tensors) {
    if (tensor->dtype() == v1::BFLOAT16 || tensor->dtype() == v1::FLOAT16) {
      double count = 1;
      for (int64_t dim : tensor->shape()) count *= static_cast<double>(dim);
      elements += count;
    }
  }
  return elements;
}

}  // namespace

AttentionOptions RoutedOptions(const OptionsPlan& plan) {
  AttentionOptions options = plan.options;
  options.alibi_slopes = plan.alibi_slopes;
  return options;
}

namespace {

// Attend over packed sequences (options.cu_seqlens_q/k).
absl::StatusOr<AttendWork> ValidatePackedAttendRequest(
    const v1::AttendRequest& request, const RequestChecks& checks) {
  ATTNSERVE_RETURN_IF_ERROR(CheckTensor("query", request.has_query(),
                                        request.query(), kFloatDTypes,
                                        {"total_q", "H", "Dk"}));
  ATTNSERVE_RETURN_IF_ERROR(CheckTensor("key", request.has_key(), request.key(),
                                        kFloatDTypes,
                                        {"total_k", "Hkv", "Dk"}));
  ATTNSERVE_RETURN_IF_ERROR(CheckTensor("value", request.has_value(),
                                        request.value(), kFloatDTypes,
                                        {"total_k", "Hkv", "Dv"}));
  ATTNSERVE_RETURN_IF_ERROR(CheckElements("query", request.query(), checks));
  ATTNSERVE_RETURN_IF_ERROR(CheckElements("key", request.key(), checks));
  ATTNSERVE_RETURN_IF_ERROR(CheckElements("value", request.value(), checks));
  const v1::Tensor& q = request.query();
  const v1::Tensor& k = request.key();
  const v1::Tensor& v = request.value();
  ATTNSERVE_RETURN_IF_ERROR(CheckDimEquals(DimField("key", 2, "Dk"), k.shape(2),
                                           q.shape(2),
                                           DimField("query", 2, "Dk")));
  ATTNSERVE_RETURN_IF_ERROR(CheckDimEquals(DimField("value", 0, "total_k"),
                                           v.shape(0), k.shape(0),
                                           DimField("key", 0, "total_k")));
  ATTNSERVE_RETURN_IF_ERROR(CheckDimEquals(DimField("value", 1, "Hkv"),
                                           v.shape(1), k.shape(1),
                                           DimField("key", 1, "Hkv")));
  if (q.shape(1) % k.shape(1) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(DimField("query", 1, "H"), " is ", q.shape(1),
                     ", expected a multiple of ", k.shape(1), " (",
                     DimField("key", 1, "Hkv"), ")"));
  }
  const Options& o = request.options();
  // Each sequence's lengths, mask and positions come from cu_seqlens.
  const char* set = o.key_lengths_size() > 0 ? "options.key_lengths"
                    : o.has_attn_mask()      ? "options.attn_mask"
                    : o.return_weights() != Options::NONE
                        ? "options.return_weights"
                    : o.query_positions_size() > 0 ? "options.query_positions"
                    : o.key_positions_size() > 0   ? "options.key_positions"
                                                   : nullptr;
  if (set != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        set,
        " is set, expected it unset: options.key_lengths, attn_mask, "
        "return_weights and positions do not combine with packed sequences "
        "(cu_seqlens_q/k)"));
  }
  if (o.cu_seqlens_q_size() < 2 ||
      o.cu_seqlens_k_size() != o.cu_seqlens_q_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.cu_seqlens_q and cu_seqlens_k have ", o.cu_seqlens_q_size(),
        " and ", o.cu_seqlens_k_size(),
        " entries, expected the same number, at least 2 (sequences + 1)"));
  }
  int64_t longest_q = 0, longest_k = 0;
  ATTNSERVE_RETURN_IF_ERROR(CheckOffsets(
      "options.cu_seqlens_q", o.cu_seqlens_q(), q.shape(0), &longest_q));
  ATTNSERVE_RETURN_IF_ERROR(CheckOffsets(
      "options.cu_seqlens_k", o.cu_seqlens_k(), k.shape(0), &longest_k));
  AttendWork work;
  work.packed = true;
  AttentionShape& s = work.shape;
  s.batch = 1;
  s.heads = q.shape(1);
  s.kv_heads = k.shape(1);
  s.query_len = q.shape(0);
  s.key_len = k.shape(0);
  s.key_dim = q.shape(2);
  s.value_dim = v.shape(2);
  // The longest sequence: what one kernel call (and its scratch) covers.
  AttentionShape longest = s;
  longest.query_len = std::max<int64_t>(1, longest_q);
  longest.key_len = std::max<int64_t>(1, longest_k);
  longest.batch = o.cu_seqlens_q_size() - 1;
  ATTNSERVE_ASSIGN_OR_RETURN(work.plan, ValidateOptions(o, longest, q.dtype()));
  longest.batch = 1;
  ATTNSERVE_RETURN_IF_ERROR(
      CheckResponseSize(s, work.plan, s.OutputElements(), checks));
  const double lse_bytes =
      work.plan.options.return_lse ? 4.0 * s.LseElements() : 0.0;
  work.inputs_in_place = InOneHalfDtype(q, k, v);
  if (work.inputs_in_place) {
    // AttendPackedHalf: its workspace figure, and the bf16 copy of the
    // longest sequence's strided keys and values that bf16 tiles read.
    ATTNSERVE_ASSIGN_OR_RETURN(
        work.memory_bytes,
        CheckRequestMemory(
            longest, work.plan, s.OutputElements(),
            lse_bytes + 2.0 * static_cast<double>(longest.KeyElements() +
                                                  longest.ValueElements()),
            0.0, checks, ToDataType(q.dtype())));
    return work;
  }
  ATTNSERVE_ASSIGN_OR_RETURN(
      work.memory_bytes,
      CheckRequestMemory(longest, work.plan, s.OutputElements(), lse_bytes,
                         ConvertedElements({&q, &k, &v}), checks));
  return work;
}

}  // namespace

absl::StatusOr<AttendWork> ValidateAttendRequest(
    const v1::AttendRequest& request, const RequestChecks& checks) {
  if (request.options().cu_seqlens_q_size() > 0 ||
      request.options().cu_seqlens_k_size() > 0) {
    return ValidatePackedAttendRequest(request, checks);
  }
  ATTNSERVE_RETURN_IF_ERROR(CheckTensor("query", request.has_query(),
                                        request.query(), kFloatDTypes,
                                        {"B", "H", "Lq", "Dk"}));
  ATTNSERVE_RETURN_IF_ERROR(CheckTensor("key", request.has_key(), request.key(),
                                        kFloatDTypes,
                                        {"B", "Hkv", "Lk", "Dk"}));
  ATTNSERVE_RETURN_IF_ERROR(CheckTensor("value", request.has_value(),
                                        request.value(), kFloatDTypes,
                                        {"B", "Hkv", "Lk", "Dv"}));
  ATTNSERVE_RETURN_IF_ERROR(CheckElements("query", request.query(), checks));
  ATTNSERVE_RETURN_IF_ERROR(CheckElements("key", request.key(), checks));
  ATTNSERVE_RETURN_IF_ERROR(CheckElements("value", request.value(), checks));
  for (const DimensionMatch& m : kAttendDimensionMatches) {
    ATTNSERVE_RETURN_IF_ERROR(CheckDimEquals(
        DimField(m.field, m.dim, m.dim_name),
        AttendTensor(request, m.field).shape(m.dim),
        AttendTensor(request, m.reference).shape(m.reference_dim),
        DimField(m.reference, m.reference_dim, m.dim_name)));
  }
  AttendWork work;
  AttentionShape& s = work.shape;
  s.batch = request.query().shape(0);
  s.heads = request.query().shape(1);
  s.kv_heads = request.key().shape(1);
  s.query_len = request.query().shape(2);
  s.key_len = request.key().shape(2);
  s.key_dim = request.query().shape(3);
  s.value_dim = request.value().shape(3);
  if (s.heads % s.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        DimField("query", 1, "H"), " is ", s.heads, ", expected a multiple of ",
        s.kv_heads, " (", DimField("key", 1, "Hkv"),
        "): each kv head serves H / Hkv query heads"));
  }
  if (!CheckedProduct(
          {s.batch, s.heads, s.query_len, s.key_len, s.value_dim})) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape ", s.DebugString(),
                     " overflows int64 in its output or weights"));
  }
  ATTNSERVE_ASSIGN_OR_RETURN(
      work.plan,
      ValidateOptions(request.options(), s, request.query().dtype()));
  if (request.options().query_positions_size() > 0 ||
      request.options().key_positions_size() > 0) {
    return absl::InvalidArgumentError(
        "options.query_positions and key_positions are for "
        "MultiHeadAttention with RoPE (weights.rope), expected none on "
        "Attend");
  }
  ATTNSERVE_RETURN_IF_ERROR(
      CheckResponseSize(s, work.plan, s.OutputElements(), checks));
  if (request.options().has_attn_mask()) {
    ATTNSERVE_RETURN_IF_ERROR(CheckElements(
        "options.attn_mask", request.options().attn_mask(), checks));
  }
  work.inputs_in_place =
      InOneHalfDtype(request.query(), request.key(), request.value());
  if (work.inputs_in_place) {
    // Whatever copies AttendHalf makes count in its workspace figure.
    ATTNSERVE_ASSIGN_OR_RETURN(
        work.memory_bytes,
        CheckRequestMemory(s, work.plan, s.OutputElements(), 0.0,
                           ConvertedElements({&request.options().attn_mask()}),
                           checks, ToDataType(request.query().dtype())));
    return work;
  }
  ATTNSERVE_ASSIGN_OR_RETURN(
      work.memory_bytes,
      CheckRequestMemory(
          s, work.plan, s.OutputElements(), 0.0,
          ConvertedElements({&request.query(), &request.key(), &request.value(),
                             &request.options().attn_mask()}),
          checks));
  return work;
}

absl::StatusOr<MultiHeadWork> ValidateMultiHeadRequest(
    const v1::MultiHeadAttentionRequest& request, const WeightsShape& w,
    const std::string& weights_origin, const RequestChecks& checks) {
  ATTNSERVE_RETURN_IF_ERROR(
      CheckTensor("query_input", request.has_query_input(),
                  request.query_input(), kFloatDTypes, {"B", "Lq", "E"}));
  const v1::Tensor& query = request.query_input();
  MultiHeadWork work;
  work.self_attention = !request.has_kv_input();
  MultiHeadShape& s = work.shape;
  s.batch = query.shape(0);
  s.query_len = query.shape(1);
  s.embed_dim = query.shape(2);
  s.key_len = s.query_len;
  s.kv_embed_dim = s.embed_dim;
  ATTNSERVE_RETURN_IF_ERROR(
      CheckDimEquals(DimField("query_input", 2, "E"), s.embed_dim, w.embed_dim,
                     absl::StrCat("E of ", weights_origin)));
  if (work.self_attention && w.kv_embed_dim != w.embed_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_input is missing: ", weights_origin, " project queries of E = ",
        w.embed_dim, " features and keys and values of Ekv = ", w.kv_embed_dim,
        " (cross-attention), so they need one"));
  }
  if (!work.self_attention) {
    const v1::Tensor& kv = request.kv_input();
    ATTNSERVE_RETURN_IF_ERROR(
        CheckTensor("kv_input", true, kv, kFloatDTypes, {"B", "Lk", "Ekv"}));
    ATTNSERVE_RETURN_IF_ERROR(CheckDimEquals(DimField("kv_input", 0, "B"),
                                             kv.shape(0), s.batch,
                                             DimField("query_input", 0, "B")));
    s.key_len = kv.shape(1);
    s.kv_embed_dim = kv.shape(2);
    ATTNSERVE_RETURN_IF_ERROR(CheckDimEquals(
        DimField("kv_input", 2, "Ekv"), s.kv_embed_dim, w.kv_embed_dim,
        absl::StrCat("Ekv of ", weights_origin)));
  }
  s.heads = w.heads;
  s.kv_heads = w.kv_heads;
  s.key_dim = w.key_dim;
  s.value_dim = w.value_dim;
  const AttentionShape heads = s.Heads();
  if (!CheckedProduct({s.batch, s.heads, s.query_len, s.key_len,
                       std::max(s.key_dim, s.value_dim)}) ||
      !CheckedProduct({s.batch, s.query_len, s.embed_dim})) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heads ", heads.DebugString(), " overflow int64 in their tensors"));
  }
  ATTNSERVE_ASSIGN_OR_RETURN(
      work.plan, ValidateOptions(request.options(), heads, query.dtype()));
  if (request.options().cu_seqlens_q_size() > 0 ||
      request.options().cu_seqlens_k_size() > 0) {
    return absl::InvalidArgumentError(
        "options.cu_seqlens_q and cu_seqlens_k (packed sequences) are for "
        "Attend, expected none on MultiHeadAttention (pad the batch, with "
        "key_lengths)");
  }
  ATTNSERVE_RETURN_IF_ERROR(ValidatePositions(request.options(), s, w.rope));
  ATTNSERVE_RETURN_IF_ERROR(CheckResponseSize(
      heads, work.plan, s.batch * s.query_len * s.embed_dim, checks));
  ATTNSERVE_RETURN_IF_ERROR(CheckElements("query_input", query, checks));
  if (!work.self_attention) {
    ATTNSERVE_RETURN_IF_ERROR(
        CheckElements("kv_input", request.kv_input(), checks));
  }
  // Projections: Q and the attention context per query row, K and V per key
  // row, twice (the attention packs what it reads out of the projections'
  // rows).
  const double projection_bytes =
      8.0 * (static_cast<double>(s.batch * s.query_len) * s.heads *
                 (s.key_dim + s.value_dim) +
             static_cast<double>(s.batch * s.key_len) * s.kv_heads *
                 (s.key_dim + s.value_dim));
  ATTNSERVE_ASSIGN_OR_RETURN(
      work.memory_bytes,
      CheckRequestMemory(heads, work.plan, s.batch * s.query_len * s.embed_dim,
                         projection_bytes,
                         ConvertedElements({&query, &request.kv_input(),
                                            &request.options().attn_mask()}),
                         checks));
  return work;
}

absl::StatusOr<MultiHeadWeights> ResolveMultiHeadWeights(
    const v1::MultiHeadAttentionRequest& request,
    const WeightsRegistry& registry) {
  const bool named = request.weights_source_case() ==
                     v1::MultiHeadAttentionRequest::kWeightsName;
  if (request.weights_version() < 0 ||
      (request.weights_version() != 0 && !named)) {
    return absl::InvalidArgumentError(
        absl::StrCat("weights_version is ", request.weights_version(),
                     ", expected 0, or a positive version with weights_name"));
  }
  MultiHeadWeights weights;
  if (named) {
    ATTNSERVE_RETURN_IF_ERROR(
        ValidateWeightsName("weights_name", request.weights_name()));
    ATTNSERVE_ASSIGN_OR_RETURN(const WeightsRegistry::Entry entry,
                               registry.Get(request.weights_name()));
    if (request.weights_version() != 0 &&
        request.weights_version() != entry.version) {
      return absl::FailedPreconditionError(absl::StrCat(
          "weights_name '", request.weights_name(), "' is at version ",
          entry.version, " on this server, the request's weights_version is ",
          request.weights_version(),
          "; replicas reloading a shared weights_dir agree within its "
          "reload interval: retry, or send weights_version 0 for any"));
    }
    weights.registered = entry.weights;
    weights.version = entry.version;
    weights.origin = absl::StrCat("weights '", request.weights_name(), "'");
    weights.shape = entry.weights->shape();
    return weights;
  }
  if (request.weights_source_case() !=
      v1::MultiHeadAttentionRequest::kWeights) {
    return absl::InvalidArgumentError(
        "weights and weights_name are both missing, expected one: inline "
        "ProjectionWeights or a name registered by PutWeights");
  }
  ATTNSERVE_ASSIGN_OR_RETURN(
      weights.shape, ValidateProjectionWeights(request.weights(), "weights"));
  weights.origin = "weights";
  return weights;
}

}  // namespace attnserve
