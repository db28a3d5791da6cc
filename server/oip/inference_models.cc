#include "attnserve/server/oip/inference_models.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "attnserve/common/echo.h"
#include "attnserve/common/refusals.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/core/attention_types.h"

namespace attnserve::oip {

namespace {

using ::inference::InferParameter;
using ::inference::ModelInferRequest;

absl::Status Invalid(absl::string_view message) {
  return absl::InvalidArgumentError(message);
}

std::optional<v1::DType> DtypeOf(const std::string& datatype) {
  if (datatype == "FP32") return v1::FLOAT32;
  if (datatype == "FP16") return v1::FLOAT16;
  if (datatype == "BF16") return v1::BFLOAT16;
  if (datatype == "BOOL") return v1::BOOL;
  return std::nullopt;
}

const char* DatatypeOf(v1::DType dtype) {
  switch (dtype) {
    case v1::FLOAT32:
      return "FP32";
    case v1::FLOAT16:
      return "FP16";
    case v1::BFLOAT16:
      return "BF16";
    case v1::BOOL:
      return "BOOL";
    default:
      return "FP32";
  }
}

// Triton's own request parameters, which attnserve has no use for.
bool IsIgnoredParameter(const std::string& name) {
  return name == "priority" || name == "timeout" || name == "sequence_id" ||
         name == "sequence_start" || name == "sequence_end";
}

const char* ParameterKind(const InferParameter& parameter) {
  switch (parameter.parameter_choice_case()) {
    case InferParameter::kBoolParam:
      return "a bool";
    case InferParameter::kInt64Param:
      return "an int64";
    case InferParameter::kStringParam:
      return "a string";
    case InferParameter::kDoubleParam:
      return "a double";
    case InferParameter::kUint64Param:
      return "a uint64";
    default:
      return "empty";
  }
}

absl::Status WrongKind(const std::string& name, const InferParameter& parameter,
                       absl::string_view expected) {
  return Invalid(absl::StrCat("parameter ", name, " is ",
                              ParameterKind(parameter), ", expected ",
                              expected));
}

absl::StatusOr<bool> BoolParameter(const std::string& name,
                                   const InferParameter& parameter) {
  if (parameter.parameter_choice_case() != InferParameter::kBoolParam) {
    return WrongKind(name, parameter, "a bool");
  }
  return parameter.bool_param();
}

// One of `choices` (a string parameter), as its index.
absl::StatusOr<int> ChoiceParameter(const std::string& name,
                                    const InferParameter& parameter,
                                    std::vector<absl::string_view> choices) {
  const std::string expected =
      absl::StrCat("one of ", absl::StrJoin(choices, ", "));
  if (parameter.parameter_choice_case() != InferParameter::kStringParam) {
    return WrongKind(name, parameter, absl::StrCat("a string, ", expected));
  }
  for (size_t i = 0; i < choices.size(); ++i) {
    if (parameter.string_param() == choices[i]) return static_cast<int>(i);
  }
  return Invalid(absl::StrCat("parameter ", name, " is ",
                              EchoText(parameter.string_param()), ", expected ",
                              expected));
}

// A double parameter the options hold as a float: a finite double past
// float's range would be read as infinite, and refused as such.
absl::Status CheckFloatRange(const std::string& name,
                             const InferParameter& parameter) {
  const double value = parameter.double_param();
  // Infinities and NaN are refused by name later.
  if (!std::isfinite(value)) return absl::OkStatus();
  if (std::abs(value) > std::numeric_limits<float>::max()) {
    return Invalid(absl::StrCat("parameter ", name, " is ", value,
                                ", expected a finite number within float32's "
                                "range (at most 3.4e38 in magnitude)"));
  }
  // A value float32 rounds to 0 would be refused (or taken as unset) as 0,
  // a value the client did not send.
  if (value != 0 && static_cast<float>(value) == 0) {
    return Invalid(absl::StrCat(
        "parameter ", name, " is ", value,
        ", which float32 rounds to 0; expected 0 or a number float32 holds "
        "(from about 1e-45 in magnitude)"));
  }
  return absl::OkStatus();
}

// The request's parameters as options; LSE and WEIGHTS asked as outputs turn
// their options on.
absl::Status ApplyParameters(const ModelInferRequest& request,
                             v1::AttentionOptions* options) {
  for (const auto& [name, parameter] : request.parameters()) {
    if (name == "causal") {
      ATTNSERVE_ASSIGN_OR_RETURN(const bool causal,
                                 BoolParameter(name, parameter));
      options->set_causal(causal);
    } else if (name == "causal_alignment") {
      ATTNSERVE_ASSIGN_OR_RETURN(
          const int alignment,
          ChoiceParameter(name, parameter, {"top_left", "bottom_right"}));
      options->set_causal_alignment(alignment == 0
                                        ? v1::AttentionOptions::TOP_LEFT
                                        : v1::AttentionOptions::BOTTOM_RIGHT);
    } else if (name == "scale") {
      if (parameter.parameter_choice_case() == InferParameter::kDoubleParam) {
        ATTNSERVE_RETURN_IF_ERROR(CheckFloatRange(name, parameter));
        options->set_scale(static_cast<float>(parameter.double_param()));
      } else if (parameter.parameter_choice_case() ==
                 InferParameter::kInt64Param) {
        options->set_scale(static_cast<float>(parameter.int64_param()));
      } else {
        return WrongKind(name, parameter, "a double or an int64");
      }
    } else if (name == "window_left" || name == "window_right" ||
               name == "num_sink_tokens") {
      if (parameter.parameter_choice_case() != InferParameter::kInt64Param) {
        return WrongKind(name, parameter, "an int64");
      }
      const int64_t value = parameter.int64_param();
      if (name == "window_left") {
        options->set_window_left(value);
      } else if (name == "window_right") {
        options->set_window_right(value);
      } else {
        options->set_num_sink_tokens(value);
      }
    } else if (name == "softcap") {
      if (parameter.parameter_choice_case() == InferParameter::kDoubleParam) {
        ATTNSERVE_RETURN_IF_ERROR(CheckFloatRange(name, parameter));
        // Refused here, as sent: the native check would name the float it
        // became (1e-40 as 9.9999461e-41).
        const double value = parameter.double_param();
        if (std::isfinite(value) && value < kMinSoftcap) {
          return Invalid(absl::StrCat(
              "parameter softcap is ", value, ", expected a finite number >= ",
              absl::StrFormat("%.9g", kMinSoftcap),
              " (the smallest normal float), or absent for none"));
        }
        options->set_softcap(static_cast<float>(value));
      } else if (parameter.parameter_choice_case() ==
                 InferParameter::kInt64Param) {
        options->set_softcap(static_cast<float>(parameter.int64_param()));
      } else {
        return WrongKind(name, parameter, "a double or an int64");
      }
    } else if (name == "return_lse") {
      ATTNSERVE_ASSIGN_OR_RETURN(const bool lse,
                                 BoolParameter(name, parameter));
      options->set_return_lse(lse);
    } else if (name == "return_weights") {
      ATTNSERVE_ASSIGN_OR_RETURN(
          const int mode,
          ChoiceParameter(name, parameter, {"none", "per_head", "head_mean"}));
      options->set_return_weights(
          static_cast<v1::AttentionOptions::ReturnWeights>(mode));
    } else if (name == "precision") {
      ATTNSERVE_ASSIGN_OR_RETURN(
          const int precision,
          ChoiceParameter(name, parameter, {"f32", "bf16"}));
      options->set_precision(precision == 0 ? v1::AttentionOptions::F32
                                            : v1::AttentionOptions::BF16);
    } else if (name == "output_dtype") {
      ATTNSERVE_ASSIGN_OR_RETURN(
          const int dtype,
          ChoiceParameter(name, parameter, {"FP32", "BF16", "FP16"}));
      options->set_output_dtype(static_cast<v1::DType>(dtype + 1));
    } else if (!IsIgnoredParameter(name)) {
      return Invalid(absl::StrCat(
          "parameter ", EchoText(name),
          " is not one of causal, causal_alignment, scale, window_left, "
          "window_right, num_sink_tokens, softcap, return_lse, "
          "return_weights, precision, output_dtype"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<RequestedOutputs> OutputsAsked(const ModelInferRequest& request,
                                              v1::AttentionOptions* options) {
  RequestedOutputs asked;
  if (request.outputs_size() == 0) {
    asked.lse = options->return_lse();
    asked.weights = options->return_weights() != v1::AttentionOptions::NONE;
    return asked;
  }
  asked.output = false;
  for (const auto& output : request.outputs()) {
    if (output.name() == "OUTPUT") {
      asked.output = true;
    } else if (output.name() == "LSE") {
      asked.lse = true;
      options->set_return_lse(true);
    } else if (output.name() == "WEIGHTS") {
      asked.weights = true;
      if (options->return_weights() == v1::AttentionOptions::NONE) {
        options->set_return_weights(v1::AttentionOptions::PER_HEAD);
      }
    } else {
      return Invalid(absl::StrCat("outputs: ", EchoText(output.name()),
                                  " is not one of OUTPUT, LSE, WEIGHTS"));
    }
  }
  // What the parameters ask but the list leaves out is neither computed nor
  // counted in the answer's size (the weights were, and refused a request
  // whose answer fit, a review found).
  if (!asked.lse) options->set_return_lse(false);
  if (!asked.weights) options->set_return_weights(v1::AttentionOptions::NONE);
  return asked;
}

// Packs `values` as little-endian bytes (the host's order, x86 and arm64).
template <typename T>
std::string Packed(const google::protobuf::RepeatedField<T>& values) {
  std::string bytes(static_cast<size_t>(values.size()) * sizeof(T), '\0');
  if (!bytes.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// The typed contents field of `datatype` ("": none, FP16 and BF16 travel only
// raw, as the protocol says).
std::string ContentsField(const std::string& datatype) {
  if (datatype == "FP32") return "fp32_contents";
  if (datatype == "INT64") return "int64_contents";
  if (datatype == "BOOL") return "bool_contents";
  return "";
}

// The typed contents fields an input's values may not be in, for `datatype`:
// the name of the first that holds any, or null.
const char* StrayContents(const inference::InferTensorContents& contents,
                          const std::string& datatype) {
  const std::pair<const char*, int> fields[] = {
      {"bool_contents", contents.bool_contents_size()},
      {"int_contents", contents.int_contents_size()},
      {"int64_contents", contents.int64_contents_size()},
      {"uint_contents", contents.uint_contents_size()},
      {"uint64_contents", contents.uint64_contents_size()},
      {"fp32_contents", contents.fp32_contents_size()},
      {"fp64_contents", contents.fp64_contents_size()},
      {"bytes_contents", contents.bytes_contents_size()},
  };
  const std::string own = ContentsField(datatype);
  for (const auto& [field, size] : fields) {
    if (size > 0 && own != field) return field;
  }
  return nullptr;
}

// Input `index`'s bytes: its raw_input_contents entry (moved out), or its
// typed contents packed.
absl::StatusOr<std::string> TakeBytes(ModelInferRequest& request, int index,
                                      const std::string& datatype) {
  const auto& input = request.inputs(index);
  if (request.raw_input_contents_size() > 0) {
    if (input.has_contents()) {
      return Invalid(absl::StrCat("input ", input.name(),
                                  " has contents, but the request uses "
                                  "raw_input_contents for its inputs"));
    }
    return std::move(*request.mutable_raw_input_contents(index));
  }
  const auto& contents = input.contents();
  if (const char* stray = StrayContents(contents, datatype)) {
    return Invalid(
        absl::StrCat("input ", input.name(), " is ", datatype,
                     " and holds values in ", stray, ", expected them in ",
                     ContentsField(datatype).empty()
                         ? std::string("raw_input_contents (its only form)")
                         : absl::StrCat("contents.", ContentsField(datatype),
                                        " or raw_input_contents")));
  }
  // Packed, the values are let go: the request holds one tensor twice at
  // most, not every tensor twice until it ends.
  inference::InferTensorContents* typed =
      request.mutable_inputs(index)->mutable_contents();
  if (datatype == "FP32") {
    std::string bytes = Packed(typed->fp32_contents());
    google::protobuf::RepeatedField<float>().Swap(
        typed->mutable_fp32_contents());
    return bytes;
  }
  if (datatype == "INT64") {
    std::string bytes = Packed(typed->int64_contents());
    google::protobuf::RepeatedField<int64_t>().Swap(
        typed->mutable_int64_contents());
    return bytes;
  }
  if (datatype == "BOOL") {
    std::string bytes;
    bytes.reserve(static_cast<size_t>(typed->bool_contents_size()));
    for (const bool value : typed->bool_contents()) bytes.push_back(value);
    google::protobuf::RepeatedField<bool>().Swap(
        typed->mutable_bool_contents());
    return bytes;
  }
  return Invalid(absl::StrCat("input ", input.name(), " is ", datatype,
                              ", which travels only in raw_input_contents"));
}

// Input `index` as a native tensor of one of `allowed` datatypes.
absl::StatusOr<v1::Tensor> TakeTensor(ModelInferRequest& request, int index,
                                      std::vector<absl::string_view> allowed) {
  const auto& input = request.inputs(index);
  const std::string datatype = input.datatype();
  bool ok = false;
  for (absl::string_view name : allowed) ok = ok || datatype == name;
  if (!ok) {
    return Invalid(absl::StrCat("input ", input.name(), " is ",
                                EchoText(datatype), ", expected one of ",
                                absl::StrJoin(allowed, ", ")));
  }
  v1::Tensor tensor;
  tensor.set_dtype(*DtypeOf(datatype));
  *tensor.mutable_shape() = input.shape();
  ATTNSERVE_ASSIGN_OR_RETURN(*tensor.mutable_data(),
                             TakeBytes(request, index, datatype));
  return tensor;
}

// KEY_LENGTHS: INT64 [B].
absl::Status TakeKeyLengths(ModelInferRequest& request, int index,
                            v1::AttentionOptions* options) {
  const auto& input = request.inputs(index);
  if (input.datatype() != "INT64") {
    return Invalid(absl::StrCat("input KEY_LENGTHS is ",
                                EchoText(input.datatype()),
                                ", expected INT64"));
  }
  if (input.shape_size() != 1) {
    return Invalid(absl::StrCat("input KEY_LENGTHS has ", input.shape_size(),
                                " dimensions, expected 1: [B]"));
  }
  // An empty one would read as no KEY_LENGTHS at all.
  if (input.shape(0) < 1) {
    return Invalid(absl::StrCat("input KEY_LENGTHS has shape [", input.shape(0),
                                "], expected [B]: one length per batch entry"));
  }
  ATTNSERVE_ASSIGN_OR_RETURN(const std::string bytes,
                             TakeBytes(request, index, "INT64"));
  if (bytes.size() % 8 != 0 ||
      static_cast<int64_t>(bytes.size() / 8) != input.shape(0)) {
    return Invalid(absl::StrCat("input KEY_LENGTHS holds ", bytes.size(),
                                " bytes, expected 8 for each of its ",
                                input.shape(0)));
  }
  options->mutable_key_lengths()->Resize(input.shape(0), 0);
  std::memcpy(options->mutable_key_lengths()->mutable_data(), bytes.data(),
              bytes.size());
  return absl::OkStatus();
}

// What a request asks beyond its inputs' values: raw_input_contents for
// every input or none, an id the answer can echo, and no tensor parameters
// (Triton's shared memory and classification, which attnserve does not
// offer; an output's binary_data, HTTP's, means nothing on gRPC, where
// outputs always travel raw).
absl::Status CheckRequest(const ModelInferRequest& request) {
  if (request.raw_input_contents_size() > 0 &&
      request.raw_input_contents_size() != request.inputs_size()) {
    return Invalid(absl::StrCat("raw_input_contents holds ",
                                request.raw_input_contents_size(),
                                " entries for ", request.inputs_size(),
                                " inputs: either every input's bytes or none"));
  }
  if (request.id().size() > kMaxInferIdBytes) {
    return Invalid(absl::StrCat("id is ", request.id().size(),
                                " bytes, expected at most ", kMaxInferIdBytes,
                                " (the answer echoes it)"));
  }
  for (int i = 0; i < request.inputs_size(); ++i) {
    const inference::ModelInferRequest::InferInputTensor& input =
        request.inputs(i);
    for (const auto& [name, parameter] : input.parameters()) {
      // The byte count of the input's raw_input_contents entry, which
      // KServe's and Triton's clients send with every binary input (a
      // binding's framing that gRPC's does not need): checked, not used.
      if (name == "binary_data_size") {
        const int64_t entry_bytes =
            request.raw_input_contents_size() > i
                ? static_cast<int64_t>(request.raw_input_contents(i).size())
                : -1;
        if (parameter.parameter_choice_case() !=
                inference::InferParameter::kInt64Param ||
            parameter.int64_param() != entry_bytes) {
          return Invalid(absl::StrCat(
              "input ", EchoText(input.name()),
              " has parameter binary_data_size, expected it an int64_param ",
              entry_bytes < 0
                  ? "of an input in raw_input_contents (this one is not)"
                  : absl::StrCat("equal to its raw_input_contents entry's ",
                                 entry_bytes, " bytes")));
        }
        continue;
      }
      return Invalid(absl::StrCat(
          "input ", EchoText(input.name()), " has parameter ", EchoText(name),
          ", expected none or binary_data_size (attnserve reads inputs from "
          "the request: no shared memory)"));
    }
  }
  for (const auto& output : request.outputs()) {
    for (const auto& [name, parameter] : output.parameters()) {
      if (name == "binary_data") {
        if (parameter.parameter_choice_case() !=
            inference::InferParameter::kBoolParam) {
          return Invalid(absl::StrCat(
              "output ", EchoText(output.name()),
              " has parameter binary_data, expected a bool_param (attnserve "
              "answers in raw_output_contents either way)"));
        }
        continue;
      }
      return Invalid(absl::StrCat(
          "output ", EchoText(output.name()), " has parameter ", EchoText(name),
          ", expected none or binary_data (attnserve answers whole tensors "
          "in raw_output_contents: no classification, no shared memory)"));
    }
  }
  return absl::OkStatus();
}

// The index of each of `names` among the request's inputs (-1: absent).
// INVALID_ARGUMENT for an input not in `names`, or one given twice.
absl::StatusOr<std::vector<int>> FindInputs(
    const ModelInferRequest& request, const std::string& model,
    const std::vector<absl::string_view>& names) {
  std::vector<int> at(names.size(), -1);
  for (int i = 0; i < request.inputs_size(); ++i) {
    const std::string& name = request.inputs(i).name();
    size_t which = names.size();
    for (size_t n = 0; n < names.size(); ++n) {
      if (name == names[n]) which = n;
    }
    if (which == names.size()) {
      return Invalid(absl::StrCat("input ", EchoText(name), " is not one of ",
                                  model, "'s: ", absl::StrJoin(names, ", ")));
    }
    if (at[which] >= 0) {
      return Invalid(absl::StrCat("input ", name, " is given twice"));
    }
    at[which] = i;
  }
  return at;
}

absl::Status Missing(absl::string_view name) {
  return Invalid(absl::StrCat("input ", name, " is missing"));
}

inference::ModelMetadataResponse::TensorMetadata Metadata(
    absl::string_view name, absl::string_view datatype,
    std::vector<int64_t> shape) {
  inference::ModelMetadataResponse::TensorMetadata tensor;
  tensor.set_name(std::string(name));
  tensor.set_datatype(std::string(datatype));
  for (int64_t dim : shape) tensor.add_shape(dim);
  return tensor;
}

void AddInput(inference::ModelConfig* config, absl::string_view name,
              inference::DataType type, std::vector<int64_t> dims,
              bool optional) {
  inference::ModelInput* input = config->add_input();
  input->set_name(std::string(name));
  input->set_data_type(type);
  for (int64_t dim : dims) input->add_dims(dim);
  input->set_optional(optional);
}

void AddOutput(inference::ModelConfig* config, absl::string_view name,
               std::vector<int64_t> dims) {
  inference::ModelOutput* output = config->add_output();
  output->set_name(std::string(name));
  output->set_data_type(inference::TYPE_FP32);
  for (int64_t dim : dims) output->add_dims(dim);
}

// Replaces each whole `from` (starting a word) in `text` with `to`.
void Rename(std::string* text, absl::string_view from, absl::string_view to) {
  size_t at = 0;
  while ((at = text->find(from.data(), at, from.size())) != std::string::npos) {
    const bool starts_word =
        at == 0 ||
        !(std::isalnum(static_cast<unsigned char>((*text)[at - 1])) ||
          (*text)[at - 1] == '_' || (*text)[at - 1] == '.');
    if (starts_word) {
      text->replace(at, from.size(), to.data(), to.size());
      at += to.size();
    } else {
      at += from.size();
    }
  }
}

// A field named alone ("query is missing", "key has 9 elements"), not the
// word in prose ("H / Hkv query heads").
void RenameField(std::string* text, absl::string_view from,
                 absl::string_view to) {
  for (absl::string_view verb : {" is ", " has "}) {
    Rename(text, absl::StrCat(from, verb), absl::StrCat(to, verb));
  }
}

}  // namespace

int64_t TypedContentsBytes(const ModelInferRequest& request) {
  int64_t bytes = 0;
  for (const auto& input : request.inputs()) {
    const inference::InferTensorContents& contents = input.contents();
    bytes += int64_t{4} * contents.fp32_contents_size() +
             int64_t{8} * contents.int64_contents_size() +
             contents.bool_contents_size();
  }
  return bytes;
}

absl::StatusOr<v1::AttendRequest> AttendRequestFrom(ModelInferRequest& request,
                                                    RequestedOutputs* outputs) {
  ATTNSERVE_RETURN_IF_ERROR(CheckRequest(request));
  ATTNSERVE_ASSIGN_OR_RETURN(
      const std::vector<int> at,
      FindInputs(request, kSdpaModel,
                 {"QUERY", "KEY", "VALUE", "ATTN_MASK", "KEY_LENGTHS"}));
  const char* const required[] = {"QUERY", "KEY", "VALUE"};
  for (int i = 0; i < 3; ++i) {
    if (at[i] < 0) return Missing(required[i]);
  }
  v1::AttendRequest attend;
  const std::vector<absl::string_view> floats = {"FP32", "FP16", "BF16"};
  ATTNSERVE_ASSIGN_OR_RETURN(*attend.mutable_query(),
                             TakeTensor(request, at[0], floats));
  ATTNSERVE_ASSIGN_OR_RETURN(*attend.mutable_key(),
                             TakeTensor(request, at[1], floats));
  ATTNSERVE_ASSIGN_OR_RETURN(*attend.mutable_value(),
                             TakeTensor(request, at[2], floats));
  v1::AttentionOptions* options = attend.mutable_options();
  if (at[3] >= 0) {
    ATTNSERVE_ASSIGN_OR_RETURN(
        *options->mutable_attn_mask(),
        TakeTensor(request, at[3], {"BOOL", "FP32", "FP16", "BF16"}));
  }
  if (at[4] >= 0)
    ATTNSERVE_RETURN_IF_ERROR(TakeKeyLengths(request, at[4], options));
  ATTNSERVE_RETURN_IF_ERROR(ApplyParameters(request, options));
  ATTNSERVE_ASSIGN_OR_RETURN(*outputs, OutputsAsked(request, options));
  return attend;
}

absl::StatusOr<v1::MultiHeadAttentionRequest> MultiHeadRequestFrom(
    ModelInferRequest& request, RequestedOutputs* outputs) {
  ATTNSERVE_RETURN_IF_ERROR(CheckRequest(request));
  ATTNSERVE_ASSIGN_OR_RETURN(const std::vector<int> at,
                             FindInputs(request, EchoText(request.model_name()),
                                        {"INPUT", "KV_INPUT"}));
  if (at[0] < 0) return Missing("INPUT");
  v1::MultiHeadAttentionRequest mha;
  mha.set_weights_name(request.model_name());
  if (!request.model_version().empty()) {
    int64_t version = 0;
    if (!absl::SimpleAtoi(request.model_version(), &version) || version <= 0) {
      return Invalid(absl::StrCat("model_version is ",
                                  EchoText(request.model_version()),
                                  ", expected a version number or empty"));
    }
    mha.set_weights_version(version);
  }
  const std::vector<absl::string_view> floats = {"FP32", "FP16", "BF16"};
  ATTNSERVE_ASSIGN_OR_RETURN(*mha.mutable_query_input(),
                             TakeTensor(request, at[0], floats));
  if (at[1] >= 0) {
    ATTNSERVE_ASSIGN_OR_RETURN(*mha.mutable_kv_input(),
                               TakeTensor(request, at[1], floats));
  }
  ATTNSERVE_RETURN_IF_ERROR(ApplyParameters(request, mha.mutable_options()));
  ATTNSERVE_ASSIGN_OR_RETURN(*outputs,
                             OutputsAsked(request, mha.mutable_options()));
  return mha;
}

void FillInferResponse(const ModelInferRequest& request,
                       const std::string& version,
                       const RequestedOutputs& outputs, v1::Tensor* output,
                       v1::Tensor* lse, v1::Tensor* weights,
                       inference::ModelInferResponse* response) {
  response->set_model_name(request.model_name());
  response->set_model_version(version);
  response->set_id(request.id());
  const auto add = [response](const char* name, v1::Tensor* tensor) {
    auto* out = response->add_outputs();
    out->set_name(name);
    out->set_datatype(DatatypeOf(tensor->dtype()));
    *out->mutable_shape() = tensor->shape();
    response->add_raw_output_contents()->swap(*tensor->mutable_data());
  };
  if (outputs.output) add("OUTPUT", output);
  if (outputs.lse) add("LSE", lse);
  if (outputs.weights) add("WEIGHTS", weights);
}

absl::Status InProtocolNames(const absl::Status& status, bool weight_set) {
  if (status.ok()) return status;
  std::string message(status.message());
  Rename(&message, "options.attn_mask", "ATTN_MASK");
  Rename(&message, "options.key_lengths", "KEY_LENGTHS");
  Rename(&message, "options.", "parameter ");
  if (weight_set) {
    Rename(&message, "query_input.", "INPUT.");
    Rename(&message, "kv_input.", "KV_INPUT.");
    RenameField(&message, "query_input", "INPUT");
    RenameField(&message, "kv_input", "KV_INPUT");
    // The native refusal of a pinned version, in the protocol's terms.
    Rename(&message, "weights_name '", "model '");
    Rename(&message, "send weights_version 0 for any",
           "send an empty model_version for any");
    Rename(&message, "weights_version", "model_version");
  } else {
    Rename(&message, "query.", "QUERY.");
    Rename(&message, "key.", "KEY.");
    Rename(&message, "value.", "VALUE.");
    RenameField(&message, "query", "QUERY");
    RenameField(&message, "key", "KEY");
    RenameField(&message, "value", "VALUE");
  }
  // A tensor's bytes are an input's raw_input_contents entry or contents.
  for (const char* input :
       {"QUERY", "KEY", "VALUE", "ATTN_MASK", "INPUT", "KV_INPUT"}) {
    Rename(&message, absl::StrCat(input, ".data has"),
           absl::StrCat("input ", input,
                        "'s data (raw_input_contents or contents) has"));
  }
  // And its datatype is the protocol's.
  for (const auto& [native, protocol] : {std::pair{"FLOAT32", "FP32"},
                                         {"BFLOAT16", "BF16"},
                                         {"FLOAT16", "FP16"}}) {
    Rename(&message, absl::StrCat("bytes of ", native, ")"),
           absl::StrCat("bytes of ", protocol, ")"));
    Rename(&message, absl::StrCat("its ", native, " data"),
           absl::StrCat("its ", protocol, " data"));
  }
  return Reworded(status, message);
}

inference::ModelMetadataResponse SdpaMetadata() {
  inference::ModelMetadataResponse metadata;
  metadata.set_name(kSdpaModel);
  metadata.add_versions(kSdpaVersion);
  metadata.set_platform(kPlatform);
  for (const char* name : {"QUERY", "KEY", "VALUE"}) {
    *metadata.add_inputs() = Metadata(name, "FP32", {-1, -1, -1, -1});
  }
  *metadata.add_inputs() = Metadata("ATTN_MASK", "BOOL", {-1, -1, -1, -1});
  *metadata.add_inputs() = Metadata("KEY_LENGTHS", "INT64", {-1});
  *metadata.add_outputs() = Metadata("OUTPUT", "FP32", {-1, -1, -1, -1});
  *metadata.add_outputs() = Metadata("LSE", "FP32", {-1, -1, -1});
  *metadata.add_outputs() = Metadata("WEIGHTS", "FP32", {-1, -1, -1, -1});
  return metadata;
}

inference::ModelMetadataResponse WeightSetMetadata(const std::string& name,
                                                   int64_t version,
                                                   const WeightsShape& shape) {
  inference::ModelMetadataResponse metadata;
  metadata.set_name(name);
  metadata.add_versions(absl::StrCat(version));
  metadata.set_platform(kPlatform);
  *metadata.add_inputs() = Metadata("INPUT", "FP32", {-1, -1, shape.embed_dim});
  *metadata.add_inputs() =
      Metadata("KV_INPUT", "FP32", {-1, -1, shape.kv_embed_dim});
  *metadata.add_outputs() =
      Metadata("OUTPUT", "FP32", {-1, -1, shape.embed_dim});
  *metadata.add_outputs() = Metadata("LSE", "FP32", {-1, shape.heads, -1});
  *metadata.add_outputs() = Metadata("WEIGHTS", "FP32", {-1, -1, -1, -1});
  return metadata;
}

inference::ModelConfig SdpaConfig() {
  inference::ModelConfig config;
  config.set_name(kSdpaModel);
  config.set_platform(kPlatform);
  config.set_backend(kPlatform);
  config.set_max_batch_size(0);  // The batch is the tensors' own first dim.
  for (const char* name : {"QUERY", "KEY", "VALUE"}) {
    AddInput(&config, name, inference::TYPE_FP32, {-1, -1, -1, -1}, false);
  }
  AddInput(&config, "ATTN_MASK", inference::TYPE_BOOL, {-1, -1, -1, -1}, true);
  AddInput(&config, "KEY_LENGTHS", inference::TYPE_INT64, {-1}, true);
  AddOutput(&config, "OUTPUT", {-1, -1, -1, -1});
  AddOutput(&config, "LSE", {-1, -1, -1});
  AddOutput(&config, "WEIGHTS", {-1, -1, -1, -1});
  return config;
}

inference::ModelConfig WeightSetConfig(const std::string& name,
                                       const WeightsShape& shape) {
  inference::ModelConfig config;
  config.set_name(name);
  config.set_platform(kPlatform);
  config.set_backend(kPlatform);
  config.set_max_batch_size(0);
  AddInput(&config, "INPUT", inference::TYPE_FP32, {-1, -1, shape.embed_dim},
           false);
  // Optional only where self-attention can do without it.
  AddInput(&config, "KV_INPUT", inference::TYPE_FP32,
           {-1, -1, shape.kv_embed_dim}, shape.kv_embed_dim == shape.embed_dim);
  AddOutput(&config, "OUTPUT", {-1, -1, shape.embed_dim});
  AddOutput(&config, "LSE", {-1, shape.heads, -1});
  AddOutput(&config, "WEIGHTS", {-1, -1, -1, -1});
  return config;
}

void InferenceStatistics::Record(const std::string& model,
                                 const std::string& version, bool succeeded,
                                 absl::Duration total, int64_t queue_us,
                                 int64_t compute_us, absl::Time when) {
  absl::MutexLock lock(&mutex_);
  auto it = models_.find({model, version});
  if (it == models_.end()) {
    if (models_.size() >= kMaxModels) {
      models_.erase(std::min_element(
          models_.begin(), models_.end(), [](const auto& a, const auto& b) {
            return a.second.recorded < b.second.recorded;
          }));
    }
    it = models_.emplace(std::make_pair(model, version), Entry()).first;
    it->second.stats.set_name(model);
    it->second.stats.set_version(version);
  }
  it->second.recorded = ++recorded_;
  inference::ModelStatistics& stats = it->second.stats;
  inference::InferStatistics* infer = stats.mutable_inference_stats();
  const auto add = [](inference::StatisticDuration* duration, int64_t ns) {
    duration->set_count(duration->count() + 1);
    duration->set_ns(duration->ns() + static_cast<uint64_t>(ns));
  };
  const int64_t total_ns = absl::ToInt64Nanoseconds(total);
  if (!succeeded) {
    add(infer->mutable_fail(), total_ns);
    return;
  }
  add(infer->mutable_success(), total_ns);
  add(infer->mutable_queue(), queue_us * 1000);
  add(infer->mutable_compute_infer(), compute_us * 1000);
  stats.set_inference_count(stats.inference_count() + 1);
  stats.set_execution_count(stats.execution_count() + 1);
  stats.set_last_inference(static_cast<uint64_t>(absl::ToUnixMillis(when)));
}

inference::ModelStatistics InferenceStatistics::Of(
    const std::string& model, const std::string& version) const {
  absl::MutexLock lock(&mutex_);
  const auto it = models_.find({model, version});
  if (it != models_.end()) return it->second.stats;
  inference::ModelStatistics stats;
  stats.set_name(model);
  stats.set_version(version);
  stats.mutable_inference_stats();
  return stats;
}

}  // namespace attnserve::oip
