#include "request_flags.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attnserve/client/client.h"
#include "attnserve/common/checked_math.h"
#include "attnserve/common/status_macros.h"
#include "cli.h"
#include "weights.h"

// Random inputs.
ABSL_FLAG(bool, demo, false,
          "attend, mha, grid, session step: send random inputs drawn from "
          "--seed.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of random inputs.");
ABSL_FLAG(int64_t, batch, 1, "Random inputs: B.");
ABSL_FLAG(int64_t, heads, 8, "Random inputs: H, query heads.");
ABSL_FLAG(int64_t, kv_heads, 8,
          "Random inputs: Hkv, key/value heads (divides H).");
ABSL_FLAG(int64_t, query_len, 128, "Random inputs: Lq.");
ABSL_FLAG(int64_t, key_len, 128, "Random inputs: Lk.");
ABSL_FLAG(int64_t, key_dim, 64, "Random inputs: Dk.");
ABSL_FLAG(int64_t, value_dim, 64, "Random inputs: Dv.");
ABSL_FLAG(std::string, input_dtype, "float32",
          "Random inputs: float32, bfloat16 or float16.");

// Inputs from .npy files.
ABSL_FLAG(std::string, query, "",
          "attend, grid: query [B, H, Lq, Dk] .npy; session step: query "
          "[H, Tq, Dk].");
ABSL_FLAG(std::string, key, "",
          "attend, grid: key [B, Hkv, Lk, Dk] .npy; session step: keys to "
          "append [Hkv, T, Dk].");
ABSL_FLAG(std::string, value, "",
          "attend, grid: value [B, Hkv, Lk, Dv] .npy; session step: values to "
          "append [Hkv, T, Dv].");
ABSL_FLAG(std::string, query_input, "", "mha: query_input [B, Lq, E] .npy.");
ABSL_FLAG(std::string, kv_input, "",
          "mha: kv_input [B, Lk, Ekv] .npy; absent: self-attention.");
ABSL_FLAG(std::string, weights_name, "",
          "mha, bench --rpc=mha: registered weight set (default demo).");
ABSL_FLAG(std::string, weights_dir, "",
          "mha, bench --rpc=mha: send the weight set in this folder inline.");
ABSL_FLAG(bool, bf16_as_uint16, false,
          "Read uint16 ('<u2') .npy files as bfloat16 bit patterns.");

// AttentionOptions.
ABSL_FLAG(std::string, scale, "",
          "Multiplies Q K^T; empty: 1/sqrt(Dk) (the server's default).");
ABSL_FLAG(bool, causal, false, "Causal masking.");
ABSL_FLAG(std::string, causal_alignment, "top_left",
          "top_left or bottom_right.");
ABSL_FLAG(std::vector<std::string>, key_lengths, {},
          "Valid keys per batch item, comma-separated (e.g. 5,7).");
ABSL_FLAG(std::string, attn_mask, "",
          ".npy mask: bool (true = may attend) or float (added to scores).");
ABSL_FLAG(int64_t, window_left, -1,
          "Sliding window: each query sees this many keys back (-1: all).");
ABSL_FLAG(int64_t, window_right, -1,
          "Sliding window: each query sees this many keys ahead (-1: all).");
ABSL_FLAG(int64_t, num_sink_tokens, 0,
          "Attention sinks: the first keys every query sees on top of its "
          "window.");
ABSL_FLAG(std::vector<std::string>, alibi_slopes, {},
          "ALiBi: one slope per query head, e.g. 0.5,0.25 (empty: none).");
ABSL_FLAG(std::string, softcap, "",
          "Logit softcap: scores become softcap * tanh(scores / softcap) "
          "(empty: none).");
ABSL_FLAG(std::vector<std::string>, query_positions, {},
          "mha with RoPE: each batch item's query positions, B x Lq in all.");
ABSL_FLAG(std::vector<std::string>, key_positions, {},
          "mha with RoPE: each batch item's key positions, B x Lk in all.");
ABSL_FLAG(std::vector<std::string>, cu_seqlens_q, {},
          "attend: packed sequences' query offsets (with [total, H, D] "
          "tensors), e.g. 0,5,12.");
ABSL_FLAG(std::vector<std::string>, cu_seqlens_k, {},
          "attend: packed sequences' key offsets, e.g. 0,7,20.");
ABSL_FLAG(std::string, rope_theta, "",
          "session create: RoPE with this base (empty: none).");
ABSL_FLAG(int64_t, rotary_dim, 0,
          "session create: RoPE's rotated features a head (0: all).");
ABSL_FLAG(bool, rope_interleaved, false,
          "session create: RoPE pairs (2m, 2m+1) (GPT-J) instead of (m, "
          "m+R/2).");
ABSL_FLAG(bool, evict_outside_window, false,
          "session create: free the pages between the sinks and the window.");
ABSL_FLAG(std::string, return_weights, "none", "none, per_head or head_mean.");
ABSL_FLAG(bool, return_lse, false, "Ask for lse [B, H, Lq].");
ABSL_FLAG(std::string, precision, "f32", "f32 or bf16.");
ABSL_FLAG(std::string, output_dtype, "",
          "float32, bfloat16 or float16; empty: the input's dtype.");

// KV-cache sessions.
ABSL_FLAG(int64_t, layers, 1, "session create, bench --rpc=step: layers.");
ABSL_FLAG(std::string, cache_dtype, "float32",
          "session create, bench --rpc=step: how the server stores keys and "
          "values: float32, bfloat16 or float16.");
ABSL_FLAG(int64_t, max_tokens, 0,
          "session create, bench --rpc=step: most tokens a layer may hold; 0: "
          "the server's limit.");
ABSL_FLAG(absl::Duration, ttl, absl::ZeroDuration(),
          "session create and fork: idle time before the session expires, a "
          "duration of whole seconds (300s, 10m, 1h); 0: the server's (fork: "
          "the parent's).");
ABSL_FLAG(int64_t, layer, 0, "session step: the layer to step.");
ABSL_FLAG(int64_t, tokens, 1,
          "session step --demo: random tokens to append (0: none).");
ABSL_FLAG(int64_t, query_tokens, 1,
          "session step --demo: random query rows (0: append only).");

namespace attnserve {
namespace {

constexpr int64_t kMaxRandomDim = int64_t{1} << 20;

// The value `choices` maps the flag's `text` to, compared case-insensitively.
template <typename T>
absl::StatusOr<T> ParseChoice(
    const char* flag, const std::string& text,
    std::initializer_list<std::pair<const char*, T>> choices) {
  const std::string lower = absl::AsciiStrToLower(text);
  std::string names;
  for (const auto& [name, value] : choices) {
    if (lower == name) return value;
    absl::StrAppend(&names, names.empty() ? "" : ", ", name);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " is '", text, "', expected one of ", names));
}

// FLOAT32, BFLOAT16 or FLOAT16 from the flag's lower-case name.
absl::StatusOr<v1::DType> ParseFloatDType(const char* flag,
                                          const std::string& text) {
  return ParseChoice<v1::DType>(flag, text,
                                {{"float32", v1::FLOAT32},
                                 {"bfloat16", v1::BFLOAT16},
                                 {"float16", v1::FLOAT16}});
}

absl::StatusOr<v1::DType> InputDType() {
  return ParseFloatDType("input_dtype", absl::GetFlag(FLAGS_input_dtype));
}

// Each dimension, named as what gave it (a flag, or the weight set's E).
absl::Status CheckRandomDims(
    std::initializer_list<std::pair<const char*, int64_t>> dims) {
  for (const auto& [name, dim] : dims) {
    if (dim <= 0 || dim > kMaxRandomDim) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " is ", dim, ", expected 1 to 2^20"));
    }
  }
  return absl::OkStatus();
}

// A tensor of `shape` filled with values uniform in [-1, 1) from `generator`.
// INVALID_ARGUMENT if it would not fit in --max_message_bytes.
absl::StatusOr<v1::Tensor> RandomTensor(v1::DType dtype,
                                        std::initializer_list<int64_t> shape,
                                        std::mt19937_64& generator) {
  const int64_t element_bytes = dtype == v1::FLOAT32 ? 4 : 2;
  const std::optional<int64_t> count = CheckedProduct(shape);
  if (!count || *count > MaxMessageBytes() / element_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a random input of shape [", absl::StrJoin(shape, ", "),
        "] would not fit in --max_message_bytes=", MaxMessageBytes()));
  }
  std::uniform_real_distribution<float> distribution(-1.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(*count));
  for (float& value : values) value = distribution(generator);
  return MakeTensor(dtype, shape, values);
}

absl::Status SetRandomAttendInputs(v1::AttendRequest* request) {
  const int64_t b = absl::GetFlag(FLAGS_batch), h = absl::GetFlag(FLAGS_heads),
                hkv = absl::GetFlag(FLAGS_kv_heads),
                lq = absl::GetFlag(FLAGS_query_len),
                lk = absl::GetFlag(FLAGS_key_len),
                dk = absl::GetFlag(FLAGS_key_dim),
                dv = absl::GetFlag(FLAGS_value_dim);
  ATTNSERVE_RETURN_IF_ERROR(CheckRandomDims({{"--batch", b},
                                             {"--heads", h},
                                             {"--kv_heads", hkv},
                                             {"--query_len", lq},
                                             {"--key_len", lk},
                                             {"--key_dim", dk},
                                             {"--value_dim", dv}}));
  ATTNSERVE_ASSIGN_OR_RETURN(const v1::DType dtype, InputDType());
  std::mt19937_64 generator(absl::GetFlag(FLAGS_seed));
  ATTNSERVE_ASSIGN_OR_RETURN(*request->mutable_query(),
                             RandomTensor(dtype, {b, h, lq, dk}, generator));
  ATTNSERVE_ASSIGN_OR_RETURN(*request->mutable_key(),
                             RandomTensor(dtype, {b, hkv, lk, dk}, generator));
  ATTNSERVE_ASSIGN_OR_RETURN(*request->mutable_value(),
                             RandomTensor(dtype, {b, hkv, lk, dv}, generator));
  return absl::OkStatus();
}

// Whether the inputs are random (true) or read from files (false), given
// whether any input file flag is set.
absl::StatusOr<bool> UseRandomInputs(InputMode mode, bool any_file,
                                     const char* file_flags) {
  const bool demo = absl::GetFlag(FLAGS_demo);
  if (demo && any_file) {
    return absl::InvalidArgumentError(
        absl::StrCat("--demo and ", file_flags, " exclude each other"));
  }
  if (!demo && !any_file && mode == InputMode::kFilesOrDemo) {
    return absl::InvalidArgumentError(
        absl::StrCat("inputs come from ", file_flags, " or --demo"));
  }
  return !any_file;
}

// --scale (empty: unset) and --key_lengths.
absl::Status SetScaleAndKeyLengths(v1::AttentionOptions* options) {
  const std::string scale = absl::GetFlag(FLAGS_scale);
  if (!scale.empty()) {
    float value = 0.0f;
    if (!absl::SimpleAtof(scale, &value) || !std::isfinite(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--scale is '", scale, "', expected a finite number"));
    }
    options->set_scale(value);
  }
  for (const std::string& text : absl::GetFlag(FLAGS_key_lengths)) {
    int64_t length = 0;
    if (!absl::SimpleAtoi(text, &length)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--key_lengths has '", text, "', expected integers like 5,7"));
    }
    options->add_key_lengths(length);
  }
  return absl::OkStatus();
}

// The variant flags: --window_left, --window_right, --num_sink_tokens,
// --alibi_slopes and --softcap, as the server checks them (it names the
// field of a bad value).
struct Variant {
  std::optional<int64_t> window_left, window_right;
  int64_t sinks = 0;
  std::vector<float> slopes;
  std::optional<float> softcap;
};

absl::StatusOr<Variant> VariantFromFlags() {
  Variant variant;
  if (absl::GetFlag(FLAGS_window_left) != -1) {
    variant.window_left = absl::GetFlag(FLAGS_window_left);
  }
  if (absl::GetFlag(FLAGS_window_right) != -1) {
    variant.window_right = absl::GetFlag(FLAGS_window_right);
  }
  variant.sinks = absl::GetFlag(FLAGS_num_sink_tokens);
  for (const std::string& text : absl::GetFlag(FLAGS_alibi_slopes)) {
    float slope = 0.0f;
    if (!absl::SimpleAtof(text, &slope)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--alibi_slopes has '", text, "', expected numbers like 0.5,0.25"));
    }
    variant.slopes.push_back(slope);
  }
  const std::string softcap = absl::GetFlag(FLAGS_softcap);
  if (!softcap.empty()) {
    float value = 0.0f;
    if (!absl::SimpleAtof(softcap, &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--softcap is '", softcap, "', expected a number"));
    }
    variant.softcap = value;
  }
  return variant;
}

absl::Status SetVariant(v1::AttentionOptions* options) {
  ATTNSERVE_ASSIGN_OR_RETURN(const Variant variant, VariantFromFlags());
  if (variant.window_left) options->set_window_left(*variant.window_left);
  if (variant.window_right) options->set_window_right(*variant.window_right);
  options->set_num_sink_tokens(variant.sinks);
  if (!variant.slopes.empty()) {
    v1::Tensor* slopes = options->mutable_alibi_slopes();
    slopes->set_dtype(v1::FLOAT32);
    slopes->add_shape(static_cast<int64_t>(variant.slopes.size()));
    slopes->set_data(
        std::string(reinterpret_cast<const char*>(variant.slopes.data()),
                    variant.slopes.size() * sizeof(float)));
  }
  if (variant.softcap) options->set_softcap(*variant.softcap);
  for (const auto& [flag, values, add] :
       {std::tuple{"query_positions", absl::GetFlag(FLAGS_query_positions),
                   &v1::AttentionOptions::add_query_positions},
        std::tuple{"key_positions", absl::GetFlag(FLAGS_key_positions),
                   &v1::AttentionOptions::add_key_positions},
        std::tuple{"cu_seqlens_q", absl::GetFlag(FLAGS_cu_seqlens_q),
                   &v1::AttentionOptions::add_cu_seqlens_q},
        std::tuple{"cu_seqlens_k", absl::GetFlag(FLAGS_cu_seqlens_k),
                   &v1::AttentionOptions::add_cu_seqlens_k}}) {
    for (const std::string& text : values) {
      int64_t position = 0;
      if (!absl::SimpleAtoi(text, &position)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--", flag, " has '", text, "', expected integers like 0,1,2"));
      }
      (options->*add)(position);
    }
  }
  return absl::OkStatus();
}

// --causal_alignment, --return_weights, --precision and --output_dtype.
absl::Status SetChoices(v1::AttentionOptions* options) {
  ATTNSERVE_ASSIGN_OR_RETURN(
      const v1::AttentionOptions::CausalAlignment alignment,
      ParseChoice<v1::AttentionOptions::CausalAlignment>(
          "causal_alignment", absl::GetFlag(FLAGS_causal_alignment),
          {{"top_left", v1::AttentionOptions::TOP_LEFT},
           {"bottom_right", v1::AttentionOptions::BOTTOM_RIGHT}}));
  options->set_causal_alignment(alignment);
  ATTNSERVE_ASSIGN_OR_RETURN(
      const v1::AttentionOptions::ReturnWeights return_weights,
      ParseChoice<v1::AttentionOptions::ReturnWeights>(
          "return_weights", absl::GetFlag(FLAGS_return_weights),
          {{"none", v1::AttentionOptions::NONE},
           {"per_head", v1::AttentionOptions::PER_HEAD},
           {"head_mean", v1::AttentionOptions::HEAD_MEAN}}));
  options->set_return_weights(return_weights);
  ATTNSERVE_ASSIGN_OR_RETURN(const v1::AttentionOptions::Precision precision,
                             ParseChoice<v1::AttentionOptions::Precision>(
                                 "precision", absl::GetFlag(FLAGS_precision),
                                 {{"f32", v1::AttentionOptions::F32},
                                  {"bf16", v1::AttentionOptions::BF16}}));
  options->set_precision(precision);
  const std::string output_dtype = absl::GetFlag(FLAGS_output_dtype);
  if (!output_dtype.empty()) {
    ATTNSERVE_ASSIGN_OR_RETURN(const v1::DType dtype,
                               ParseFloatDType("output_dtype", output_dtype));
    options->set_output_dtype(dtype);
  }
  return absl::OkStatus();
}

// Whole seconds of --ttl.
absl::StatusOr<int64_t> TtlSeconds() {
  const absl::Duration ttl = absl::GetFlag(FLAGS_ttl);
  if (ttl < absl::ZeroDuration() ||
      ttl % absl::Seconds(1) != absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ttl is ", absl::FormatDuration(ttl),
                     ", expected whole seconds >= 0"));
  }
  return absl::ToInt64Seconds(ttl);
}

}  // namespace

absl::StatusOr<int64_t> TtlSecondsFromFlags() { return TtlSeconds(); }

absl::StatusOr<v1::CreateSessionRequest> CreateSessionRequestFromFlags() {
  const int64_t layers = absl::GetFlag(FLAGS_layers),
                h = absl::GetFlag(FLAGS_heads),
                hkv = absl::GetFlag(FLAGS_kv_heads),
                dk = absl::GetFlag(FLAGS_key_dim),
                dv = absl::GetFlag(FLAGS_value_dim);
  ATTNSERVE_RETURN_IF_ERROR(CheckRandomDims({{"--layers", layers},
                                             {"--heads", h},
                                             {"--kv_heads", hkv},
                                             {"--key_dim", dk},
                                             {"--value_dim", dv}}));
  v1::CreateSessionRequest request;
  request.set_num_layers(layers);
  request.set_num_heads(h);
  request.set_num_kv_heads(hkv);
  request.set_key_dim(dk);
  request.set_value_dim(dv);
  ATTNSERVE_ASSIGN_OR_RETURN(
      const v1::DType dtype,
      ParseFloatDType("cache_dtype", absl::GetFlag(FLAGS_cache_dtype)));
  request.set_dtype(dtype);
  request.set_max_tokens(absl::GetFlag(FLAGS_max_tokens));
  ATTNSERVE_ASSIGN_OR_RETURN(const int64_t ttl, TtlSeconds());
  request.set_ttl_seconds(ttl);
  v1::AttentionOptions scale;
  ATTNSERVE_RETURN_IF_ERROR(SetScaleAndKeyLengths(&scale));
  v1::SessionDefaults& defaults = *request.mutable_defaults();
  if (scale.has_scale()) defaults.set_scale(scale.scale());
  ATTNSERVE_ASSIGN_OR_RETURN(const Variant variant, VariantFromFlags());
  if (variant.window_right) {
    return absl::InvalidArgumentError(
        "--window_right is for Attend and mha: a session's steps are causal");
  }
  if (variant.window_left) defaults.set_window_left(*variant.window_left);
  defaults.set_num_sink_tokens(variant.sinks);
  for (const float slope : variant.slopes) defaults.add_alibi_slopes(slope);
  if (variant.softcap) defaults.set_softcap(*variant.softcap);
  defaults.set_evict_outside_window(absl::GetFlag(FLAGS_evict_outside_window));
  const std::string theta = absl::GetFlag(FLAGS_rope_theta);
  if (!theta.empty()) {
    float value = 0.0f;
    if (!absl::SimpleAtof(theta, &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--rope_theta is '", theta, "', expected a number"));
    }
    defaults.mutable_rope()->set_theta(value);
    defaults.mutable_rope()->set_rotary_dim(absl::GetFlag(FLAGS_rotary_dim));
    defaults.mutable_rope()->set_interleaved(
        absl::GetFlag(FLAGS_rope_interleaved));
  }
  return request;
}

absl::StatusOr<v1::StepOptions> StepOptionsFromFlags() {
  ATTNSERVE_ASSIGN_OR_RETURN(const v1::AttentionOptions attention,
                             AttentionOptionsFromFlags());
  v1::StepOptions options;
  if (attention.has_scale()) options.set_scale(attention.scale());
  options.set_precision(attention.precision());
  options.set_return_lse(attention.return_lse());
  options.set_output_dtype(attention.output_dtype());
  return options;
}

absl::StatusOr<StepInputs> RandomStepInputs(const v1::SessionInfo& info,
                                            int64_t layer, int64_t tokens,
                                            int64_t query_tokens,
                                            uint64_t seed) {
  if (tokens < 0 || tokens > kMaxRandomDim || query_tokens < 0 ||
      query_tokens > kMaxRandomDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tokens and --query_tokens are ", tokens, " and ",
                     query_tokens, ", expected 0 to 2^20"));
  }
  ATTNSERVE_ASSIGN_OR_RETURN(const v1::DType dtype, InputDType());
  StepInputs inputs;
  inputs.layer = layer;
  ATTNSERVE_ASSIGN_OR_RETURN(inputs.options, StepOptionsFromFlags());
  std::mt19937_64 generator(seed);
  const int64_t h = info.num_heads(), hkv = info.num_kv_heads(),
                dk = info.key_dim(), dv = info.value_dim();
  if (tokens > 0) {
    ATTNSERVE_ASSIGN_OR_RETURN(
        inputs.key, RandomTensor(dtype, {hkv, tokens, dk}, generator));
    ATTNSERVE_ASSIGN_OR_RETURN(
        inputs.value, RandomTensor(dtype, {hkv, tokens, dv}, generator));
  }
  if (query_tokens > 0) {
    ATTNSERVE_ASSIGN_OR_RETURN(
        inputs.query, RandomTensor(dtype, {h, query_tokens, dk}, generator));
  }
  return inputs;
}

absl::StatusOr<v1::AttendRequest> RandomDecodeAttendRequest(
    const v1::SessionInfo& info, int64_t batch, int64_t key_len,
    uint64_t seed) {
  ATTNSERVE_ASSIGN_OR_RETURN(const v1::DType dtype, InputDType());
  ATTNSERVE_ASSIGN_OR_RETURN(const v1::StepOptions step,
                             StepOptionsFromFlags());
  v1::AttendRequest request;
  v1::AttentionOptions& options = *request.mutable_options();
  if (step.has_scale()) options.set_scale(step.scale());
  options.set_precision(step.precision());
  options.set_return_lse(step.return_lse());
  options.set_output_dtype(step.output_dtype());
  std::mt19937_64 generator(seed);
  const int64_t h = info.num_heads(), hkv = info.num_kv_heads(),
                dk = info.key_dim(), dv = info.value_dim();
  ATTNSERVE_ASSIGN_OR_RETURN(*request.mutable_query(),
                             RandomTensor(dtype, {batch, h, 1, dk}, generator));
  ATTNSERVE_ASSIGN_OR_RETURN(
      *request.mutable_key(),
      RandomTensor(dtype, {batch, hkv, key_len, dk}, generator));
  ATTNSERVE_ASSIGN_OR_RETURN(
      *request.mutable_value(),
      RandomTensor(dtype, {batch, hkv, key_len, dv}, generator));
  return request;
}

absl::StatusOr<StepInputs> StepInputsFromFlags(const v1::SessionInfo& info) {
  const std::string paths[] = {absl::GetFlag(FLAGS_key),
                               absl::GetFlag(FLAGS_value),
                               absl::GetFlag(FLAGS_query)};
  const bool any_file =
      !paths[0].empty() || !paths[1].empty() || !paths[2].empty();
  ATTNSERVE_ASSIGN_OR_RETURN(const bool random,
                             UseRandomInputs(InputMode::kFilesOrDemo, any_file,
                                             "--key/--value/--query"));
  const int64_t layer = absl::GetFlag(FLAGS_layer);
  if (random) {
    return RandomStepInputs(info, layer, absl::GetFlag(FLAGS_tokens),
                            absl::GetFlag(FLAGS_query_tokens),
                            absl::GetFlag(FLAGS_seed));
  }
  if (paths[0].empty() != paths[1].empty()) {
    return absl::InvalidArgumentError("--key and --value are needed together");
  }
  StepInputs inputs;
  inputs.layer = layer;
  ATTNSERVE_ASSIGN_OR_RETURN(inputs.options, StepOptionsFromFlags());
  const TensorReadOptions read_options = InputReadOptions();
  if (!paths[0].empty()) {
    ATTNSERVE_ASSIGN_OR_RETURN(inputs.key,
                               ReadTensorFile(paths[0], read_options));
    ATTNSERVE_ASSIGN_OR_RETURN(inputs.value,
                               ReadTensorFile(paths[1], read_options));
  }
  if (!paths[2].empty()) {
    ATTNSERVE_ASSIGN_OR_RETURN(inputs.query,
                               ReadTensorFile(paths[2], read_options));
  }
  return inputs;
}

TensorReadOptions InputReadOptions() {
  TensorReadOptions options;
  options.bf16_as_uint16 = absl::GetFlag(FLAGS_bf16_as_uint16);
  options.max_file_bytes = MaxInputFileBytes();
  return options;
}

absl::StatusOr<v1::AttentionOptions> AttentionOptionsFromFlags() {
  v1::AttentionOptions options;
  ATTNSERVE_RETURN_IF_ERROR(SetScaleAndKeyLengths(&options));
  ATTNSERVE_RETURN_IF_ERROR(SetChoices(&options));
  ATTNSERVE_RETURN_IF_ERROR(SetVariant(&options));
  options.set_causal(absl::GetFlag(FLAGS_causal));
  options.set_return_lse(absl::GetFlag(FLAGS_return_lse));
  const std::string mask_path = absl::GetFlag(FLAGS_attn_mask);
  if (!mask_path.empty()) {
    TensorReadOptions read_options = InputReadOptions();
    read_options.allow_bool = true;
    ATTNSERVE_ASSIGN_OR_RETURN(*options.mutable_attn_mask(),
                               ReadTensorFile(mask_path, read_options));
  }
  return options;
}

absl::StatusOr<v1::AttendRequest> AttendRequestFromFlags(InputMode mode) {
  const std::string paths[] = {absl::GetFlag(FLAGS_query),
                               absl::GetFlag(FLAGS_key),
                               absl::GetFlag(FLAGS_value)};
  const bool any_file =
      !paths[0].empty() || !paths[1].empty() || !paths[2].empty();
  ATTNSERVE_ASSIGN_OR_RETURN(
      const bool random,
      UseRandomInputs(mode, any_file, "--query/--key/--value"));
  v1::AttendRequest request;
  ATTNSERVE_ASSIGN_OR_RETURN(*request.mutable_options(),
                             AttentionOptionsFromFlags());
  if (random) {
    ATTNSERVE_RETURN_IF_ERROR(SetRandomAttendInputs(&request));
    return request;
  }
  if (paths[0].empty() || paths[1].empty() || paths[2].empty()) {
    return absl::InvalidArgumentError(
        "--query, --key and --value are needed together");
  }
  const TensorReadOptions read_options = InputReadOptions();
  ATTNSERVE_ASSIGN_OR_RETURN(*request.mutable_query(),
                             ReadTensorFile(paths[0], read_options));
  ATTNSERVE_ASSIGN_OR_RETURN(*request.mutable_key(),
                             ReadTensorFile(paths[1], read_options));
  ATTNSERVE_ASSIGN_OR_RETURN(*request.mutable_value(),
                             ReadTensorFile(paths[2], read_options));
  return request;
}

absl::StatusOr<MultiHeadDraft> MultiHeadDraftFromFlags(InputMode mode) {
  const std::string query_path = absl::GetFlag(FLAGS_query_input);
  const std::string kv_path = absl::GetFlag(FLAGS_kv_input);
  ATTNSERVE_ASSIGN_OR_RETURN(
      const bool random,
      UseRandomInputs(mode, !query_path.empty() || !kv_path.empty(),
                      "--query_input/--kv_input"));
  MultiHeadDraft draft;
  draft.needs_random_inputs = random;
  v1::MultiHeadAttentionRequest& request = draft.request;
  ATTNSERVE_ASSIGN_OR_RETURN(*request.mutable_options(),
                             AttentionOptionsFromFlags());

  const std::string name = absl::GetFlag(FLAGS_weights_name);
  const std::string folder = absl::GetFlag(FLAGS_weights_dir);
  const TensorReadOptions read_options = InputReadOptions();
  if (!name.empty() && !folder.empty()) {
    return absl::InvalidArgumentError(
        "--weights_name and --weights_dir exclude each other");
  }
  if (!folder.empty()) {
    ATTNSERVE_ASSIGN_OR_RETURN(*request.mutable_weights(),
                               ReadWeightsFolder(folder, read_options));
    // A set that cannot be described is a file that cannot be used, refused
    // here (exit 2) rather than by the server or by WeightsInfoFor (exit 1).
    const absl::StatusOr<v1::WeightsInfo> described =
        DescribeWeights(request.weights());
    if (!described.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--weights_dir=", folder, ": ", described.status().message()));
    }
  } else {
    request.set_weights_name(name.empty() ? "demo" : name);
  }

  if (random) return draft;
  if (query_path.empty()) {
    return absl::InvalidArgumentError("--kv_input needs --query_input");
  }
  ATTNSERVE_ASSIGN_OR_RETURN(*request.mutable_query_input(),
                             ReadTensorFile(query_path, read_options));
  if (!kv_path.empty()) {
    ATTNSERVE_ASSIGN_OR_RETURN(*request.mutable_kv_input(),
                               ReadTensorFile(kv_path, read_options));
  }
  return draft;
}

absl::Status AddRandomMultiHeadInputs(const v1::WeightsInfo& weights,
                                      v1::MultiHeadAttentionRequest* request) {
  const int64_t b = absl::GetFlag(FLAGS_batch),
                lq = absl::GetFlag(FLAGS_query_len),
                lk = absl::GetFlag(FLAGS_key_len);
  const bool cross = weights.kv_embed_dim() != weights.embed_dim();
  ATTNSERVE_RETURN_IF_ERROR(CheckRandomDims(
      {{"--batch", b},
       {"--query_len", lq},
       {"--key_len", cross ? lk : 1},
       {"the weight set's embed_dim", weights.embed_dim()},
       {"the weight set's kv_embed_dim", weights.kv_embed_dim()}}));
  ATTNSERVE_ASSIGN_OR_RETURN(const v1::DType dtype, InputDType());
  std::mt19937_64 generator(absl::GetFlag(FLAGS_seed));
  ATTNSERVE_ASSIGN_OR_RETURN(
      *request->mutable_query_input(),
      RandomTensor(dtype, {b, lq, weights.embed_dim()}, generator));
  if (cross) {
    ATTNSERVE_ASSIGN_OR_RETURN(
        *request->mutable_kv_input(),
        RandomTensor(dtype, {b, lk, weights.kv_embed_dim()}, generator));
  }
  return absl::OkStatus();
}

}  // namespace attnserve
