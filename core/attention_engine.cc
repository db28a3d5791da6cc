#include "attnserve/core/attention_engine.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnserve/core/checked_math.h"
#include "attnserve/core/status_macros.h"
#include "internal/dnnl_status.h"
#include "internal/unfused_attention.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve {
namespace {

// Scores beyond this many bytes per slab stop paying for themselves: they no
// longer fit any cache, and a slab this size already gives every core work.
constexpr int64_t kSlabTargetBytes = int64_t{64} << 20;

absl::Status ValidateShape(const AttentionShape& shape) {
  const std::pair<const char*, int64_t> dims[] = {
      {"batch", shape.batch},        {"heads", shape.heads},
      {"kv_heads", shape.kv_heads},  {"query_len", shape.query_len},
      {"key_len", shape.key_len},    {"key_dim", shape.key_dim},
      {"value_dim", shape.value_dim}};
  for (const auto& [name, value] : dims) {
    if (value <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape.", name, " is ", value, ", expected > 0"));
    }
  }
  if (shape.heads % shape.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shape.heads is ", shape.heads,
        ", expected a multiple of shape.kv_heads (", shape.kv_heads, ")"));
  }
  if (!CheckedProduct(
          {shape.batch, shape.heads, shape.query_len, shape.key_dim}) ||
      !CheckedProduct(
          {shape.batch, shape.kv_heads, shape.key_len, shape.key_dim}) ||
      !CheckedProduct(
          {shape.batch, shape.kv_heads, shape.key_len, shape.value_dim}) ||
      !CheckedProduct(
          {shape.batch, shape.heads, shape.query_len, shape.value_dim})) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape ", shape.DebugString(),
                     " has more than 2^63 elements in a tensor"));
  }
  return absl::OkStatus();
}

absl::Status ValidateSpanSize(const char* name, size_t actual,
                              int64_t expected) {
  if (static_cast<int64_t>(actual) != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " has ", actual, " elements, expected ", expected));
  }
  return absl::OkStatus();
}

class AttentionEngineImpl final : public AttentionEngine {
 public:
  AttentionEngineImpl(const EngineOptions& options, dnnl::engine engine)
      : options_(options), engine_(std::move(engine)) {}

  absl::Status Attend(const AttentionShape& shape,
                      const AttentionOptions& options,
                      absl::Span<const float> query,
                      absl::Span<const float> key,
                      absl::Span<const float> value,
                      absl::Span<float> output) override {
    ATTNSERVE_RETURN_IF_ERROR(ValidateShape(shape));
    ATTNSERVE_RETURN_IF_ERROR(
        ValidateSpanSize("query", query.size(), shape.QueryElements()));
    ATTNSERVE_RETURN_IF_ERROR(
        ValidateSpanSize("key", key.size(), shape.KeyElements()));
    ATTNSERVE_RETURN_IF_ERROR(
        ValidateSpanSize("value", value.size(), shape.ValueElements()));
    ATTNSERVE_RETURN_IF_ERROR(
        ValidateSpanSize("output", output.size(), shape.OutputElements()));
    if (options.scale && !std::isfinite(*options.scale)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "options.scale is ", *options.scale, ", expected a finite number"));
    }
    const std::optional<int64_t> workspace = WorkspaceBytes(shape);
    if (!workspace || *workspace > options_.max_workspace_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "attention scores for shape ", shape.DebugString(), " need ",
          workspace ? absl::StrCat(*workspace, " bytes")
                    : std::string("more than 2^63 bytes"),
          ", over the engine's workspace limit of ",
          options_.max_workspace_bytes, " bytes"));
    }
    const float scale = options.scale.value_or(
        1.0f / std::sqrt(static_cast<float>(shape.key_dim)));

    if (options_.num_threads > 0) omp_set_num_threads(options_.num_threads);
    dnnl::stream stream;
    ATTNSERVE_RETURN_IF_ERROR(internal::CallDnnl(
        "creating a stream", [&] { stream = dnnl::stream(engine_); }));
    return internal::RunUnfusedAttention(
        engine_, stream, shape, scale, query.data(), key.data(), value.data(),
        output.data(),
        std::min(options_.max_workspace_bytes, kSlabTargetBytes));
  }

  std::optional<int64_t> WorkspaceBytes(
      const AttentionShape& shape) const override {
    if (shape.kv_heads <= 0) return std::nullopt;
    return CheckedProduct({shape.heads / shape.kv_heads, shape.query_len,
                           shape.key_len, int64_t{sizeof(float)}});
  }

 private:
  const EngineOptions options_;
  const dnnl::engine engine_;
};

}  // namespace

std::string AttentionShape::DebugString() const {
  return absl::StrCat("[B=", batch, ", H=", heads, ", Hkv=", kv_heads,
                      ", Lq=", query_len, ", Lk=", key_len, ", Dk=", key_dim,
                      ", Dv=", value_dim, "]");
}

absl::StatusOr<std::unique_ptr<AttentionEngine>> AttentionEngine::Create(
    const EngineOptions& options) {
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_threads is ", options.num_threads, ", expected >= 0"));
  }
  if (options.max_workspace_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_workspace_bytes is ",
                                                   options.max_workspace_bytes,
                                                   ", expected > 0"));
  }
  dnnl::engine engine;
  ATTNSERVE_RETURN_IF_ERROR(internal::CallDnnl("creating a CPU engine", [&] {
    engine = dnnl::engine(dnnl::engine::kind::cpu, 0);
  }));
  return std::unique_ptr<AttentionEngine>(
      new AttentionEngineImpl(options, std::move(engine)));
}

std::string AttentionEngine::RuntimeDescription() {
  const dnnl_version_t* version = dnnl_version();
  const char* runtime = version->cpu_runtime == DNNL_RUNTIME_OMP   ? "OMP"
                        : version->cpu_runtime == DNNL_RUNTIME_TBB ? "TBB"
                        : version->cpu_runtime == DNNL_RUNTIME_SEQ ? "SEQ"
                                                                   : "other";
  return absl::StrCat("oneDNN ", version->major, ".", version->minor, ".",
                      version->patch, " (", runtime, ")");
}

}  // namespace attnserve
