#include "attnserve/server/weights/weights_validator.h"

#include "absl/strings/str_cat.h"
#include "attnserve/common/checked_math.h"
#include "attnserve/common/echo.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/server/tensors/tensor_checks.h"
#include "attnserve/server/tensors/tensor_codec.h"

namespace attnserve {
namespace {

// An optional bias: absent, or a vector of `expected` elements.
absl::Status CheckBias(const std::string& field, bool present,
                       const v1::Tensor& bias, int64_t expected,
                       const std::string& why) {
  if (!present) return absl::OkStatus();
  ATTNSERVE_RETURN_IF_ERROR(
      CheckTensor(field, true, bias, kFloatDTypes, {"out"}));
  return CheckDimEquals(DimField(field, 0, "out"), bias.shape(0), expected,
                        why);
}

absl::StatusOr<int64_t> PerHead(const std::string& field, int64_t rows,
                                int64_t heads, const std::string& heads_field) {
  if (heads > rows) {
    return absl::InvalidArgumentError(absl::StrCat(heads_field, " is ", heads,
                                                   ", expected a divisor of ",
                                                   rows, " (", field, ")"));
  }
  if (rows % heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is ", rows, ", expected a multiple of ", heads,
                     " (", heads_field, ")"));
  }
  return rows / heads;
}

}  // namespace

absl::StatusOr<WeightsShape> ValidateProjectionWeights(
    const v1::ProjectionWeights& w, const std::string& field) {
  const std::string f = field + ".";
  WeightsShape s;
  if (w.num_heads() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(f, "num_heads is ", w.num_heads(), ", expected > 0"));
  }
  s.heads = w.num_heads();
  s.kv_heads = w.num_kv_heads() == 0 ? s.heads : w.num_kv_heads();
  if (s.kv_heads < 0 || s.heads % s.kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(f, "num_kv_heads is ", w.num_kv_heads(),
                     ", expected 0 (= num_heads) or a divisor of ", s.heads,
                     " (", f, "num_heads)"));
  }
  ATTNSERVE_RETURN_IF_ERROR(CheckTensor(f + "w_q", w.has_w_q(), w.w_q(),
                                        kFloatDTypes, {"H·Dk", "E"}));
  ATTNSERVE_RETURN_IF_ERROR(CheckTensor(f + "w_k", w.has_w_k(), w.w_k(),
                                        kFloatDTypes, {"Hkv·Dk", "Ekv"}));
  ATTNSERVE_RETURN_IF_ERROR(CheckTensor(f + "w_v", w.has_w_v(), w.w_v(),
                                        kFloatDTypes, {"Hkv·Dv", "Ekv"}));
  ATTNSERVE_RETURN_IF_ERROR(CheckTensor(f + "w_o", w.has_w_o(), w.w_o(),
                                        kFloatDTypes, {"E", "H·Dv"}));
  s.embed_dim = w.w_q().shape(1);
  s.kv_embed_dim = w.w_k().shape(1);
  ATTNSERVE_ASSIGN_OR_RETURN(
      s.key_dim, PerHead(DimField(f + "w_q", 0, "H·Dk"), w.w_q().shape(0),
                         s.heads, f + "num_heads"));
  ATTNSERVE_RETURN_IF_ERROR(
      CheckDimEquals(DimField(f + "w_k", 0, "Hkv·Dk"), w.w_k().shape(0),
                     s.kv_heads * s.key_dim,
                     absl::StrCat(f, "num_kv_heads × Dk, Dk from ", f, "w_q")));
  ATTNSERVE_RETURN_IF_ERROR(CheckDimEquals(DimField(f + "w_v", 1, "Ekv"),
                                           w.w_v().shape(1), s.kv_embed_dim,
                                           DimField(f + "w_k", 1, "Ekv")));
  ATTNSERVE_ASSIGN_OR_RETURN(
      s.value_dim,
      PerHead(DimField(f + "w_v", 0, "Hkv·Dv"), w.w_v().shape(0), s.kv_heads,
              w.num_kv_heads() == 0
                  ? absl::StrCat(f, "num_kv_heads (0: ", f, "num_heads)")
                  : f + "num_kv_heads"));
  ATTNSERVE_RETURN_IF_ERROR(CheckDimEquals(DimField(f + "w_o", 0, "E"),
                                           w.w_o().shape(0), s.embed_dim,
                                           DimField(f + "w_q", 1, "E")));
  ATTNSERVE_RETURN_IF_ERROR(CheckDimEquals(
      DimField(f + "w_o", 1, "H·Dv"), w.w_o().shape(1), s.heads * s.value_dim,
      absl::StrCat(f, "num_heads × Dv, Dv from ", f, "w_v")));
  ATTNSERVE_RETURN_IF_ERROR(CheckBias(f + "b_q", w.has_b_q(), w.b_q(),
                                      s.heads * s.key_dim, f + "w_q.shape[0]"));
  ATTNSERVE_RETURN_IF_ERROR(CheckBias(f + "b_k", w.has_b_k(), w.b_k(),
                                      s.kv_heads * s.key_dim,
                                      f + "w_k.shape[0]"));
  ATTNSERVE_RETURN_IF_ERROR(CheckBias(f + "b_v", w.has_b_v(), w.b_v(),
                                      s.kv_heads * s.value_dim,
                                      f + "w_v.shape[0]"));
  ATTNSERVE_RETURN_IF_ERROR(CheckBias(f + "b_o", w.has_b_o(), w.b_o(),
                                      s.embed_dim, f + "w_q.shape[1] (E)"));
  if (w.has_rope()) {
    ATTNSERVE_RETURN_IF_ERROR(
        ValidateRotary(RotaryOf(w.rope()), s.key_dim, (f + "rope").c_str()));
    s.rope = true;
  }
  return s;
}

absl::Status ValidateWeightsName(const std::string& field,
                                 const std::string& name) {
  if (!name.empty() && IsPlainName(name, 128)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " is ", EchoText(name),
                   ", expected 1 to 128 characters of [A-Za-z0-9._-]"));
}

}  // namespace attnserve
