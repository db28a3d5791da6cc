// Dynamic batching of Attend: alike requests run as one engine call
// (AttentionEngine::AttendBatch) that reads each request's tensors and writes
// each response's output where they are, each request's answer bit for bit
// the answer it would get alone.
#ifndef ATTNSERVE_SERVER_ATTENTION_ATTEND_BATCH_H_
#define ATTNSERVE_SERVER_ATTENTION_ATTEND_BATCH_H_

#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "attnserve/core/attention_engine.h"
#include "attnserve/server/attention/request_validator.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// The key under which a validated Attend may share a batch: equal for requests
// with equal dtypes, equal shapes (B included: AttendBatch cuts a batch of
// equal B as each request alone) and equal options. Empty (never batched) when
// the options depend on the batch item (key_lengths, or a mask with a batch
// dimension), the engine cannot batch them in place (weights asked for, or the
// unfused kernel forced), or the request's inputs are read where they lie by
// AttendHalf (AttendWork::inputs_in_place), which batching would widen to f32
// copies, or the request is decode the engine reads in place
// (AttentionEngine::DecodeReadsInPlace): alone, a grouped-query decode runs on
// the paged kernel, which reads each key once for its group, and a batch would
// put it on the fused kernel, whose last bits differ.
std::string AttendBatchKey(const AttentionEngine& engine,
                           const v1::AttendRequest& request,
                           const AttendWork& work);

// One Attend of a batch.
struct AttendBatchItem {
  const AttendWork* work;
  const v1::AttendRequest* request;
  v1::AttendResponse* response;
};

// Computes `items`, which share a batch key, in one engine call and writes each
// response's output (and lse). Errors are the engine's, for the whole batch.
absl::Status ComputeAttendBatch(AttentionEngine& engine,
                                absl::Span<const AttendBatchItem> items);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_ATTEND_BATCH_H_
