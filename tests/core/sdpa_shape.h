// A compact way for engine tests to write an SDPA shape.
#ifndef ATTNSERVE_TESTS_CORE_SDPA_SHAPE_H_
#define ATTNSERVE_TESTS_CORE_SDPA_SHAPE_H_

#include <cstdint>

#include "attnserve/core/attention_engine.h"

namespace attnserve::testing {

// [B, H, Hkv, Lq, Lk] with Dk = Dv = d.
inline AttentionShape SdpaShape(int64_t b, int64_t h, int64_t hkv, int64_t lq,
                                int64_t lk, int64_t d) {
  AttentionShape shape;
  shape.batch = b;
  shape.heads = h;
  shape.kv_heads = hkv;
  shape.query_len = lq;
  shape.key_len = lk;
  shape.key_dim = shape.value_dim = d;
  return shape;
}

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_CORE_SDPA_SHAPE_H_
