#include "internal/validation.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnserve/common/checked_math.h"
#include "attnserve/common/status_macros.h"

namespace attnserve::internal {
namespace {

absl::Status ValidatePositive(
    std::initializer_list<std::pair<const char*, int64_t>> dims) {
  for (const auto& [name, value] : dims) {
    if (value <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " is ", value, ", expected > 0"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateMask(const AttentionShape& shape,
                          const AttentionMask& mask) {
  if ((mask.allowed == nullptr) == (mask.bias == nullptr)) {
    return absl::InvalidArgumentError(
        "mask must hold exactly one of allowed and bias");
  }
  const int64_t full[4] = {shape.batch, shape.heads, shape.query_len,
                           shape.key_len};
  for (int dim = 0; dim < 4; ++dim) {
    if (mask.dims[dim] != 1 && mask.dims[dim] != full[dim]) {
      return absl::InvalidArgumentError(
          absl::StrCat("mask.dims[", dim, "] is ", mask.dims[dim],
                       ", expected 1 or ", full[dim]));
    }
  }
  return absl::OkStatus();
}

int64_t WeightsElements(const AttentionShape& shape,
                        AttentionWeightsMode mode) {
  switch (mode) {
    case AttentionWeightsMode::kNone:
      return 0;
    case AttentionWeightsMode::kPerHead:
      return shape.WeightsElements();
    case AttentionWeightsMode::kHeadMean:
      return shape.HeadMeanWeightsElements();
  }
  return 0;
}

}  // namespace

absl::Status ValidateSpanSize(const char* name, size_t actual,
                              int64_t expected) {
  if (static_cast<int64_t>(actual) != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " has ", actual, " elements, expected ", expected));
  }
  return absl::OkStatus();
}

absl::Status ValidateShape(const AttentionShape& s) {
  ATTNSERVE_RETURN_IF_ERROR(
      ValidatePositive({{"shape.batch", s.batch},
                        {"shape.heads", s.heads},
                        {"shape.kv_heads", s.kv_heads},
                        {"shape.query_len", s.query_len},
                        {"shape.key_len", s.key_len},
                        {"shape.key_dim", s.key_dim},
                        {"shape.value_dim", s.value_dim}}));
  if (s.heads % s.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shape.heads is ", s.heads, ", expected a multiple of shape.kv_heads (",
        s.kv_heads, ")"));
  }
  if (!CheckedProduct({s.batch, s.heads, s.query_len, s.key_dim}) ||
      !CheckedProduct({s.batch, s.kv_heads, s.key_len, s.key_dim}) ||
      !CheckedProduct({s.batch, s.kv_heads, s.key_len, s.value_dim}) ||
      !CheckedProduct({s.batch, s.heads, s.query_len, s.value_dim}) ||
      !CheckedProduct({s.batch, s.heads, s.query_len, s.key_len})) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shape ", s.DebugString(), " has more than 2^63 elements in a tensor"));
  }
  return absl::OkStatus();
}

namespace {

// The window, sinks, softcap and ALiBi slopes.
absl::Status ValidateVariants(const AttentionShape& shape,
                              const AttentionOptions& options) {
  if (options.window_left < -1 || options.window_right < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.window_left and window_right are ", options.window_left,
        " and ", options.window_right, ", expected -1 (unbounded) or >= 0"));
  }
  if (options.num_sink_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.num_sink_tokens is ", options.num_sink_tokens,
                     ", expected >= 0"));
  }
  if (options.softcap && !IsValidSoftcap(*options.softcap)) {
    return SoftcapRefusal("options.softcap", *options.softcap);
  }
  if (!options.alibi_slopes.empty()) {
    ATTNSERVE_RETURN_IF_ERROR(ValidateSpanSize(
        "options.alibi_slopes", options.alibi_slopes.size(), shape.heads));
    for (size_t h = 0; h < options.alibi_slopes.size(); ++h) {
      if (!std::isfinite(options.alibi_slopes[h])) {
        return absl::InvalidArgumentError(
            absl::StrCat("options.alibi_slopes[", h, "] is ",
                         options.alibi_slopes[h], ", expected finite"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateOptionsAndOutputs(const AttentionShape& shape,
                                       const AttentionOptions& options,
                                       const AttentionOutputs& outputs,
                                       int64_t output_elements) {
  if (options.scale && !std::isfinite(*options.scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.scale is ", *options.scale, ", expected a finite number"));
  }
  if (!options.key_lengths.empty()) {
    ATTNSERVE_RETURN_IF_ERROR(ValidateSpanSize(
        "options.key_lengths", options.key_lengths.size(), shape.batch));
    for (size_t b = 0; b < options.key_lengths.size(); ++b) {
      if (options.key_lengths[b] < 0 ||
          options.key_lengths[b] > shape.key_len) {
        return absl::InvalidArgumentError(absl::StrCat(
            "options.key_lengths[", b, "] is ", options.key_lengths[b],
            ", expected 0 to ", shape.key_len, " (Lk)"));
      }
    }
  }
  if (options.mask)
    ATTNSERVE_RETURN_IF_ERROR(ValidateMask(shape, *options.mask));
  ATTNSERVE_RETURN_IF_ERROR(ValidateVariants(shape, options));
  if (!options.query_positions.empty() || !options.key_positions.empty()) {
    return absl::InvalidArgumentError(
        "options.query_positions and key_positions are for "
        "MultiHeadAttention with RoPE, expected none");
  }
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateSpanSize("output", outputs.output.size(), output_elements));
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateSpanSize("weights", outputs.weights.size(),
                       WeightsElements(shape, options.weights)));
  return ValidateSpanSize("lse", outputs.lse.size(),
                          options.return_lse ? shape.LseElements() : 0);
}

absl::Status ValidatePacked(const PackedShape& s,
                            const AttentionOptions& options, size_t query_size,
                            size_t key_size, size_t value_size,
                            const AttentionOutputs& outputs) {
  if (s.heads < 1 || s.kv_heads < 1 || s.heads % s.kv_heads != 0 ||
      s.key_dim < 1 || s.value_dim < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("packed heads ", s.heads, ", kv heads ", s.kv_heads,
                     ", key dim ", s.key_dim, " and value dim ", s.value_dim,
                     ", expected positive, heads a multiple of kv heads"));
  }
  if (s.cu_seqlens_q.size() < 2 ||
      s.cu_seqlens_k.size() != s.cu_seqlens_q.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.cu_seqlens_q and cu_seqlens_k have ", s.cu_seqlens_q.size(),
        " and ", s.cu_seqlens_k.size(),
        " entries, expected the same number, at least 2 (sequences + 1)"));
  }
  for (const auto& [name, offsets] :
       {std::pair{"options.cu_seqlens_q", s.cu_seqlens_q},
        std::pair{"options.cu_seqlens_k", s.cu_seqlens_k}}) {
    if (offsets[0] != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "[0] is ", offsets[0], ", expected 0"));
    }
    for (size_t i = 1; i < offsets.size(); ++i) {
      if (offsets[i] < offsets[i - 1]) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, "[", i, "] is ", offsets[i], ", expected >= ", name, "[",
            i - 1, "] = ", offsets[i - 1], " (offsets never decrease)"));
      }
    }
  }
  if (!options.key_lengths.empty() || options.mask ||
      options.weights != AttentionWeightsMode::kNone ||
      !options.query_positions.empty() || !options.key_positions.empty()) {
    return absl::InvalidArgumentError(
        "options.key_lengths, attn_mask, return_weights and positions do not "
        "combine with packed sequences (cu_seqlens), expected none");
  }
  const std::optional<int64_t> q_elements =
      CheckedProduct({s.TotalQuery(), s.heads, s.key_dim});
  const std::optional<int64_t> k_elements =
      CheckedProduct({s.TotalKey(), s.kv_heads, s.key_dim});
  const std::optional<int64_t> v_elements =
      CheckedProduct({s.TotalKey(), s.kv_heads, s.value_dim});
  const std::optional<int64_t> o_elements =
      CheckedProduct({s.TotalQuery(), s.heads, s.value_dim});
  if (!q_elements || !k_elements || !v_elements || !o_elements) {
    return absl::InvalidArgumentError("packed tensors overflow int64");
  }
  ATTNSERVE_RETURN_IF_ERROR(ValidateSpanSize("query", query_size, *q_elements));
  ATTNSERVE_RETURN_IF_ERROR(ValidateSpanSize("key", key_size, *k_elements));
  ATTNSERVE_RETURN_IF_ERROR(ValidateSpanSize("value", value_size, *v_elements));
  // The options as a one-sequence Attend of these heads sees them.
  AttentionShape heads;
  heads.heads = s.heads;
  heads.kv_heads = s.kv_heads;
  heads.key_dim = s.key_dim;
  heads.value_dim = s.value_dim;
  heads.query_len = std::max<int64_t>(1, s.TotalQuery());
  heads.key_len = std::max<int64_t>(1, s.TotalKey());
  ATTNSERVE_RETURN_IF_ERROR(ValidateVariants(heads, options));
  if (options.scale && !std::isfinite(*options.scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.scale is ", *options.scale, ", expected a finite number"));
  }
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateSpanSize("output", outputs.output.size(), *o_elements));
  return ValidateSpanSize("lse", outputs.lse.size(),
                          options.return_lse ? s.heads * s.TotalQuery() : 0);
}

absl::Status ValidateMultiHead(const MultiHeadShape& s,
                               const ProjectionWeights& w,
                               bool self_attention) {
  ATTNSERVE_RETURN_IF_ERROR(
      ValidatePositive({{"shape.batch", s.batch},
                        {"shape.query_len", s.query_len},
                        {"shape.key_len", s.key_len},
                        {"shape.embed_dim", s.embed_dim},
                        {"shape.kv_embed_dim", s.kv_embed_dim},
                        {"shape.heads", s.heads},
                        {"shape.kv_heads", s.kv_heads},
                        {"shape.key_dim", s.key_dim},
                        {"shape.value_dim", s.value_dim}}));
  if (self_attention &&
      (s.query_len != s.key_len || s.embed_dim != s.kv_embed_dim)) {
    return absl::InvalidArgumentError(
        "self-attention needs query_len == key_len and embed_dim == "
        "kv_embed_dim");
  }
  ATTNSERVE_RETURN_IF_ERROR(ValidateShape(s.Heads()));
  const int64_t q_out = s.heads * s.key_dim;
  const int64_t k_out = s.kv_heads * s.key_dim;
  const int64_t v_out = s.kv_heads * s.value_dim;
  const int64_t o_in = s.heads * s.value_dim;
  const std::optional<int64_t> sizes[] = {
      CheckedProduct({q_out, s.embed_dim}),
      CheckedProduct({k_out, s.kv_embed_dim}),
      CheckedProduct({v_out, s.kv_embed_dim}),
      CheckedProduct({s.embed_dim, o_in}),
      CheckedProduct({s.batch, s.query_len, s.embed_dim}),
      CheckedProduct({s.batch, s.key_len, s.kv_embed_dim})};
  for (const std::optional<int64_t>& size : sizes) {
    if (!size)
      return absl::InvalidArgumentError("multi-head shape overflows int64");
  }
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateSpanSize("weights.w_q", w.w_q.size(), *sizes[0]));
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateSpanSize("weights.w_k", w.w_k.size(), *sizes[1]));
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateSpanSize("weights.w_v", w.w_v.size(), *sizes[2]));
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateSpanSize("weights.w_o", w.w_o.size(), *sizes[3]));
  const std::pair<const char*, std::pair<absl::Span<const float>, int64_t>>
      biases[] = {{"weights.b_q", {w.b_q, q_out}},
                  {"weights.b_k", {w.b_k, k_out}},
                  {"weights.b_v", {w.b_v, v_out}},
                  {"weights.b_o", {w.b_o, s.embed_dim}}};
  for (const auto& [name, bias] : biases) {
    if (!bias.first.empty()) {
      ATTNSERVE_RETURN_IF_ERROR(
          ValidateSpanSize(name, bias.first.size(), bias.second));
    }
  }
  if (!w.w_qkv.empty()) {
    ATTNSERVE_RETURN_IF_ERROR(
        ValidateSpanSize("weights.w_qkv", w.w_qkv.size(),
                         (q_out + k_out + v_out) * s.embed_dim));
    if (!w.b_qkv.empty()) {
      ATTNSERVE_RETURN_IF_ERROR(ValidateSpanSize(
          "weights.b_qkv", w.b_qkv.size(), q_out + k_out + v_out));
    }
  }
  return absl::OkStatus();
}

}  // namespace attnserve::internal
