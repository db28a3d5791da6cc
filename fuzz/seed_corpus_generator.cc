// Writes the seed corpus of the fuzz targets (committed in fuzz/corpus/):
//
//   build-fuzz/fuzz/seed_corpus_generator fuzz/corpus
//
// request_fuzzer/: valid and subtly invalid Attend, MultiHeadAttention and
// PutWeights requests that cover every option and dtype, in the format of
// fuzz_requests.h. attention_options_fuzzer/: fixed-seed random bytes of a few
// lengths (that target decodes any bytes into a case). Deterministic: a rerun
// writes the same files. Inputs that once found a bug are kept beside them by
// hand, as regression_*.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "attnserve/common/dtype.h"
#include "attnserve/v1/attention.pb.h"
#include "fuzz_requests.h"
#include "inference/grpc_service.pb.h"

namespace attnserve::fuzz {
namespace {

using Options = v1::AttentionOptions;

// A tensor of `dtype` and `shape` with values cycling through [-1, 1).
v1::Tensor Tensor(v1::DType dtype, std::initializer_list<int64_t> shape) {
  v1::Tensor tensor = SineTensor(shape);
  if (dtype == v1::FLOAT32) return tensor;
  const auto* values = reinterpret_cast<const float*>(tensor.data().data());
  const int64_t count = static_cast<int64_t>(tensor.data().size() / 4);
  std::string bytes(static_cast<size_t>(count * 2), '\0');
  ConvertFromFloat32(
      values, count,
      dtype == v1::BFLOAT16 ? DataType::kBFloat16 : DataType::kFloat16,
      bytes.data());
  tensor.set_dtype(dtype);
  tensor.set_data(bytes);
  return tensor;
}

v1::Tensor BoolTensor(std::initializer_list<int64_t> shape) {
  v1::Tensor tensor;
  tensor.set_dtype(v1::BOOL);
  std::string bytes;
  for (int64_t dim : shape) tensor.add_shape(dim);
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  for (int64_t i = 0; i < count; ++i) bytes.push_back(i % 3 != 1 ? 1 : 0);
  tensor.set_data(bytes);
  return tensor;
}

v1::AttendRequest Attend(v1::DType dtype, int64_t b, int64_t h, int64_t hkv,
                         int64_t lq, int64_t lk, int64_t dk, int64_t dv) {
  v1::AttendRequest request;
  *request.mutable_query() = Tensor(dtype, {b, h, lq, dk});
  *request.mutable_key() = Tensor(dtype, {b, hkv, lk, dk});
  *request.mutable_value() = Tensor(dtype, {b, hkv, lk, dv});
  return request;
}

void Write(const std::string& folder, const std::string& name, RequestKind kind,
           const google::protobuf::Message& message) {
  std::string bytes(1, static_cast<char>(kind));
  message.AppendToString(&bytes);
  std::ofstream(folder + "/" + name, std::ios::binary) << bytes;
}

void WriteAttendSeeds(const std::string& folder) {
  const auto write = [&](const std::string& name,
                         const v1::AttendRequest& request) {
    Write(folder, "attend_" + name, RequestKind::kAttend, request);
  };
  write("f32_plain", Attend(v1::FLOAT32, 1, 2, 2, 3, 4, 4, 3));

  v1::AttendRequest r = Attend(v1::BFLOAT16, 2, 4, 2, 3, 5, 2, 2);
  r.mutable_options()->set_causal(true);
  r.mutable_options()->set_scale(0.5f);
  write("bf16_gqa_causal", r);

  r = Attend(v1::FLOAT16, 2, 3, 1, 2, 6, 3, 4);
  Options* o = r.mutable_options();
  o->set_causal(true);
  o->set_causal_alignment(Options::BOTTOM_RIGHT);
  o->add_key_lengths(4);
  o->add_key_lengths(0);
  o->set_return_lse(true);
  write("f16_mqa_bottom_right_key_lengths", r);

  r = Attend(v1::FLOAT32, 1, 2, 2, 3, 4, 2, 2);
  *r.mutable_options()->mutable_attn_mask() = BoolTensor({3, 4});
  r.mutable_options()->set_return_weights(Options::PER_HEAD);
  r.mutable_options()->set_output_dtype(v1::BFLOAT16);
  write("bool_mask_per_head_weights", r);

  r = Attend(v1::FLOAT32, 2, 2, 1, 2, 3, 2, 2);
  *r.mutable_options()->mutable_attn_mask() = Tensor(v1::FLOAT16, {2, 1, 1, 3});
  r.mutable_options()->set_return_weights(Options::HEAD_MEAN);
  r.mutable_options()->set_precision(Options::BF16);
  r.mutable_options()->set_output_dtype(v1::FLOAT16);
  write("float_mask_head_mean_bf16", r);

  // The variants: a window with sinks, ALiBi and a softcap; and a bad one.
  r = Attend(v1::FLOAT32, 1, 2, 1, 5, 9, 3, 2);
  o = r.mutable_options();
  o->set_causal(true);
  o->set_causal_alignment(Options::BOTTOM_RIGHT);
  o->set_window_left(2);
  o->set_window_right(0);
  o->set_num_sink_tokens(1);
  *o->mutable_alibi_slopes() = Tensor(v1::FLOAT32, {2});
  o->set_softcap(4.0f);
  o->set_return_lse(true);
  write("window_sinks_alibi_softcap", r);
  o->set_softcap(-1.0f);
  write("invalid_softcap", r);

  // Packed sequences: query [7, 2, 3], keys [9, 1, 3] in two sequences.
  r = v1::AttendRequest();
  *r.mutable_query() = Tensor(v1::FLOAT32, {7, 2, 3});
  *r.mutable_key() = Tensor(v1::FLOAT32, {9, 1, 3});
  *r.mutable_value() = Tensor(v1::FLOAT32, {9, 1, 2});
  for (int64_t x : {0, 3, 7}) r.mutable_options()->add_cu_seqlens_q(x);
  for (int64_t x : {0, 0, 9}) r.mutable_options()->add_cu_seqlens_k(x);
  r.mutable_options()->set_causal(true);
  r.mutable_options()->set_return_lse(true);
  write("packed_sequences", r);

  r = Attend(v1::FLOAT32, 1, 1, 1, 2, 2, 2, 2);
  r.mutable_query()->mutable_data()->pop_back();
  write("invalid_query_bytes", r);

  r = Attend(v1::FLOAT32, 1, 2, 2, 2, 3, 2, 2);
  *r.mutable_options()->mutable_attn_mask() = BoolTensor({2, 2});
  write("invalid_mask_broadcast", r);

  r = Attend(v1::FLOAT32, 1, 3, 2, 2, 2, 2, 2);
  r.mutable_options()->add_key_lengths(3);
  write("invalid_heads_and_key_lengths", r);

  // Over request_fuzzer's limits: 1024 elements, 64 KiB responses.
  write("over_max_elements", Attend(v1::FLOAT16, 1, 1, 1, 1, 1100, 1, 1));
  r = Attend(v1::FLOAT16, 1, 1, 1, 64, 600, 1, 1);
  r.mutable_options()->set_return_weights(Options::PER_HEAD);
  write("weights_over_max_message", r);
}

void WriteMultiHeadSeeds(const std::string& folder) {
  const auto write = [&](const std::string& name,
                         const v1::MultiHeadAttentionRequest& request) {
    Write(folder, "mha_" + name, RequestKind::kMultiHead, request);
  };
  v1::MultiHeadAttentionRequest r;
  *r.mutable_query_input() = Tensor(v1::FLOAT32, {2, 3, 4});
  r.set_weights_name(kTinyWeightsName);
  r.mutable_options()->set_causal(true);
  write("tiny_self", r);

  r.Clear();
  *r.mutable_query_input() = Tensor(v1::BFLOAT16, {1, 2, 64});
  r.set_weights_name("demo");
  r.mutable_options()->set_return_weights(Options::HEAD_MEAN);
  r.mutable_options()->set_return_lse(true);
  write("demo_bf16_weights_lse", r);

  r.Clear();
  *r.mutable_query_input() = Tensor(v1::FLOAT16, {2, 2, 4});
  *r.mutable_kv_input() = Tensor(v1::FLOAT32, {2, 3, 5});
  v1::ProjectionWeights& w = *r.mutable_weights();
  w.set_num_heads(2);
  w.set_num_kv_heads(1);
  *w.mutable_w_q() = Tensor(v1::FLOAT32, {4, 4});
  *w.mutable_w_k() = Tensor(v1::BFLOAT16, {2, 5});
  *w.mutable_w_v() = Tensor(v1::FLOAT16, {3, 5});
  *w.mutable_w_o() = Tensor(v1::FLOAT32, {4, 6});
  *w.mutable_b_o() = Tensor(v1::FLOAT32, {4});
  *r.mutable_options()->mutable_attn_mask() = BoolTensor({2, 3});
  r.mutable_options()->add_key_lengths(2);
  r.mutable_options()->add_key_lengths(3);
  r.mutable_options()->set_precision(Options::BF16);
  write("inline_cross_gqa_mask", r);

  // RoPE (Dk 2, interleaved) at explicit positions, with a window and ALiBi.
  r.clear_options();
  w.mutable_rope()->set_theta(500.0f);
  w.mutable_rope()->set_interleaved(true);
  for (int64_t p : {5, 6, 7, 8}) r.mutable_options()->add_query_positions(p);
  for (int64_t p : {0, 2, 4, 6, 8, 9}) {
    r.mutable_options()->add_key_positions(p);
  }
  r.mutable_options()->set_window_left(3);
  *r.mutable_options()->mutable_alibi_slopes() = Tensor(v1::FLOAT32, {2});
  write("inline_rope_positions_window", r);

  r.Clear();
  *r.mutable_query_input() = Tensor(v1::FLOAT32, {1, 2, 4});
  r.set_weights_name("missing");
  write("unknown_weights_name", r);

  // A version the registry does not hold: FAILED_PRECONDITION.
  r.Clear();
  *r.mutable_query_input() = Tensor(v1::FLOAT32, {1, 2, 64});
  r.set_weights_name("demo");
  r.set_weights_version(123456789);
  write("demo_other_weights_version", r);
}

void WritePutWeightsSeeds(const std::string& folder) {
  Write(folder, "put_tiny", RequestKind::kPutWeights, TinyWeights());
  v1::PutWeightsRequest r = TinyWeights();
  r.set_name("gqa.set-1");
  r.mutable_weights()->clear_b_k();
  *r.mutable_weights()->mutable_w_v() = Tensor(v1::FLOAT16, {3, 4});
  Write(folder, "put_gqa_f16", RequestKind::kPutWeights, r);
  r.mutable_weights()->set_num_kv_heads(3);
  Write(folder, "put_invalid_kv_heads", RequestKind::kPutWeights, r);
}

void WriteSessionSeeds(const std::string& folder) {
  Write(folder, "create_tiny", RequestKind::kCreateSession, TinySession());
  v1::CreateSessionRequest create = TinySession();
  create.set_num_kv_heads(3);
  Write(folder, "create_bad_kv_heads", RequestKind::kCreateSession, create);
  create = TinySession();
  create.set_session_id("00112233445566778899aabbccddeeff");
  Write(folder, "create_with_id", RequestKind::kCreateSession, create);
  create = TinySession();
  create.mutable_defaults()->set_window_left(2);
  create.mutable_defaults()->set_num_sink_tokens(1);
  create.mutable_defaults()->set_softcap(8.0f);
  create.mutable_defaults()->set_evict_outside_window(true);
  Write(folder, "create_evicting_window", RequestKind::kCreateSession, create);
  create.mutable_defaults()->mutable_rope()->set_rotary_dim(2);
  Write(folder, "create_evicting_rope", RequestKind::kCreateSession, create);
  // A decode step on the tiny session (H 4, Hkv 2, Dk 3, Dv 2, 5 tokens), a
  // prefill chunk on layer 1, a query alone, and a stale expected length.
  v1::StepRequest request;
  v1::SessionStep* step = request.add_steps();
  step->set_session_id(kTinySessionMarker);
  step->set_expected_length(kTinySessionTokens);
  *step->mutable_key() = SineTensor({2, 1, 3}, 1);
  *step->mutable_value() = SineTensor({2, 1, 2}, 2);
  *step->mutable_query() = SineTensor({4, 1, 3}, 3);
  step->mutable_options()->set_return_lse(true);
  step = request.add_steps();
  step->set_session_id(kTinySessionMarker);
  step->set_layer(1);
  *step->mutable_key() = SineTensor({2, 6, 3}, 4);
  *step->mutable_value() = SineTensor({2, 6, 2}, 5);
  step = request.add_steps();
  step->set_session_id(kTinySessionMarker);
  step->set_expected_length(kTinySessionTokens + 1);
  *step->mutable_query() = SineTensor({4, 2, 3}, 6);
  step->mutable_options()->set_output_dtype(v1::FLOAT16);
  step = request.add_steps();
  step->set_session_id(kTinySessionMarker);
  step->set_expected_length(0);
  *step->mutable_query() = SineTensor({4, 1, 3}, 7);
  Write(folder, "step_tiny", RequestKind::kStep, request);
  request.set_replica_incarnation(kThisIncarnationMarker);
  Write(folder, "step_this_incarnation", RequestKind::kStep, request);
  request.set_replica_incarnation("0123456789abcdef");
  Write(folder, "step_other_incarnation", RequestKind::kStep, request);
}

// ModelInfer: sdpa with raw contents and options as parameters, sdpa with
// typed contents, and the demo weight set.
void WriteModelInferSeeds(const std::string& folder) {
  const auto add_input = [](inference::ModelInferRequest* request,
                            const char* name, const v1::Tensor& tensor,
                            bool raw) {
    auto* input = request->add_inputs();
    input->set_name(name);
    input->set_datatype("FP32");
    *input->mutable_shape() = tensor.shape();
    if (raw) {
      request->add_raw_input_contents(tensor.data());
    } else {
      auto* values = input->mutable_contents()->mutable_fp32_contents();
      values->Resize(static_cast<int>(tensor.data().size() / 4), 0.0f);
      std::memcpy(values->mutable_data(), tensor.data().data(),
                  tensor.data().size());
    }
  };
  for (const bool raw : {true, false}) {
    inference::ModelInferRequest request;
    request.set_model_name("sdpa");
    add_input(&request, "QUERY", SineTensor({1, 2, 3, 4}), raw);
    add_input(&request, "KEY", SineTensor({1, 1, 5, 4}, 7), raw);
    add_input(&request, "VALUE", SineTensor({1, 1, 5, 2}, 3), raw);
    if (raw) {
      (*request.mutable_parameters())["causal"].set_bool_param(true);
      (*request.mutable_parameters())["causal_alignment"].set_string_param(
          "bottom_right");
      request.add_outputs()->set_name("OUTPUT");
      request.add_outputs()->set_name("LSE");
    }
    Write(folder, raw ? "infer_sdpa_raw" : "infer_sdpa_contents",
          RequestKind::kModelInfer, request);
  }
  inference::ModelInferRequest request;
  request.set_model_name("demo");
  add_input(&request, "INPUT", SineTensor({1, 2, 64}), true);
  Write(folder, "infer_demo", RequestKind::kModelInfer, request);
}

void WriteOptionsSeeds(const std::string& folder) {
  std::mt19937 generator(20261130);
  int n = 0;
  for (size_t length : {16, 64, 256, 512, 1024, 2048}) {
    std::string bytes(length, '\0');
    for (char& c : bytes) c = static_cast<char>(generator());
    std::ofstream(folder + "/random_" + std::to_string(n++), std::ios::binary)
        << bytes;
  }
}

}  // namespace
}  // namespace attnserve::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR (e.g. fuzz/corpus)\n", argv[0]);
    return 2;
  }
  const std::string root = argv[1];
  for (const char* target : {"request_fuzzer", "attention_options_fuzzer"}) {
    std::filesystem::create_directories(root + "/" + target);
  }
  attnserve::fuzz::WriteAttendSeeds(root + "/request_fuzzer");
  attnserve::fuzz::WriteMultiHeadSeeds(root + "/request_fuzzer");
  attnserve::fuzz::WritePutWeightsSeeds(root + "/request_fuzzer");
  attnserve::fuzz::WriteSessionSeeds(root + "/request_fuzzer");
  attnserve::fuzz::WriteModelInferSeeds(root + "/request_fuzzer");
  attnserve::fuzz::WriteOptionsSeeds(root + "/attention_options_fuzzer");
  return 0;
}
