// Attend's part of the malformed-input corpus: tensors, shapes, options,
// limits.
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attnserve/client/client.h"
#include "reference/reference_attention.h"
#include "reliability/malformed_corpus.h"

namespace attnserve::testing {
namespace {

using Request = v1::AttendRequest;
using Options = v1::AttentionOptions;
constexpr grpc::StatusCode kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
constexpr grpc::StatusCode kExhausted = grpc::StatusCode::RESOURCE_EXHAUSTED;
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min();

// A FLOAT32 tensor of `shape` with values uniform in [-1, 1).
v1::Tensor Float32(std::vector<int64_t> shape, uint64_t seed = 7) {
  int64_t elements = 1;
  for (int64_t dim : shape) elements *= dim;
  return MakeFloat32Tensor(shape, RandomValues(elements, seed));
}

// One case: the valid Attend request after `mutate`.
MalformedCase Attend(std::string name, std::function<void(Request&)> mutate,
                     grpc::StatusCode code, std::vector<std::string> parts) {
  return {std::move(name), "Attend",
          [mutate = std::move(mutate)] {
            Request request = ValidAttendRequest();
            mutate(request);
            return request.SerializeAsString();
          },
          code, std::move(parts)};
}

// Sets q, k, v to FLOAT32 tensors of the given shapes.
void Shapes(Request& r, std::vector<int64_t> query, std::vector<int64_t> key,
            std::vector<int64_t> value) {
  *r.mutable_query() = Float32(std::move(query), 1);
  *r.mutable_key() = Float32(std::move(key), 2);
  *r.mutable_value() = Float32(std::move(value), 3);
}

v1::Tensor* Mask(Request& r) {
  return r.mutable_options()->mutable_attn_mask();
}

std::vector<MalformedCase> TensorCases() {
  return {
      Attend("MissingQuery", [](Request& r) { r.clear_query(); }, kInvalid,
             {"query is missing, expected a tensor of shape [B, H, Lq, Dk]"}),
      Attend("MissingKey", [](Request& r) { r.clear_key(); }, kInvalid,
             {"key is missing", "[B, Hkv, Lk, Dk]"}),
      Attend("MissingValue", [](Request& r) { r.clear_value(); }, kInvalid,
             {"value is missing", "[B, Hkv, Lk, Dv]"}),
      Attend("EmptyQueryMessage",
             [](Request& r) { r.mutable_query()->Clear(); }, kInvalid,
             {"query.dtype is DTYPE_UNSPECIFIED, expected FLOAT32"}),
      Attend("UnknownValueDType",
             [](Request& r) {
               r.mutable_value()->set_dtype(static_cast<v1::DType>(42));
             },
             kInvalid, {"value.dtype is 42 (not a DType)"}),
      Attend("NegativeQueryDType",
             [](Request& r) {
               r.mutable_query()->set_dtype(static_cast<v1::DType>(-1));
             },
             kInvalid, {"query.dtype is -1 (not a DType)"}),
      Attend("BoolQuery",
             [](Request& r) { r.mutable_query()->set_dtype(v1::BOOL); },
             kInvalid,
             {"query.dtype is BOOL, expected FLOAT32 or BFLOAT16 or FLOAT16"}),
      Attend("KeyDTypeFloat16WithFloat32Bytes",
             [](Request& r) { r.mutable_key()->set_dtype(v1::FLOAT16); },
             kInvalid, {"key.data has 896 bytes, expected 448", "FLOAT16"}),
      Attend(
          "ScalarQuery", [](Request& r) { *r.mutable_query() = Float32({}); },
          kInvalid,
          {"query.shape is [] with 0 dimensions, expected 4: [B, H, Lq, Dk]"}),
      Attend("KeyRankThree",
             [](Request& r) {
               *r.mutable_key() = Float32({2, 14, 8});
             },
             kInvalid,
             {"key.shape is [2, 14, 8] with 3 dimensions, expected 4"}),
      Attend("ValueRankFive",
             [](Request& r) {
               *r.mutable_value() = Float32({2, 2, 7, 3, 1});
             },
             kInvalid,
             {"value.shape is [2, 2, 7, 3, 1] with 5 dimensions, expected 4"}),
      Attend("EmptyQueryTensor",
             [](Request& r) {
               r.mutable_query()->set_shape(2, 0);
               r.mutable_query()->clear_data();
             },
             kInvalid, {"query.shape[2] (Lq) is 0, expected > 0"}),
      Attend("NegativeKeyLength",
             [](Request& r) { r.mutable_key()->set_shape(2, -7); }, kInvalid,
             {"key.shape[2] (Lk) is -7, expected > 0"}),
      Attend("MostNegativeBatch",
             [](Request& r) { r.mutable_query()->set_shape(0, kInt64Min); },
             kInvalid,
             {"query.shape[0] (B) is -9223372036854775808, expected > 0"}),
      Attend("ShapeProductOverflowsInt64",
             [](Request& r) {
               for (int dim = 0; dim < 3; ++dim)
                 r.mutable_query()->set_shape(dim, 1 << 30);
             },
             kInvalid,
             {"query.shape is [1073741824, 1073741824, 1073741824, 8]",
              "data would pass 2^63 bytes; expected far fewer elements"}),
      Attend(
          "MaxInt64Dimension",
          [](Request& r) { r.mutable_value()->set_shape(3, kInt64Max); },
          kInvalid,
          {"value.shape is [2, 2, 7, 9223372036854775807]", "pass 2^63 bytes"}),
      Attend(
          "ByteCountOverflowsInt64",
          [](Request& r) {
            // 2^61 elements fit in int64; their 2^63 bytes of FLOAT32 do
            // not.
            r.mutable_key()->set_shape(0, int64_t{1} << 61);
            for (int dim = 1; dim < 4; ++dim)
              r.mutable_key()->set_shape(dim, 1);
          },
          kInvalid,
          {"key.shape is [2305843009213693952, 1, 1, 1]", "pass 2^63 bytes"}),
      Attend("HugeClaimedDimensionWithoutData",
             [](Request& r) {
               r.mutable_key()->set_shape(2, 1000000000);
               r.mutable_value()->set_shape(2, 1000000000);
             },
             kInvalid, {"key.data has 896 bytes, expected 128000000000"}),
      Attend("QueryDataOneByteShort",
             [](Request& r) { r.mutable_query()->mutable_data()->pop_back(); },
             kInvalid,
             {"query.data has 1279 bytes, expected 1280 (320 elements of shape "
              "[2, 4, 5, 8] x "
              "4 bytes of FLOAT32)"}),
      Attend("ValueDataOneElementLong",
             [](Request& r) {
               r.mutable_value()->mutable_data()->append(4, '\0');
             },
             kInvalid, {"value.data has 340 bytes, expected 336"}),
      Attend("KeyDataEmpty", [](Request& r) { r.mutable_key()->clear_data(); },
             kInvalid, {"key.data has 0 bytes, expected 896"}),
  };
}

std::vector<MalformedCase> ConsistencyCases() {
  return {
      Attend("KeyBatchMismatch",
             [](Request& r) {
               *r.mutable_key() = Float32({3, 2, 7, 8});
             },
             kInvalid,
             {"key.shape[0] (B) is 3, expected 2 (query.shape[0] (B))"}),
      Attend("KeyDimMismatch",
             [](Request& r) {
               *r.mutable_key() = Float32({2, 2, 7, 16});
             },
             kInvalid,
             {"key.shape[3] (Dk) is 16, expected 8 (query.shape[3] (Dk))"}),
      Attend("ValueBatchMismatch",
             [](Request& r) {
               *r.mutable_value() = Float32({3, 2, 7, 3});
             },
             kInvalid,
             {"value.shape[0] (B) is 3, expected 2 (key.shape[0] (B))"}),
      Attend("ValueKvHeadsMismatch",
             [](Request& r) {
               *r.mutable_value() = Float32({2, 1, 7, 3});
             },
             kInvalid,
             {"value.shape[1] (Hkv) is 1, expected 2 (key.shape[1] (Hkv))"}),
      Attend("ValueLengthMismatch",
             [](Request& r) {
               *r.mutable_value() = Float32({2, 2, 6, 3});
             },
             kInvalid,
             {"value.shape[2] (Lk) is 6, expected 7 (key.shape[2] (Lk))"}),
      Attend("GqaHeadsNotDividing",
             [](Request& r) {
               *r.mutable_query() = Float32({2, 3, 5, 8});
             },
             kInvalid,
             {"query.shape[1] (H) is 3, expected a multiple of 2 (key.shape[1] "
              "(Hkv))"}),
      Attend("MoreKvHeadsThanHeads",
             [](Request& r) {
               Shapes(r, {2, 4, 5, 8}, {2, 8, 7, 8}, {2, 8, 7, 3});
             },
             kInvalid,
             {"query.shape[1] (H) is 4, expected a multiple of 8 (key.shape[1] "
              "(Hkv))"}),
  };
}

std::vector<MalformedCase> OptionCases() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  return {
      Attend("NanScale",
             [nan](Request& r) { r.mutable_options()->set_scale(nan); },
             kInvalid, {"options.scale is nan, expected a finite number"}),
      Attend("InfiniteScale",
             [inf](Request& r) { r.mutable_options()->set_scale(inf); },
             kInvalid, {"options.scale is inf, expected a finite number"}),
      Attend("NegativeInfiniteScale",
             [inf](Request& r) { r.mutable_options()->set_scale(-inf); },
             kInvalid, {"options.scale is -inf, expected a finite number"}),
      Attend("UnknownCausalAlignment",
             [](Request& r) {
               r.mutable_options()->set_causal(true);
               r.mutable_options()->set_causal_alignment(
                   static_cast<Options::CausalAlignment>(7));
             },
             kInvalid,
             {"options.causal_alignment is 7, expected TOP_LEFT (0), "
              "BOTTOM_RIGHT (1)"}),
      Attend("UnknownReturnWeights",
             [](Request& r) {
               r.mutable_options()->set_return_weights(
                   static_cast<Options::ReturnWeights>(9));
             },
             kInvalid,
             {"options.return_weights is 9, expected NONE (0), PER_HEAD (1), "
              "HEAD_MEAN (2)"}),
      Attend("UnknownPrecision",
             [](Request& r) {
               r.mutable_options()->set_precision(
                   static_cast<Options::Precision>(5));
             },
             kInvalid, {"options.precision is 5, expected F32 (0), BF16 (1)"}),
      Attend("NegativePrecision",
             [](Request& r) {
               r.mutable_options()->set_precision(
                   static_cast<Options::Precision>(-1));
             },
             kInvalid, {"options.precision is -1"}),
      Attend(
          "BoolOutputDType",
          [](Request& r) { r.mutable_options()->set_output_dtype(v1::BOOL); },
          kInvalid,
          {"options.output_dtype is BOOL, expected FLOAT32, BFLOAT16, FLOAT16 "
           "or unset"}),
      Attend("UnknownOutputDType",
             [](Request& r) {
               r.mutable_options()->set_output_dtype(
                   static_cast<v1::DType>(77));
             },
             kInvalid, {"options.output_dtype is 77 (not a DType)"}),
      Attend("KeyLengthsThreeForTwoItems",
             [](Request& r) {
               for (int64_t length : {1, 2, 3})
                 r.mutable_options()->add_key_lengths(length);
             },
             kInvalid,
             {"options.key_lengths size is 3, expected 2 (one entry per batch "
              "item, B)"}),
      Attend("KeyLengthsOneForTwoItems",
             [](Request& r) { r.mutable_options()->add_key_lengths(4); },
             kInvalid, {"options.key_lengths size is 1, expected 2"}),
      Attend("KeyLengthPastKeys",
             [](Request& r) {
               for (int64_t length : {7, 8})
                 r.mutable_options()->add_key_lengths(length);
             },
             kInvalid, {"options.key_lengths[1] is 8, expected 0 to 7 (Lk)"}),
      Attend("NegativeKeyLengthOption",
             [](Request& r) {
               for (int64_t length : {-1, 3})
                 r.mutable_options()->add_key_lengths(length);
             },
             kInvalid, {"options.key_lengths[0] is -1, expected 0 to 7 (Lk)"}),
      Attend(
          "MaxInt64KeyLength",
          [](Request& r) {
            for (int64_t length : {int64_t{3}, kInt64Max})
              r.mutable_options()->add_key_lengths(length);
          },
          kInvalid,
          {"options.key_lengths[1] is 9223372036854775807, expected 0 to 7"}),
  };
}

std::vector<MalformedCase> MaskCases() {
  return {
      Attend("MaskRankFive",
             [](Request& r) {
               *Mask(r) = Float32({1, 1, 1, 5, 7});
             },
             kInvalid,
             {"options.attn_mask.shape is [1, 1, 1, 5, 7] with 5 dimensions, "
              "expected 1 to 4"}),
      Attend(
          "MaskRankZero",
          [](Request& r) {
            Mask(r)->set_dtype(v1::BOOL);
            Mask(r)->set_data(std::string(1, '\1'));
          },
          kInvalid,
          {"options.attn_mask.shape is [] with 0 dimensions, expected 1 to 4"}),
      Attend("MaskKeyDimWrong",
             [](Request& r) {
               *Mask(r) = Float32({5, 6});
             },
             kInvalid,
             {"options.attn_mask.shape[1] is 6, expected 1 or 7 (Lk)",
              "[B, H, Lq, Lk] = [2, 4, 5, 7]"}),
      Attend("MaskQueryDimWrong",
             [](Request& r) {
               *Mask(r) = Float32({4, 7});
             },
             kInvalid,
             {"options.attn_mask.shape[0] is 4, expected 1 or 5 (Lq)"}),
      Attend("MaskBatchDimWrong",
             [](Request& r) {
               *Mask(r) = Float32({3, 1, 5, 7});
             },
             kInvalid,
             {"options.attn_mask.shape[0] is 3, expected 1 or 2 (B)"}),
      Attend("MaskHeadDimIsKvHeads",
             [](Request& r) {
               *Mask(r) = Float32({1, 2, 5, 7});
             },
             kInvalid,
             {"options.attn_mask.shape[1] is 2, expected 1 or 4 (H)"}),
      Attend("MaskWithoutDType",
             [](Request& r) {
               Mask(r)->add_shape(7);
               Mask(r)->set_data(std::string(7, '\1'));
             },
             kInvalid,
             {"options.attn_mask.dtype is DTYPE_UNSPECIFIED, expected BOOL or "
              "FLOAT32"}),
      Attend("MaskUnknownDType",
             [](Request& r) {
               *Mask(r) = MakeBoolTensor({7}, std::vector<bool>(7, true));
               Mask(r)->set_dtype(static_cast<v1::DType>(99));
             },
             kInvalid, {"options.attn_mask.dtype is 99 (not a DType)"}),
      Attend("BoolMaskBytesShort",
             [](Request& r) {
               *Mask(r) = MakeBoolTensor({5, 7}, std::vector<bool>(34, true));
             },
             kInvalid, {"options.attn_mask.data has 34 bytes, expected 35"}),
      Attend("Float16MaskWithFloat32Bytes",
             [](Request& r) {
               *Mask(r) = Float32({5, 7});
               Mask(r)->set_dtype(v1::FLOAT16);
             },
             kInvalid, {"options.attn_mask.data has 140 bytes, expected 70"}),
      Attend("MaskZeroDimension",
             [](Request& r) {
               *Mask(r) = MakeBoolTensor({5, 7}, std::vector<bool>(35, true));
               Mask(r)->set_shape(0, 0);
             },
             kInvalid, {"options.attn_mask.shape[0] is 0, expected > 0"}),
  };
}

std::vector<MalformedCase> LimitCases() {
  return {
      Attend("OutputOverMessageLimit",
             [](Request& r) {
               Shapes(r, {1, 1, 65536, 1}, {1, 1, 1, 1}, {1, 1, 1, 32});
             },
             kExhausted,
             {"the response (output, framing) would need 8389632 bytes",
              "max_message_bytes limit of 4194304"}),
      // Tensors of exactly the limit: their framing would take the message
      // over it (gRPC would refuse to send it, and end an AttendStream).
      Attend("OutputOfExactlyTheMessageLimit",
             [](Request& r) {
               Shapes(r, {1, 1, 32768, 1}, {1, 1, 1, 1}, {1, 1, 1, 32});
             },
             kExhausted,
             {"the response (output, framing) would need 4195328 bytes",
              "max_message_bytes limit of 4194304"}),
      Attend(
          "WeightsOverMessageLimit",
          [](Request& r) {
            Shapes(r, {1, 1, 1024, 1}, {1, 1, 1100, 1}, {1, 1, 1100, 1});
            r.mutable_options()->set_return_weights(Options::PER_HEAD);
          },
          kExhausted,
          {"the response (output, weights, framing) would need 4510720 bytes",
           "limit of 4194304"}),
      // The unfused kernel's least slab, one query row of the 64 heads
      // sharing a kv head: 64 x 131072 scores, 32 MiB.
      Attend("ScoresOverWorkspaceLimit",
             [](Request& r) {
               Shapes(r, {1, 64, 2, 1}, {1, 1, 131072, 1}, {1, 1, 131072, 1});
             },
             kExhausted,
             {"needs 33554432 bytes of scratch",
              "workspace limit of 16777216 bytes (max_workspace_bytes)"}),
      // A 16 MiB slab of scores (the workspace's worth) plus the output.
      Attend("ComputeOverRequestMemoryLimit",
             [](Request& r) {
               Shapes(r, {16, 1, 1024, 1}, {16, 1, 1024, 1}, {16, 1, 1024, 1});
             },
             kExhausted,
             {"over the max_request_memory_bytes limit of 16777216"}),
      Attend("QueryOverElementLimit",
             [](Request& r) {
               Shapes(r, {1, 1, 50001, 4}, {1, 1, 7, 4}, {1, 1, 7, 3});
             },
             kExhausted,
             {"query has 200004 elements, over the max_elements limit of "
              "200000"}),
      Attend("MaskOverElementLimit",
             [](Request& r) {
               Shapes(r, {1, 1, 500, 4}, {1, 1, 500, 4}, {1, 1, 500, 4});
               *Mask(r) =
                   MakeBoolTensor({500, 500}, std::vector<bool>(250000, true));
             },
             kExhausted,
             {"options.attn_mask has 250000 elements, over the max_elements "
              "limit of 200000"}),
      Attend("RequestOverMessageLimit",
             [](Request& r) {
               *r.mutable_query() = Float32({1, 1, 1 << 20, 2});
             },
             kExhausted, {"larger than max", "4194304"}),
  };
}

}  // namespace

v1::AttendRequest ValidAttendRequest() {
  Request request;
  Shapes(request, {2, 4, 5, 8}, {2, 2, 7, 8}, {2, 2, 7, 3});
  return request;
}

std::vector<MalformedCase> AttendCorpus() {
  std::vector<MalformedCase> cases;
  for (auto part :
       {TensorCases, ConsistencyCases, OptionCases, MaskCases, LimitCases}) {
    for (MalformedCase& c : part()) cases.push_back(std::move(c));
  }
  return cases;
}

}  // namespace attnserve::testing
