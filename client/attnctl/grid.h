// attnctl grid: asks Attend for the attention weights (HEAD_MEAN, or
// PER_HEAD for one --head) and draws one batch item's [Lq, Lk] grid as a PNG
// (--png) or SVG (--svg) heatmap; see heatmap.h for the picture.
#ifndef ATTNSERVE_CLIENT_ATTNCTL_GRID_H_
#define ATTNSERVE_CLIENT_ATTNCTL_GRID_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "attnserve/client/client.h"
#include "attnserve/v1/attention.pb.h"
#include "heatmap.h"

namespace attnserve {

// The [Lq, Lk] grid of batch item `batch_index` in `weights`: HEAD_MEAN
// weights [B, Lq, Lk] when `head` is negative, else head `head` of PER_HEAD
// weights [B, H, Lq, Lk]. INVALID_ARGUMENT for another rank, an index out of
// range, or data that does not match the shape.
absl::StatusOr<AttentionGrid> ExtractGrid(const v1::Tensor& weights,
                                          int64_t batch_index, int64_t head);

// Runs `attnctl grid`; returns the exit status.
int RunGrid(Client& client);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTNCTL_GRID_H_
