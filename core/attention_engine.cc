#include "attnserve/core/attention_engine.h"

#include <omp.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/common/checked_math.h"
#include "attnserve/common/status_macros.h"
#include "internal/dnnl_status.h"
#include "internal/fused_attention.h"
#include "internal/linear.h"
#include "internal/sdpa_problem.h"
#include "internal/unfused_attention.h"
#include "internal/validation.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve {
namespace {

using internal::LinearProblem;
using internal::MakeSdpaProblem;
using internal::SdpaProblem;

// Scores beyond this many bytes per slab stop paying for themselves: they no
// longer fit any cache, and a slab this size already gives every core work.
constexpr int64_t kSlabTargetBytes = int64_t{64} << 20;

// Calls with fewer FLOPs run on one thread.
constexpr double kParallelFlops = 1 << 20;

// The engine sizes its thread team on the full (non-causal) count.
double AttentionFlops(const AttentionShape& s) {
  return AttentionFlops(s.Dims(), /*causal=*/false);
}

class AttentionEngineImpl final : public AttentionEngine {
 public:
  AttentionEngineImpl(const EngineOptions& options, dnnl::engine engine)
      : options_(options),
        engine_(std::move(engine)),
        threads_(options.num_threads > 0 ? options.num_threads
                                         : omp_get_max_threads()),
        kernels_(internal::SelectTileKernels(options.portable_kernels)) {}

  absl::Status Attend(const AttentionShape& shape,
                      const AttentionOptions& options,
                      absl::Span<const float> query,
                      absl::Span<const float> key,
                      absl::Span<const float> value,
                      AttentionOutputs outputs) override {
    ATTNSERVE_RETURN_IF_ERROR(
        ValidateInputs(shape, options, query, key, value, outputs));
    ATTNSERVE_RETURN_IF_ERROR(CheckWorkspace(
        absl::StrCat("attention for shape ", shape.DebugString()),
        AttendWorkspaceBytes(shape, options)));

    SdpaProblem problem = MakeSdpaProblem(shape, options, outputs);
    problem.query = query.data();
    problem.key = key.data();
    problem.value = value.data();
    problem.output = outputs.output.data();
    ATTNSERVE_ASSIGN_OR_RETURN(dnnl::stream stream,
                               NewStream(AttentionFlops(shape)));
    return RunSdpa(stream, problem, AttentionFlops(shape));
  }

  std::optional<int64_t> AttendWorkspaceBytes(
      const AttentionShape& shape,
      const AttentionOptions& options) const override {
    return SdpaWorkspaceBytes(shape, options, /*key_value_packed=*/true);
  }

  absl::Status AttendBatch(const AttentionShape& shape,
                           const AttentionOptions& options,
                           absl::Span<const AttendPart> parts) override {
    if (!AttendBatchable(options)) {
      return absl::InvalidArgumentError(
          "AttendBatch takes options without weights, key_lengths or a mask "
          "over the batch, on the fused kernel");
    }
    if (parts.empty()) {
      return absl::InvalidArgumentError(
          "AttendBatch has no parts, expected 1+");
    }
    AttentionShape total = shape;
    total.batch = 0;
    AttentionShape entry_shape = shape;  // One batch entry.
    entry_shape.batch = 1;
    std::vector<internal::BatchTensors> batches;
    for (size_t i = 0; i < parts.size(); ++i) {
      const AttendPart& part = parts[i];
      AttentionShape part_shape = shape;
      part_shape.batch = part.batch;
      const absl::Status valid = ValidateInputs(
          part_shape, options, part.query, part.key, part.value, part.outputs);
      if (!valid.ok()) {
        return absl::Status(valid.code(), absl::StrCat("AttendBatch part ", i,
                                                       ": ", valid.message()));
      }
      if (__builtin_add_overflow(total.batch, part.batch, &total.batch)) {
        return absl::InvalidArgumentError("AttendBatch: B overflows int64");
      }
      for (int64_t b = 0; b < part.batch; ++b) {
        internal::BatchTensors entry;
        entry.query = part.query.data() + b * entry_shape.QueryElements();
        entry.key = part.key.data() + b * entry_shape.KeyElements();
        entry.value = part.value.data() + b * entry_shape.ValueElements();
        entry.output =
            part.outputs.output.data() + b * entry_shape.OutputElements();
        if (options.return_lse) {
          entry.lse = part.outputs.lse.data() + b * entry_shape.LseElements();
        }
        batches.push_back(entry);
      }
    }
    ATTNSERVE_RETURN_IF_ERROR(internal::ValidateShape(total));
    ATTNSERVE_RETURN_IF_ERROR(CheckWorkspace(
        absl::StrCat("attention for shape ", total.DebugString()),
        AttendWorkspaceBytes(total, options)));

    SdpaProblem problem =
        MakeSdpaProblem(total, options, AttentionOutputs(absl::Span<float>()));
    problem.batches = batches;
    ATTNSERVE_ASSIGN_OR_RETURN(dnnl::stream stream,
                               NewStream(AttentionFlops(total)));
    return RunSdpa(stream, problem, AttentionFlops(total));
  }

  bool AttendBatchable(const AttentionOptions& options) const override {
    return UseFused(options) && options.key_lengths.empty() &&
           (!options.mask || options.mask->dims[0] == 1);
  }

  bool AttendRunsOnCallingThread(const AttentionShape& shape) const override {
    return AttentionFlops(shape) < kParallelFlops;
  }

  absl::Status MultiHeadAttention(const MultiHeadShape& shape,
                                  const ProjectionWeights& weights,
                                  const AttentionOptions& options,
                                  absl::Span<const float> query_input,
                                  absl::Span<const float> kv_input,
                                  AttentionOutputs outputs) override {
    const bool self_attention = kv_input.empty();
    ATTNSERVE_RETURN_IF_ERROR(
        internal::ValidateMultiHead(shape, weights, self_attention));
    ATTNSERVE_RETURN_IF_ERROR(internal::ValidateSpanSize(
        "query_input", query_input.size(),
        shape.batch * shape.query_len * shape.embed_dim));
    if (!self_attention) {
      ATTNSERVE_RETURN_IF_ERROR(internal::ValidateSpanSize(
          "kv_input", kv_input.size(),
          shape.batch * shape.key_len * shape.kv_embed_dim));
    }
    const AttentionShape heads = shape.Heads();
    ATTNSERVE_RETURN_IF_ERROR(internal::ValidateOptionsAndOutputs(
        heads, options, outputs,
        shape.batch * shape.query_len * shape.embed_dim));

    const int64_t q_out = shape.heads * shape.key_dim;
    const int64_t kv_out = shape.kv_heads * (shape.key_dim + shape.value_dim);
    const int64_t context_out = shape.heads * shape.value_dim;
    const bool fused = self_attention && !weights.w_qkv.empty();
    ATTNSERVE_RETURN_IF_ERROR(CheckWorkspace(
        absl::StrCat("multi-head attention for heads ", heads.DebugString()),
        CheckedSum({CheckedProduct(
                        {shape.batch, shape.query_len, q_out + context_out, 4}),
                    CheckedProduct({shape.batch, shape.key_len, kv_out, 4}),
                    LargestProjectionWorkspace(shape, fused, options.precision),
                    SdpaWorkspaceBytes(heads, options,
                                       /*key_value_packed=*/false)})));

    const double flops = MultiHeadFlops(heads.Dims(), shape.Projections(),
                                        /*causal=*/false);
    ATTNSERVE_ASSIGN_OR_RETURN(dnnl::stream stream, NewStream(flops));
    // Projections, laid out [B, L, heads·D] and read as [B, heads, L, D]
    // through strides.
    const int64_t q_rows = shape.batch * shape.query_len;
    const int64_t kv_rows = shape.batch * shape.key_len;
    std::vector<float> projected;
    SdpaProblem problem = MakeSdpaProblem(heads, options, outputs);
    if (fused) {
      const int64_t width = q_out + kv_out;
      projected.resize(static_cast<size_t>(q_rows * width));
      ATTNSERVE_RETURN_IF_ERROR(
          RunLinear(stream,
                    {q_rows, shape.embed_dim, width, query_input.data(),
                     shape.embed_dim, weights.w_qkv.data(),
                     OrNull(weights.b_qkv), projected.data(), width},
                    options.precision));
      SetProjectedViews(shape, projected.data(), width,
                        projected.data() + q_out, width, &problem);
    } else {
      projected.resize(static_cast<size_t>(q_rows * q_out + kv_rows * kv_out));
      float* q = projected.data();
      float* kv = q + q_rows * q_out;
      const float* kv_source =
          self_attention ? query_input.data() : kv_input.data();
      const int64_t k_out = shape.kv_heads * shape.key_dim;
      const LinearProblem projections[] = {
          {q_rows, shape.embed_dim, q_out, query_input.data(), shape.embed_dim,
           weights.w_q.data(), OrNull(weights.b_q), q, q_out},
          {kv_rows, shape.kv_embed_dim, k_out, kv_source, shape.kv_embed_dim,
           weights.w_k.data(), OrNull(weights.b_k), kv, kv_out},
          {kv_rows, shape.kv_embed_dim, kv_out - k_out, kv_source,
           shape.kv_embed_dim, weights.w_v.data(), OrNull(weights.b_v),
           kv + k_out, kv_out}};
      for (const LinearProblem& projection : projections) {
        ATTNSERVE_RETURN_IF_ERROR(
            RunLinear(stream, projection, options.precision));
      }
      SetProjectedViews(shape, q, q_out, kv, kv_out, &problem);
    }

    std::vector<float> context(static_cast<size_t>(q_rows * context_out));
    problem.output = context.data();
    problem.output_strides = {shape.query_len * context_out, shape.value_dim,
                              context_out, 1};
    ATTNSERVE_RETURN_IF_ERROR(RunSdpa(stream, problem, flops));
    return RunLinear(stream,
                     {q_rows, context_out, shape.embed_dim, context.data(),
                      context_out, weights.w_o.data(), OrNull(weights.b_o),
                      outputs.output.data(), shape.embed_dim},
                     options.precision);
  }

 private:
  bool UseFused(const AttentionOptions& options) const {
    return options_.kernel == AttentionKernel::kAuto &&
           options.weights == AttentionWeightsMode::kNone;
  }

  // Validates an Attend's (or an AttendBatch part's) shape, spans and options.
  static absl::Status ValidateInputs(const AttentionShape& shape,
                                     const AttentionOptions& options,
                                     absl::Span<const float> query,
                                     absl::Span<const float> key,
                                     absl::Span<const float> value,
                                     const AttentionOutputs& outputs) {
    ATTNSERVE_RETURN_IF_ERROR(internal::ValidateShape(shape));
    ATTNSERVE_RETURN_IF_ERROR(internal::ValidateSpanSize(
        "query", query.size(), shape.QueryElements()));
    ATTNSERVE_RETURN_IF_ERROR(
        internal::ValidateSpanSize("key", key.size(), shape.KeyElements()));
    ATTNSERVE_RETURN_IF_ERROR(internal::ValidateSpanSize(
        "value", value.size(), shape.ValueElements()));
    return internal::ValidateOptionsAndOutputs(shape, options, outputs,
                                               shape.OutputElements());
  }

  // The team size of a call of `flops` (see NewStream).
  int TeamSize(double flops) const {
    return flops < kParallelFlops ? 1 : threads_;
  }

  std::optional<int64_t> SdpaWorkspaceBytes(const AttentionShape& shape,
                                            const AttentionOptions& options,
                                            bool key_value_packed) const {
    if (UseFused(options)) {
      return internal::FusedWorkspaceBytes(shape, options.precision, threads_,
                                           key_value_packed);
    }
    return internal::UnfusedWorkspaceBytes(shape, options.precision,
                                           SlabBudget(), key_value_packed);
  }

  // The attention itself, by the path the options call for.
  absl::Status RunSdpa(dnnl::stream& stream, const SdpaProblem& problem,
                       double flops) {
    if (UseFused(*problem.options)) {
      return internal::RunFusedAttention(engine_, problem, TeamSize(flops),
                                         kernels_, tile_plans_, scratch_);
    }
    return internal::RunUnfusedAttention(engine_, stream, problem, SlabBudget(),
                                         plans_);
  }

  // The most scratch any one of the call's projections needs (they run one at a
  // time).
  static int64_t LargestProjectionWorkspace(const MultiHeadShape& s, bool fused,
                                            Precision precision) {
    const int64_t q_rows = s.batch * s.query_len, kv_rows = s.batch * s.key_len;
    const int64_t q_out = s.heads * s.key_dim, k_out = s.kv_heads * s.key_dim,
                  v_out = s.kv_heads * s.value_dim,
                  context_out = s.heads * s.value_dim;
    const LinearProblem fused_qkv[] = {
        {q_rows, s.embed_dim, q_out + k_out + v_out}};
    const LinearProblem separate[] = {{q_rows, s.embed_dim, q_out},
                                      {kv_rows, s.kv_embed_dim, k_out},
                                      {kv_rows, s.kv_embed_dim, v_out}};
    int64_t largest = internal::LinearWorkspaceBytes(
        {q_rows, context_out, s.embed_dim}, precision);
    for (const LinearProblem& p : fused ? absl::MakeConstSpan(fused_qkv)
                                        : absl::MakeConstSpan(separate)) {
      largest = std::max(largest, internal::LinearWorkspaceBytes(p, precision));
    }
    return largest;
  }

  static const float* OrNull(absl::Span<const float> span) {
    return span.empty() ? nullptr : span.data();
  }

  // Q at `q` with `q_width` columns per row, K then V at `kv` with `kv_width`
  // per row.
  static void SetProjectedViews(const MultiHeadShape& shape, const float* q,
                                int64_t q_width, const float* kv,
                                int64_t kv_width, SdpaProblem* problem) {
    problem->query = q;
    problem->query_strides = {shape.query_len * q_width, shape.key_dim, q_width,
                              1};
    problem->key = kv;
    problem->key_strides = {shape.key_len * kv_width, shape.key_dim, kv_width,
                            1};
    problem->value = kv + shape.kv_heads * shape.key_dim;
    problem->value_strides = {shape.key_len * kv_width, shape.value_dim,
                              kv_width, 1};
  }

  absl::Status RunLinear(dnnl::stream& stream, const LinearProblem& problem,
                         Precision precision) {
    return internal::RunLinear(engine_, stream, problem, precision);
  }

  RuntimeInfo runtime_info() const override {
    RuntimeInfo info;
    const dnnl_version_t* version = dnnl_version();
    info.onednn_version =
        absl::StrCat(version->major, ".", version->minor, ".", version->patch);
    info.threading = version->cpu_runtime == DNNL_RUNTIME_OMP   ? "OMP"
                     : version->cpu_runtime == DNNL_RUNTIME_TBB ? "TBB"
                     : version->cpu_runtime == DNNL_RUNTIME_SEQ ? "SEQ"
                                                                : "other";
    info.cpu_isa = IsaName(dnnl::get_effective_cpu_isa());
    info.threads = threads_;
    info.kernels = kernels_.name;
    return info;
  }

  static const char* IsaName(dnnl::cpu_isa isa) {
    switch (isa) {
      case dnnl::cpu_isa::sse41:
        return "sse41";
      case dnnl::cpu_isa::avx:
        return "avx";
      case dnnl::cpu_isa::avx2:
        return "avx2";
      case dnnl::cpu_isa::avx2_vnni:
        return "avx2_vnni";
      case dnnl::cpu_isa::avx512_core:
        return "avx512_core";
      case dnnl::cpu_isa::avx512_core_vnni:
        return "avx512_core_vnni";
      case dnnl::cpu_isa::avx512_core_bf16:
        return "avx512_core_bf16";
      case dnnl::cpu_isa::avx512_core_amx:
        return "avx512_core_amx";
      default:
        return "other";
    }
  }

  int64_t SlabBudget() const {
    return std::min(options_.max_workspace_bytes, kSlabTargetBytes);
  }

  absl::Status CheckWorkspace(const std::string& what,
                              std::optional<int64_t> bytes) const {
    if (bytes && *bytes <= options_.max_workspace_bytes)
      return absl::OkStatus();
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " needs ",
        bytes ? absl::StrCat(*bytes, " bytes") : "more than 2^63 bytes",
        " of scratch, over the engine's workspace limit of ",
        options_.max_workspace_bytes, " bytes"));
  }

  // A stream for one call, with the calling thread's OpenMP team sized for
  // `flops`: a call too small to share (under kParallelFlops) runs on the
  // calling thread alone, since waking a team for each parallel region costs
  // more than its arithmetic.
  absl::StatusOr<dnnl::stream> NewStream(double flops) {
    omp_set_num_threads(TeamSize(flops));
    dnnl::stream stream;
    ATTNSERVE_RETURN_IF_ERROR(internal::CallDnnl(
        "creating a stream", [&] { stream = dnnl::stream(engine_); }));
    return stream;
  }

  const EngineOptions options_;
  const dnnl::engine engine_;
  const int threads_;  // The team size of calls big enough to share.
  const internal::TileKernels& kernels_;
  // Built matmuls by shape, kept across calls (64 shapes at most each).
  internal::SlabPlanCache plans_{64};
  internal::TilePlanCache tile_plans_{64};
  // The fused kernel's scratch, kept between calls: up to 4 buffers of at most
  // 64 MiB each.
  internal::ScratchPool scratch_{4, int64_t{64} << 20};
};

}  // namespace

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

}  // namespace attnserve
