// The fused kernel's paged path: attention of many sequences' queries over
// their paged caches (attnserve/core/paged_attention.h) in one parallel pass.
//
// The work is cut into units — (item, kv head, block of query rows, split of
// the keys) — handed to the threads of one OpenMP team, so that a call of 64
// decode steps wakes the team once. Each unit walks its keys a block at a time
// with the online softmax (as the fused tiles do); a key range split for
// parallelism is merged by log-sum-exp at the end of the same pass.
#ifndef ATTNSERVE_CORE_INTERNAL_PAGED_ATTENTION_H_
#define ATTNSERVE_CORE_INTERNAL_PAGED_ATTENTION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "attnserve/core/paged_attention.h"

namespace attnserve::internal {

// INVALID_ARGUMENT naming the item and the field if an item's layout, sizes or
// spans do not fit together.
absl::Status ValidatePagedAttend(absl::Span<const PagedAttend> items);

// The scratch bytes RunPagedAttention allocates for `items` on `threads`
// threads. The items must be valid: their spans bound every size.
int64_t PagedWorkspaceBytes(absl::Span<const PagedAttend> items, int threads);

// PageLayout::keys_transposed for caches this CPU's kernel reads fastest
// (attnserve/core/paged_attention.h: PreferredKeysTransposed).
bool PagedKeysTransposedOnThisCpu();

// Whether this CPU runs the AVX2 code (PagedCode::kAvx2): AVX2 and FMA.
bool PagedAvx2OnThisCpu();

// The code RunPagedAttention runs: the best this CPU has, its AVX2 code (which
// the CPU must have: PagedAvx2OnThisCpu), or the baseline x86-64 code. Tests
// cover the latter two on any machine that way.
enum class PagedCode { kNative, kAvx2, kPortable };

// Computes every item on up to `threads` threads with `code`. The items must
// be valid (ValidatePagedAttend). `stop` is polled between units and every
// 1,024 keys within one; once it says stop, the call returns its error with
// the outputs undefined.
absl::Status RunPagedAttention(absl::Span<const PagedAttend> items, int threads,
                               PagedCode code, const StopCheck& stop);

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_PAGED_ATTENTION_H_
