// Exact attention over keys and values split along Lk: for contexts too long
// for one replica, or to spread one request over several.
//
// clang-format off
//   std::vector<attnserve::Client*> replicas = {a.get(), b.get()};
//   ATTNSERVE_ASSIGN_OR_RETURN(attnserve::v1::AttendResponse response,
//                              attnserve::ShardedAttend(replicas, request, /*shards=*/4,
//                                                       absl::Seconds(30)));
// clang-format on
//
// Shard s covers keys [s·Lk/n, (s+1)·Lk/n) and goes to
// replicas[s % replicas.size()], all shards at once. Each returns its output
// o_s and lse_s over its own keys; the merge is exact:
//
// clang-format off
//   lse = log Σ_s exp(lse_s),   o = Σ_s exp(lse_s − lse) · o_s
// clang-format on
//
// (in double precision). Every option carries over: key_lengths are cut per
// shard, a mask is cut along Lk, and causality becomes a per-shard mask with
// the global key positions (a causal request with a mask materialises a float
// mask [B, H, Lq, Lk/n] per shard). A row that sees no key in any shard gets
// output 0 and lse −inf, as from one call.
#ifndef ATTNSERVE_CLIENT_SHARDED_ATTENTION_H_
#define ATTNSERVE_CLIENT_SHARDED_ATTENTION_H_

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "attnserve/client/client.h"

namespace attnserve {

// Computes `request` in `shards` pieces (1 to Lk) over `clients` (at least one)
// and merges them. INVALID_ARGUMENT for a malformed request, a shard count out
// of range, or return_weights (each shard sees only its keys); otherwise the
// first failing shard's status. The response's timing holds the slowest shard's
// queue and compute times.
absl::StatusOr<v1::AttendResponse> ShardedAttend(
    absl::Span<Client* const> clients, const v1::AttendRequest& request,
    int shards, absl::Duration timeout);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_SHARDED_ATTENTION_H_
