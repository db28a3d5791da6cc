// Step: many sessions' appends and attention in one call.
//
// PrepareSteps checks every step against its session (pinned from then on)
// before anything is queued: a step that fails gets its own error in its
// StepResult and the others go on. RunSteps, on a compute executor, appends
// each step's tokens in order (checking the expected length), then computes
// every step's query in one AttendPaged pass over the pages where they lie,
// and writes the results.
#ifndef ATTNSERVE_SERVER_SESSIONS_SESSION_STEPS_H_
#define ATTNSERVE_SERVER_SESSIONS_SESSION_STEPS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/core/attention_engine.h"
#include "attnserve/server/sessions/session_store.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// The per-call limits a Step is checked against (the server's request
// limits and message size).
struct StepLimits {
  int64_t max_elements = int64_t{1} << 28;
  int64_t max_request_memory_bytes = int64_t{4} << 30;
  int64_t max_message_bytes = int64_t{64} << 20;
};

// One step checked against its session.
struct StepWork {
  StepWork(int step_index, SessionStore::Pin session_pin)
      : index(step_index), pin(std::move(session_pin)) {}

  int index;  // In the request.
  SessionStore::Pin pin;
  int64_t layer = 0;
  int64_t expected_length = 0;
  KvAppend append;                    // Points into the request.
  const v1::Tensor* query = nullptr;  // [H, Tq, Dk], or null.
  int64_t query_len = 0;
  float scale = 1.0f;
  Precision precision = Precision::kFloat32;
  bool return_lse = false;
  v1::DType output_dtype = v1::FLOAT32;
};

// A Step call's checked steps.
struct StepCall {
  std::vector<StepWork> steps;  // In the request's order.
  // What the compute will allocate: queries and outputs in f32, the encoded
  // outputs and lse, the kernel's scratch.
  int64_t memory_bytes = 0;
  // The attention's FLOPs: of every step with a query once prepared, of those
  // that computed once run.
  double flops = 0;
};

// Checks `request` as `owner` sees the store. INVALID_ARGUMENT or
// RESOURCE_EXHAUSTED for the call as a whole (no steps, more than
// max_steps_per_call, a response past max_message_bytes, compute memory past
// max_request_memory_bytes); otherwise `response` gets one result per step,
// those of failed steps with their error.
absl::StatusOr<StepCall> PrepareSteps(const v1::StepRequest& request,
                                      const std::string& owner,
                                      SessionStore& store,
                                      const AttentionEngine& engine,
                                      const StepLimits& limits,
                                      v1::StepResponse* response);

// Appends and computes the steps of `call` into `response` (as PrepareSteps
// left it). A step that fails now (its expected length, the budget, a
// session deleted meanwhile) gets its error; the others stand. If `stop` stops
// the compute, returns its error for the whole call (the appends stand, as
// for a lost response: the expected length tells a retry); otherwise OK.
absl::Status RunSteps(StepCall& call, SessionStore& store,
                      AttentionEngine& engine, const StopCheck& stop,
                      v1::StepResponse* response);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_SESSIONS_SESSION_STEPS_H_
