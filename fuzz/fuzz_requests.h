// What request_fuzzer and seed_corpus_generator share: the fuzzer's input
// format and the weights its registry holds.
//
// An input is one byte that picks the message (its value modulo kRequestKinds),
// then that message's protobuf wire bytes.
#ifndef ATTNSERVE_FUZZ_FUZZ_REQUESTS_H_
#define ATTNSERVE_FUZZ_FUZZ_REQUESTS_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"

namespace attnserve::fuzz {

enum class RequestKind : uint8_t {
  kAttend = 0,         // v1::AttendRequest
  kMultiHead = 1,      // v1::MultiHeadAttentionRequest
  kPutWeights = 2,     // v1::PutWeightsRequest
  kCreateSession = 3,  // v1::CreateSessionRequest
  kStep = 4,           // v1::StepRequest
  kModelInfer = 5,     // inference::ModelInferRequest (the Open Inference
                       // Protocol): model sdpa, or a registered weight set
};
inline constexpr int kRequestKinds = 6;

// request_fuzzer's store holds, before every Step input, one session of
// kTinySession's shape with kTinySessionTokens tokens in layer 0; a step
// whose session_id is kTinySessionMarker is sent to it (its real id is
// random), so that inputs reach past the id's check.
inline constexpr char kTinySessionMarker[] = "tiny-session";
// A StepRequest whose replica_incarnation is kThisIncarnationMarker carries
// the fuzzer's store's own incarnation (drawn per store); any other non-empty
// one is another process's, refused as a whole.
inline constexpr char kThisIncarnationMarker[] = "this-incarnation";
inline constexpr int64_t kTinySessionTokens = 5;

// Layers 2, H 4, Hkv 2, Dk 3, Dv 2, stored as bf16.
inline v1::CreateSessionRequest TinySession() {
  v1::CreateSessionRequest request;
  request.set_num_layers(2);
  request.set_num_heads(4);
  request.set_num_kv_heads(2);
  request.set_key_dim(3);
  request.set_value_dim(2);
  request.set_dtype(v1::BFLOAT16);
  request.set_max_tokens(64);
  return request;
}

// A FLOAT32 tensor of `shape` holding sin(1 + i + offset) at flat index i.
inline v1::Tensor SineTensor(std::initializer_list<int64_t> shape,
                             int offset = 0) {
  v1::Tensor tensor;
  tensor.set_dtype(v1::FLOAT32);
  int64_t count = 1;
  for (int64_t dim : shape) {
    tensor.add_shape(dim);
    count *= dim;
  }
  std::vector<float> values(static_cast<size_t>(count));
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = std::sin(static_cast<float>(1 + i + offset));
  }
  tensor.mutable_data()->assign(reinterpret_cast<const char*>(values.data()),
                                values.size() * sizeof(float));
  return tensor;
}

// Besides the server's built-in "demo" set (E = 64), request_fuzzer's registry
// holds this tiny set before every input: E = Ekv = 4, H = 2, Hkv = 1, Dk = 2,
// Dv = 3, with biases.
inline constexpr char kTinyWeightsName[] = "tiny";

inline v1::PutWeightsRequest TinyWeights() {
  v1::PutWeightsRequest request;
  request.set_name(kTinyWeightsName);
  v1::ProjectionWeights& w = *request.mutable_weights();
  w.set_num_heads(2);
  w.set_num_kv_heads(1);
  *w.mutable_w_q() = SineTensor({4, 4}, 0);
  *w.mutable_w_k() = SineTensor({2, 4}, 100);
  *w.mutable_w_v() = SineTensor({3, 4}, 200);
  *w.mutable_w_o() = SineTensor({4, 6}, 300);
  *w.mutable_b_q() = SineTensor({4}, 400);
  *w.mutable_b_k() = SineTensor({2}, 500);
  *w.mutable_b_v() = SineTensor({3}, 600);
  *w.mutable_b_o() = SineTensor({4}, 700);
  return request;
}

}  // namespace attnserve::fuzz

#endif  // ATTNSERVE_FUZZ_FUZZ_REQUESTS_H_
