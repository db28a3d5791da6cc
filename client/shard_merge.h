// What ShardedAttend and ShardedSession share: cutting a tensor along one
// dimension, and merging per-shard outputs exactly by their lse. Internal to
// the client library.
#ifndef ATTNSERVE_CLIENT_SHARD_MERGE_H_
#define ATTNSERVE_CLIENT_SHARD_MERGE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve::internal {

// `tensor` (its data of its shape) with dimension `dim` cut to [begin, end).
v1::Tensor Slice(const v1::Tensor& tensor, int dim, int64_t begin, int64_t end);

// OK for an output dtype a merged answer can be made in: unset (the query's),
// FLOAT32, BFLOAT16 or FLOAT16; INVALID_ARGUMENT naming it otherwise (the
// shards are asked for f32, so the server never sees it to refuse it).
absl::Status CheckOutputDtype(v1::DType dtype);

// Merges shards' outputs (`outputs[s]`, `rows` × `value_dim` floats) and lse
// (`lses[s]`, `rows` floats) over disjoint key sets into the output and lse
// over all of them, in double precision:
//   lse = log Σ_s exp(lse_s),   o = Σ_s exp(lse_s − lse) · o_s.
// A row no shard has a key for (every lse_s −inf) gets output 0, lse −inf.
void MergeByLse(const std::vector<std::vector<float>>& outputs,
                const std::vector<std::vector<float>>& lses, int64_t rows,
                int64_t value_dim, std::vector<float>* output,
                std::vector<float>* lse);

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CLIENT_SHARD_MERGE_H_
