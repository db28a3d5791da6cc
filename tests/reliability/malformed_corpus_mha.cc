// The malformed-input corpus beyond Attend: MultiHeadAttention (inline and
// registered weights), the weights registry, and raw bytes that are not a valid
// message at all.
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attnserve/client/client.h"
#include "reference/reference_attention.h"
#include "reliability/malformed_corpus.h"

namespace attnserve::testing {
namespace {

using Request = v1::MultiHeadAttentionRequest;
using Weights = v1::ProjectionWeights;
constexpr grpc::StatusCode kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
constexpr grpc::StatusCode kNotFound = grpc::StatusCode::NOT_FOUND;

v1::Tensor Float32(std::vector<int64_t> shape, uint64_t seed = 11) {
  int64_t elements = 1;
  for (int64_t dim : shape) elements *= dim;
  return MakeFloat32Tensor(shape, RandomValues(elements, seed));
}

// E = 8, Ekv = 6, H = 2, Hkv = 1, Dk = Dv = 4, with biases.
Weights ValidWeights() {
  Weights w;
  *w.mutable_w_q() = Float32({8, 8}, 21);
  *w.mutable_w_k() = Float32({4, 6}, 22);
  *w.mutable_w_v() = Float32({4, 6}, 23);
  *w.mutable_w_o() = Float32({8, 8}, 24);
  *w.mutable_b_q() = Float32({8}, 25);
  *w.mutable_b_k() = Float32({4}, 26);
  *w.mutable_b_v() = Float32({4}, 27);
  *w.mutable_b_o() = Float32({8}, 28);
  w.set_num_heads(2);
  w.set_num_kv_heads(1);
  return w;
}

template <typename Message>
MalformedCase Mutated(std::string name, std::string method, Message (*valid)(),
                      std::function<void(Message&)> mutate,
                      grpc::StatusCode code, std::vector<std::string> parts) {
  return {std::move(name), std::move(method),
          [valid, mutate = std::move(mutate)] {
            Message message = valid();
            mutate(message);
            return message.SerializeAsString();
          },
          code, std::move(parts)};
}

MalformedCase Mha(std::string name, std::function<void(Request&)> mutate,
                  grpc::StatusCode code, std::vector<std::string> parts) {
  return Mutated<Request>(std::move(name), "MultiHeadAttention",
                          ValidMultiHeadRequest, std::move(mutate), code,
                          std::move(parts));
}

v1::PutWeightsRequest ValidPut() {
  v1::PutWeightsRequest request;
  request.set_name("corpus.weights-1");
  *request.mutable_weights() = ValidWeights();
  return request;
}

MalformedCase Put(std::string name,
                  std::function<void(v1::PutWeightsRequest&)> mutate,
                  grpc::StatusCode code, std::vector<std::string> parts) {
  return Mutated<v1::PutWeightsRequest>(std::move(name), "PutWeights", ValidPut,
                                        std::move(mutate), code,
                                        std::move(parts));
}

// Bytes that are not a valid message of the method's request type.
MalformedCase Raw(std::string name, std::string method,
                  std::function<std::string()> body,
                  std::vector<std::string> parts) {
  return {std::move(name), std::move(method), std::move(body), kInvalid,
          std::move(parts)};
}

std::vector<MalformedCase> MultiHeadCases() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  return {
      Mha("NoWeightsAtAll", [](Request& r) { r.clear_weights(); }, kInvalid,
          {"weights and weights_name are both missing, expected one"}),
      Mha("UnknownWeightsName", [](Request& r) { r.set_weights_name("nope"); },
          kNotFound,
          {"weights_name 'nope' is not registered (ListWeights shows the "
           "names)"}),
      Mha("WeightsNameWithSpace",
          [](Request& r) { r.set_weights_name("bad name!"); }, kInvalid,
          {"weights_name is \"bad name!\", expected 1 to 128 characters of "
           "[A-Za-z0-9._-]"}),
      Mha("EmptyWeightsName", [](Request& r) { r.set_weights_name(""); },
          kInvalid, {"weights_name is \"\", expected 1 to 128 characters"}),
      Mha("WeightsNameTooLong",
          [](Request& r) { r.set_weights_name(std::string(129, 'w')); },
          kInvalid, {"weights_name is \"www", "expected 1 to 128 characters"}),
      Mha("QueryInputWrongEForDemo",
          [](Request& r) {
            r.set_weights_name("demo");
            r.clear_kv_input();
          },
          kInvalid,
          {"query_input.shape[2] (E) is 8, expected 64 (E of weights 'demo')"}),
      Mha("MissingQueryInput", [](Request& r) { r.clear_query_input(); },
          kInvalid,
          {"query_input is missing, expected a tensor of shape [B, Lq, E]"}),
      Mha("QueryInputRankFour",
          [](Request& r) {
            *r.mutable_query_input() = Float32({2, 1, 3, 8});
          },
          kInvalid,
          {"query_input.shape is [2, 1, 3, 8] with 4 dimensions, expected 3: "
           "[B, Lq, E]"}),
      Mha("QueryInputWrongE",
          [](Request& r) {
            *r.mutable_query_input() = Float32({2, 3, 7});
          },
          kInvalid,
          {"query_input.shape[2] (E) is 7, expected 8 (E of weights)"}),
      Mha("KvInputBatchMismatch",
          [](Request& r) {
            *r.mutable_kv_input() = Float32({3, 5, 6});
          },
          kInvalid,
          {"kv_input.shape[0] (B) is 3, expected 2 (query_input.shape[0] "
           "(B))"}),
      Mha("KvInputWrongEkv",
          [](Request& r) {
            *r.mutable_kv_input() = Float32({2, 5, 5});
          },
          kInvalid,
          {"kv_input.shape[2] (Ekv) is 5, expected 6 (Ekv of weights)"}),
      Mha("KvInputEmptyMessage",
          [](Request& r) { r.mutable_kv_input()->Clear(); }, kInvalid,
          {"kv_input.dtype is DTYPE_UNSPECIFIED"}),
      Mha("SelfAttentionWithEkvNotE", [](Request& r) { r.clear_kv_input(); },
          kInvalid,
          {"kv_input is missing: weights project queries of E = 8 features "
           "and keys and values of Ekv = 6 (cross-attention)"}),
      Mha("ZeroHeads",
          [](Request& r) { r.mutable_weights()->set_num_heads(0); }, kInvalid,
          {"weights.num_heads is 0, expected > 0"}),
      Mha("NegativeHeads",
          [](Request& r) { r.mutable_weights()->set_num_heads(-2); }, kInvalid,
          {"weights.num_heads is -2, expected > 0"}),
      Mha("KvHeadsNotDividingHeads",
          [](Request& r) { r.mutable_weights()->set_num_kv_heads(3); },
          kInvalid,
          {"weights.num_kv_heads is 3, expected 0 (= num_heads) or a divisor "
           "of 2 "
           "(weights.num_heads)"}),
      Mha("NegativeKvHeads",
          [](Request& r) { r.mutable_weights()->set_num_kv_heads(-1); },
          kInvalid,
          {"weights.num_kv_heads is -1, expected 0 (= num_heads) or a divisor "
           "of 2"}),
      Mha("MissingOutputProjection",
          [](Request& r) { r.mutable_weights()->clear_w_o(); }, kInvalid,
          {"weights.w_o is missing, expected a tensor of shape [E, H·Dv]"}),
      Mha("BoolKeyProjection",
          [](Request& r) {
            r.mutable_weights()->mutable_w_k()->set_dtype(v1::BOOL);
          },
          kInvalid,
          {"weights.w_k.dtype is BOOL, expected FLOAT32 or BFLOAT16 or "
           "FLOAT16"}),
      Mha("QueryProjectionRowsNotPerHead",
          [](Request& r) {
            *r.mutable_weights()->mutable_w_q() = Float32({9, 8});
          },
          kInvalid,
          {"weights.w_q.shape[0] (H·Dk) is 9, expected a multiple of 2 "
           "(weights.num_heads)"}),
      Mha("KeyProjectionRowsWrong",
          [](Request& r) {
            *r.mutable_weights()->mutable_w_k() = Float32({8, 6});
          },
          kInvalid,
          {"weights.w_k.shape[0] (Hkv·Dk) is 8, expected 4 "
           "(weights.num_kv_heads × Dk, Dk from weights.w_q)"}),
      Mha("ValueProjectionEkvWrong",
          [](Request& r) {
            *r.mutable_weights()->mutable_w_v() = Float32({4, 5});
          },
          kInvalid,
          {"weights.w_v.shape[1] (Ekv) is 5, expected 6 (weights.w_k.shape[1] "
           "(Ekv))"}),
      Mha("OutputProjectionRowsWrong",
          [](Request& r) {
            *r.mutable_weights()->mutable_w_o() = Float32({7, 8});
          },
          kInvalid,
          {"weights.w_o.shape[0] (E) is 7, expected 8 (weights.w_q.shape[1] "
           "(E))"}),
      Mha("OutputProjectionColumnsWrong",
          [](Request& r) {
            *r.mutable_weights()->mutable_w_o() = Float32({8, 6});
          },
          kInvalid,
          {"weights.w_o.shape[1] (H·Dv) is 6, expected 8 (weights.num_heads × "
           "Dv, Dv from weights.w_v)"}),
      Mha("QueryBiasWrongLength",
          [](Request& r) {
            *r.mutable_weights()->mutable_b_q() = Float32({7});
          },
          kInvalid,
          {"weights.b_q.shape[0] (out) is 7, expected 8 "
           "(weights.w_q.shape[0])"}),
      Mha("OutputBiasRankTwo",
          [](Request& r) {
            *r.mutable_weights()->mutable_b_o() = Float32({1, 8});
          },
          kInvalid,
          {"weights.b_o.shape is [1, 8] with 2 dimensions, expected 1: [out]"}),
      Mha("ValueProjectionDataShort",
          [](Request& r) {
            r.mutable_weights()->mutable_w_v()->mutable_data()->resize(95);
          },
          kInvalid, {"weights.w_v.data has 95 bytes, expected 96"}),
      Mha("NanScale",
          [nan](Request& r) { r.mutable_options()->set_scale(nan); }, kInvalid,
          {"options.scale is nan, expected a finite number"}),
      Mha("KeyLengthPastKvInput",
          [](Request& r) {
            for (int64_t length : {6, 1})
              r.mutable_options()->add_key_lengths(length);
          },
          kInvalid, {"options.key_lengths[0] is 6, expected 0 to 5 (Lk)"}),
      Mha("MaskKeyDimWrong",
          [](Request& r) {
            *r.mutable_options()->mutable_attn_mask() = Float32({2, 1, 3, 4});
          },
          kInvalid, {"options.attn_mask.shape[3] is 4, expected 1 or 5 (Lk)"}),
  };
}

std::vector<MalformedCase> RegistryCases() {
  return {
      Put("EmptyName", [](v1::PutWeightsRequest& r) { r.clear_name(); },
          kInvalid,
          {"name is \"\", expected 1 to 128 characters of [A-Za-z0-9._-]"}),
      Put("NameWithSlash",
          [](v1::PutWeightsRequest& r) { r.set_name("../etc"); }, kInvalid,
          {"name is \"../etc\", expected 1 to 128 characters"}),
      Put("MissingWeights", [](v1::PutWeightsRequest& r) { r.clear_weights(); },
          kInvalid, {"weights is missing, expected ProjectionWeights"}),
      Put("MissingKeyProjection",
          [](v1::PutWeightsRequest& r) { r.mutable_weights()->clear_w_k(); },
          kInvalid,
          {"weights.w_k is missing, expected a tensor of shape [Hkv·Dk, Ekv]"}),
      {"DeleteUnknownName",
       "DeleteWeights",
       [] {
         v1::DeleteWeightsRequest request;
         request.set_name("never-put");
         return request.SerializeAsString();
       },
       kNotFound,
       {"name 'never-put' is not registered"}},
  };
}

// Wire bytes: an AttendRequest cut short, or bytes no AttendRequest can be.
std::vector<MalformedCase> WireCases() {
  const auto attend_bytes = [] {
    return ValidAttendRequest().SerializeAsString();
  };
  return {
      Raw("AttendTruncated", "Attend",
          [attend_bytes] {
            std::string bytes = attend_bytes();
            bytes.resize(bytes.size() - 5);
            return bytes;
          },
          {"attnserve.v1.AttendRequest", "could not be parsed"}),
      Raw("AttendCutInsideQuery", "Attend",
          [attend_bytes] { return attend_bytes().substr(0, 40); },
          {"attnserve.v1.AttendRequest", "could not be parsed"}),
      Raw("AttendGarbage", "Attend", [] { return std::string(64, '\xff'); },
          {"attnserve.v1.AttendRequest", "could not be parsed"}),
      Raw("AttendLengthPastEnd", "Attend",
          [] { return std::string("\x0a\x7f\x08\x01", 4); },
          {"attnserve.v1.AttendRequest", "could not be parsed"}),
      Raw("AttendHugeLengthPrefix", "Attend",
          [] {
            // query { data: a length of 2^62 - 1 bytes, and none of them }
            return std::string(
                "\x0a\x0a\x1a\xff\xff\xff\xff\xff\xff\xff\xff\x3f", 12);
          },
          {"attnserve.v1.AttendRequest", "could not be parsed"}),
      Raw("AttendTruncatedPackedShape", "Attend",
          [] { return std::string("\x0a\x06\x08\x01\x12\x02\x80\x80", 8); },
          {"attnserve.v1.AttendRequest", "could not be parsed"}),
      Raw("AttendEmptyBody", "Attend", [] { return std::string(); },
          {"query is missing, expected a tensor of shape [B, H, Lq, Dk]"}),
      Raw("AttendQueryAsVarint", "Attend",
          [] { return std::string("\x08\x01", 2); }, {"query is missing"}),
      Raw("MultiHeadTruncated", "MultiHeadAttention",
          [] {
            std::string bytes = ValidMultiHeadRequest().SerializeAsString();
            bytes.resize(bytes.size() / 2);
            return bytes;
          },
          {"attnserve.v1.MultiHeadAttentionRequest", "could not be parsed"}),
      Raw("MultiHeadInvalidUtf8Name", "MultiHeadAttention",
          [] { return std::string("\x22\x02\xc3\x28", 4); },
          {"attnserve.v1.MultiHeadAttentionRequest", "could not be parsed"}),
      Raw("PutWeightsTruncated", "PutWeights",
          [] {
            std::string bytes = ValidPut().SerializeAsString();
            bytes.resize(bytes.size() - 1);
            return bytes;
          },
          {"attnserve.v1.PutWeightsRequest", "could not be parsed"}),
      Raw("PutWeightsInvalidUtf8Name", "PutWeights",
          [] { return std::string("\x0a\x02\xc3\x28", 4); },
          {"attnserve.v1.PutWeightsRequest", "could not be parsed"}),
  };
}

}  // namespace

v1::MultiHeadAttentionRequest ValidMultiHeadRequest() {
  Request request;
  *request.mutable_query_input() = Float32({2, 3, 8}, 31);
  *request.mutable_kv_input() = Float32({2, 5, 6}, 32);
  *request.mutable_weights() = ValidWeights();
  return request;
}

std::vector<MalformedCase> MultiHeadAndRegistryCorpus() {
  std::vector<MalformedCase> cases = MultiHeadCases();
  for (auto part : {RegistryCases, WireCases}) {
    for (MalformedCase& c : part()) cases.push_back(std::move(c));
  }
  return cases;
}

std::vector<MalformedCase> MalformedCorpus() {
  std::vector<MalformedCase> cases = AttendCorpus();
  for (MalformedCase& c : MultiHeadAndRegistryCorpus())
    cases.push_back(std::move(c));
  return cases;
}

}  // namespace attnserve::testing
