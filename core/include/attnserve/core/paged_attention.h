// Attention over a KV cache kept in pages (the server's sessions): the value
// types AttentionEngine::AttendPaged takes.
//
// A page holds `page_tokens` consecutive tokens of one sequence's layer, kv
// head after kv head: each head's keys [page_tokens, Dk] (or, transposed,
// [Dk, page_tokens]), then that head's values [page_tokens, Dv], packed
// row-major in the cache's dtype (f32, bf16 or f16). A kernel reading one
// head reads one run of bytes per page. The kernel reads the pages where they
// lie, in that dtype: a block of a page is converted to f32 in a thread's
// cache-sized buffer as it is used, never copied whole.
#ifndef ATTNSERVE_CORE_PAGED_ATTENTION_H_
#define ATTNSERVE_CORE_PAGED_ATTENTION_H_

#include <cstdint>

#include "absl/types/span.h"
#include "attnserve/common/dtype.h"
#include "attnserve/common/flops.h"
#include "attnserve/core/attention_types.h"

namespace attnserve {

// How every page of a cache is laid out.
struct PageLayout {
  int64_t page_tokens = 64;
  int64_t kv_heads = 1;   // Hkv
  int64_t key_dim = 1;    // Dk
  int64_t value_dim = 1;  // Dv
  DataType dtype = DataType::kFloat32;
  // A head's keys [Dk, page_tokens]: transposed, one key dimension of all
  // the page's tokens side by side (the sessions' pages where
  // PreferredKeysTransposed() says so). The kernel then takes the scores of
  // many keys at once as the lanes of vectors, with no sum across lanes for
  // each score, which costs as many instructions as the products. False:
  // [page_tokens, Dk], each key a row (a stateless call's key tensor read as
  // pages).
  bool keys_transposed = false;

  // Bytes of one kv head's keys and of its values in a page.
  int64_t HeadKeyBytes() const {
    return page_tokens * key_dim * DataTypeBytes(dtype);
  }
  int64_t HeadValueBytes() const {
    return page_tokens * value_dim * DataTypeBytes(dtype);
  }
  // Bytes of a page's keys, of its values, and of the whole page.
  int64_t KeyBytes() const { return kv_heads * HeadKeyBytes(); }
  int64_t ValueBytes() const { return kv_heads * HeadValueBytes(); }
  int64_t PageBytes() const { return KeyBytes() + ValueBytes(); }
  // Where kv head `head`'s keys and its values start in a page: each head's
  // keys then values, so that the kernel, which reads one head at a time,
  // reads one run per page (a bf16 cache of 128 dimensions: 32 KiB), which
  // the CPU's prefetchers follow further than two runs apart (~1.2x the
  // read rate from DRAM, BENCHMARKS.md of 2026-12-04).
  int64_t KeysAt(int64_t head) const {
    return head * (HeadKeyBytes() + HeadValueBytes());
  }
  int64_t ValuesAt(int64_t head) const { return KeysAt(head) + HeadKeyBytes(); }
};

// The keys_transposed a cache should take on this CPU, for the paged kernel
// to read it fastest: true where the kernel runs on AVX-512, whose 32
// registers hold 64 keys' scores for four query rows at once (a bf16 cache
// read ~1.1-1.5x as fast as keys in rows); false on AVX2 and older CPUs,
// whose 16 registers hold a pass of only 16 keys, and where keys in rows read
// ~10-15% faster.
bool PreferredKeysTransposed();

// One query over one sequence's paged cache, causal with the bottom-right
// alignment: query row i (of query_len) sees the keys j <= i + length −
// query_len. A row that sees no key gets output 0 and lse −inf.
struct PagedAttend {
  PageLayout layout;
  // The cache's pages in token order: at least ceil(length / page_tokens).
  absl::Span<const char* const> pages;
  // Empty: each page holds each head's values after its keys (the layout
  // above). Otherwise the values of page p lie apart, at value_pages[p]
  // ([Hkv, page_tokens, Dv]), and pages[p] holds only keys ([Hkv,
  // page_tokens, Dk] or [Hkv, Dk, page_tokens]): a stateless call's key and
  // value tensors read as one page each.
  absl::Span<const char* const> value_pages;
  int64_t length = 0;             // L, tokens in the cache
  int64_t heads = 1;              // H, a multiple of layout.kv_heads
  int64_t query_len = 1;          // Tq
  absl::Span<const float> query;  // [H, Tq, Dk]
  float scale = 1.0f;
  // The variants of AttentionOptions (attention_types.h), with query i at
  // position i + L − Tq: a window reaching window_left keys back (−1:
  // unbounded), the first num_sink_tokens keys seen on top of it, a softcap
  // (0: none) and ALiBi slopes (empty or H). A page that no query row sees
  // (between the sinks and every row's window) may be null.
  int64_t window_left = -1;
  int64_t num_sink_tokens = 0;
  float softcap = 0.0f;
  absl::Span<const float> alibi_slopes;
  // kBFloat16 rounds the query, keys, values and probabilities to bf16 before
  // each product (f32 accumulation), as the fused kernel's bf16 matmuls do.
  Precision precision = Precision::kFloat32;
  absl::Span<float> output;  // [H, Tq, Dv]
  absl::Span<float> lse;     // [H, Tq], or empty

  // The counts attnserve/common/flops.h takes (the causal triangle's share is
  // small for decode, so the full Tq × L is counted).
  AttentionDims Dims() const {
    return {1.0,
            static_cast<double>(heads),
            static_cast<double>(query_len),
            static_cast<double>(length),
            static_cast<double>(layout.key_dim),
            static_cast<double>(layout.value_dim)};
  }
};

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_PAGED_ATTENTION_H_
