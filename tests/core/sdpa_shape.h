// A compact way for engine tests to write an SDPA shape.
#ifndef ATTNSERVE_TESTS_CORE_SDPA_SHAPE_H_
#define ATTNSERVE_TESTS_CORE_SDPA_SHAPE_H_

#include <cstdint>

#include "attnserve/core/attention_types.h"

namespace attnserve::testing {

// [B, H, Hkv, Lq, Lk] with head dimensions Dk and Dv.
inline AttentionShape SdpaShape(int64_t b, int64_t h, int64_t hkv, int64_t lq,
                                int64_t lk, int64_t dk, int64_t dv) {
  AttentionShape shape;
  shape.batch = b;
  shape.heads = h;
  shape.kv_heads = hkv;
  shape.query_len = lq;
  shape.key_len = lk;
  shape.key_dim = dk;
  shape.value_dim = dv;
  return shape;
}

// [B, H, Hkv, Lq, Lk] with Dk = Dv = d.
inline AttentionShape SdpaShape(int64_t b, int64_t h, int64_t hkv, int64_t lq,
                                int64_t lk, int64_t d) {
  return SdpaShape(b, h, hkv, lq, lk, d, d);
}

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_CORE_SDPA_SHAPE_H_
