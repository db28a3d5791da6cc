// The engine's own checks of a call, so that core never reads out of bounds
// whoever calls it. The server validates requests field by field first; these
// are its safety net and the contract for other callers.
#ifndef ATTNSERVE_CORE_INTERNAL_VALIDATION_H_
#define ATTNSERVE_CORE_INTERNAL_VALIDATION_H_

#include "absl/status/status.h"
#include "attnserve/core/attention_types.h"

namespace attnserve::internal {

// Positive dimensions, heads % kv_heads == 0, and every tensor's element count
// within int64_t.
absl::Status ValidateShape(const AttentionShape& shape);

// scale finite, key_lengths sized B and within [0, Lk], the mask broadcastable
// with one data pointer, and the output spans sized as the shape and the
// options require.
absl::Status ValidateOptionsAndOutputs(const AttentionShape& shape,
                                       const AttentionOptions& options,
                                       const AttentionOutputs& outputs,
                                       int64_t output_elements);

// `name` holds exactly `expected` elements.
absl::Status ValidateSpanSize(const char* name, size_t actual,
                              int64_t expected);

// Packed sequences: positive dims, cu_seqlens of one size (2+), from 0,
// never decreasing; spans sized for the totals; options without key_lengths,
// a mask or weights, and valid as for Attend.
absl::Status ValidatePacked(const PackedShape& shape,
                            const AttentionOptions& options, size_t query_size,
                            size_t key_size, size_t value_size,
                            const AttentionOutputs& outputs);

// MHA: dimensions positive and consistent (self-attention: Lq == Lk, E == Ekv),
// projection weight and bias spans sized for them.
absl::Status ValidateMultiHead(const MultiHeadShape& shape,
                               const ProjectionWeights& weights,
                               bool self_attention);

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_VALIDATION_H_
