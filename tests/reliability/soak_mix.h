// The soak's request mix: Attend of several small shapes and options,
// MultiHeadAttention (inline, registered and the built-in demo weights),
// AttendStream, the registry, invalid requests that must get their documented
// error, and faults: deadlines that pass while queued, calls cancelled while
// queued, streams cancelled or whose channel goes away mid-stream.
//
// Every valid answer must equal, byte for byte, the answer the same request got
// when the server was idle (recorded by Create). Thread-safe once created.
#ifndef ATTNSERVE_TESTS_RELIABILITY_SOAK_MIX_H_
#define ATTNSERVE_TESTS_RELIABILITY_SOAK_MIX_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/v1/attention.grpc.pb.h"

namespace attnserve::testing {

// Outcomes of the operations run so far, by operation and gRPC code.
// Thread-safe.
class SoakTally {
 public:
  void Count(const std::string& operation, grpc::StatusCode code,
             int64_t requests);
  // An outcome the mix does not allow: counted, and the first few described.
  void Unexpected(const std::string& description);

  int64_t requests() const;
  int64_t unexpected() const;
  // Outcomes of `operation` with `code`; every operation if `operation` is
  // empty.
  int64_t Calls(const std::string& operation, grpc::StatusCode code) const;
  int64_t Calls(const std::string& operation) const;
  // One line per operation and code, and the unexpected outcomes described.
  std::string Report() const;

 private:
  mutable absl::Mutex mutex_;
  std::map<std::pair<std::string, int>, int64_t> calls_ ABSL_GUARDED_BY(mutex_);
  int64_t requests_ ABSL_GUARDED_BY(mutex_) = 0;
  int64_t unexpected_ ABSL_GUARDED_BY(mutex_) = 0;
  std::vector<std::string> described_ ABSL_GUARDED_BY(mutex_);
};

class SoakMix {
 public:
  // Registers the `soak` weights on the server behind `stub` and records each
  // valid request's answer. Fails if any of them fails or a recorded answer
  // disagrees with the reference.
  static absl::StatusOr<std::unique_ptr<SoakMix>> Create(
      v1::AttentionService::Stub& stub);

  // Runs operation `index` of the mix (they cycle) on `stub` and counts its
  // outcome in `tally`. `target` names the server, for the operations that open
  // a channel of their own. While `draining`, UNAVAILABLE (the server refusing
  // work) is allowed too and makes the return value false: the caller should
  // stop sending, as a client would.
  bool Run(int64_t index, v1::AttentionService::Stub& stub,
           const std::string& target, bool draining, SoakTally& tally) const;

  // Operation names, as counted in the tally.
  static constexpr char kAttend[] = "Attend";
  static constexpr char kInvalidAttend[] = "Attend(invalid)";
  static constexpr char kMultiHead[] = "MultiHeadAttention";
  static constexpr char kUnknownWeights[] =
      "MultiHeadAttention(unknown weights)";
  static constexpr char kStream[] = "AttendStream";
  static constexpr char kStreamBadRequest[] = "AttendStream(invalid request)";
  static constexpr char kDeadline[] = "Attend(tiny deadline)";
  static constexpr char kCancel[] = "Attend(cancelled)";
  static constexpr char kStreamCancel[] = "AttendStream(cancelled)";
  static constexpr char kStreamChannelGone[] = "AttendStream(channel dropped)";
  static constexpr char kRegistry[] = "PutWeights+ListWeights";

 private:
  SoakMix() = default;

  using Stub = v1::AttentionService::Stub;
  bool Attend(size_t which, Stub& stub, bool draining, SoakTally& tally) const;
  bool MultiHead(size_t which, Stub& stub, bool draining,
                 SoakTally& tally) const;
  bool Stream(Stub& stub, bool draining, SoakTally& tally) const;
  bool InvalidAttend(Stub& stub, bool draining, SoakTally& tally) const;
  bool UnknownWeights(Stub& stub, bool draining, SoakTally& tally) const;
  bool TinyDeadline(int64_t index, Stub& stub, bool draining,
                    SoakTally& tally) const;
  bool CancelWhileQueued(int64_t index, Stub& stub, bool draining,
                         SoakTally& tally) const;
  bool CancelStream(Stub& stub, const char* operation, bool draining,
                    SoakTally& tally) const;
  bool Registry(Stub& stub, bool draining, SoakTally& tally) const;

  std::vector<v1::AttendRequest>
      attend_;  // Valid, each with its recorded answer below.
  std::vector<v1::AttendResponse> attend_answers_;
  std::vector<v1::MultiHeadAttentionRequest> multi_head_;
  std::vector<v1::MultiHeadAttentionResponse> multi_head_answers_;
  v1::AttendRequest invalid_attend_;
  v1::MultiHeadAttentionRequest unknown_weights_;
  v1::PutWeightsRequest put_weights_;
};

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_RELIABILITY_SOAK_MIX_H_
