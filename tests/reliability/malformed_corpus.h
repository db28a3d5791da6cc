// The malformed-input corpus: hand-made bad requests for
// attnserve.v1.AttentionService, each built from a valid request by one
// mutation (or written as raw wire bytes), with the gRPC code and the message
// parts (the field, and the expected value where docs/api.md gives one) the
// server must answer with.
//
//   for (const MalformedCase& c : MalformedCorpus()) {
//     const std::string body = c.body();  // the serialised request
//     ... call "/attnserve.v1.AttentionService/" + c.method with body, check
//     c.code, c.parts
//   }
#ifndef ATTNSERVE_TESTS_RELIABILITY_MALFORMED_CORPUS_H_
#define ATTNSERVE_TESTS_RELIABILITY_MALFORMED_CORPUS_H_

#include <functional>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "grpcpp/support/status.h"

namespace attnserve::testing {

// The limits the corpus expects the server under test to run with.
inline constexpr int64_t kCorpusMaxMessageBytes = 4 << 20;
inline constexpr int64_t kCorpusMaxWorkspaceBytes = 16 << 20;
inline constexpr int64_t kCorpusMaxElements = 200000;
inline constexpr int64_t kCorpusMaxRequestMemoryBytes = 16 << 20;

struct MalformedCase {
  std::string name;
  std::string method;                 // "Attend", "MultiHeadAttention", ...
  std::function<std::string()> body;  // The request's bytes on the wire.
  grpc::StatusCode code;
  std::vector<std::string> parts;  // Each must appear in the status message.
};

// The valid requests the cases mutate. Attend: query [2, 4, 5, 8], key [2, 2,
// 7, 8], value [2, 2, 7, 3]. MultiHeadAttention: inline weights E = 8, Ekv = 6,
// H = 2, Hkv = 1, Dk = Dv = 4 with biases; query_input [2, 3, 8], kv_input [2,
// 5, 6].
v1::AttendRequest ValidAttendRequest();
v1::MultiHeadAttentionRequest ValidMultiHeadRequest();

// Every case: Attend's (malformed_corpus_attend.cc) then the other RPCs' and
// the raw wire bytes (malformed_corpus_mha.cc).
std::vector<MalformedCase> AttendCorpus();
std::vector<MalformedCase> MultiHeadAndRegistryCorpus();
std::vector<MalformedCase> MalformedCorpus();

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_RELIABILITY_MALFORMED_CORPUS_H_
