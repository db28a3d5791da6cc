#include "attnserve/core/attention_types.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace attnserve {

std::string AttentionShape::DebugString() const {
  return absl::StrCat("[B=", batch, ", H=", heads, ", Hkv=", kv_heads,
                      ", Lq=", query_len, ", Lk=", key_len, ", Dk=", key_dim,
                      ", Dv=", value_dim, "]");
}

AttentionShape MultiHeadShape::Heads() const {
  AttentionShape shape;
  shape.batch = batch;
  shape.heads = heads;
  shape.kv_heads = kv_heads;
  shape.query_len = query_len;
  shape.key_len = key_len;
  shape.key_dim = key_dim;
  shape.value_dim = value_dim;
  return shape;
}

std::string RuntimeInfo::Description() const {
  return absl::StrCat("oneDNN ", onednn_version, " (", threading, "), ",
                      cpu_isa, ", ", threads, " threads, ", kernels,
                      " kernels");
}

absl::Status SoftcapRefusal(absl::string_view field, float softcap) {
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s is %.9g, expected a finite number >= %.9g (the smallest normal "
      "float), or absent for none",
      field, softcap, kMinSoftcap));
}

}  // namespace attnserve
