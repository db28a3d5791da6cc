// The engine behind AttentionEngine::Create. Its SDPA calls, the paths they
// take and its runtime are in attention_engine.cc; multi-head attention and its
// projections, which run SDPA between GEMMs, in multi_head_attention.cc.
#ifndef ATTNSERVE_CORE_INTERNAL_ATTENTION_ENGINE_IMPL_H_
#define ATTNSERVE_CORE_INTERNAL_ATTENTION_ENGINE_IMPL_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attnserve/core/attention_engine.h"
#include "internal/fused_attention.h"
#include "internal/linear.h"
#include "internal/scratch_pool.h"
#include "internal/sdpa_problem.h"
#include "internal/tile_kernels.h"
#include "internal/unfused_attention.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::internal {

class AttentionEngineImpl final : public AttentionEngine {
 public:
  AttentionEngineImpl(const EngineOptions& options, dnnl::engine engine);

  absl::Status Attend(const AttentionShape& shape,
                      const AttentionOptions& options,
                      absl::Span<const float> query,
                      absl::Span<const float> key,
                      absl::Span<const float> value,
                      AttentionOutputs outputs) override;
  std::optional<int64_t> AttendWorkspaceBytes(
      const AttentionShape& shape,
      const AttentionOptions& options) const override;
  absl::Status AttendBatch(const AttentionShape& shape,
                           const AttentionOptions& options,
                           absl::Span<const AttendPart> parts) override;
  bool AttendBatchable(const AttentionOptions& options) const override;
  absl::Status AttendPacked(const PackedShape& shape,
                            const AttentionOptions& options,
                            absl::Span<const float> query,
                            absl::Span<const float> key,
                            absl::Span<const float> value,
                            AttentionOutputs outputs) override;
  bool AttendRunsOnCallingThread(const AttentionShape& shape) const override;
  absl::Status MultiHeadAttention(const MultiHeadShape& shape,
                                  const ProjectionWeights& weights,
                                  const AttentionOptions& options,
                                  absl::Span<const float> query_input,
                                  absl::Span<const float> kv_input,
                                  AttentionOutputs outputs) override;
  bool DecodeReadsInPlace(const AttentionShape& shape,
                          const AttentionOptions& options) const override;
  std::optional<int64_t> AttendHalfWorkspaceBytes(
      const AttentionShape& shape, const AttentionOptions& options,
      DataType dtype) const override;
  absl::Status AttendPackedHalf(const PackedShape& shape,
                                const AttentionOptions& options, DataType dtype,
                                absl::Span<const char> query,
                                absl::Span<const char> key,
                                absl::Span<const char> value,
                                AttentionOutputs outputs) override;
  absl::Status AttendHalf(const AttentionShape& shape,
                          const AttentionOptions& options, DataType dtype,
                          absl::Span<const char> query,
                          absl::Span<const char> key,
                          absl::Span<const char> value,
                          AttentionOutputs outputs) override;
  absl::Status AttendDecode(const AttentionShape& shape,
                            const AttentionOptions& options,
                            absl::Span<const float> query, DataType dtype,
                            absl::Span<const char> key,
                            absl::Span<const char> value,
                            AttentionOutputs outputs) override;
  using AttentionEngine::AttendPaged;
  absl::Status AttendPaged(absl::Span<const PagedAttend> items,
                           const StopCheck& stop) override;
  int64_t PagedWorkspaceBytes(
      absl::Span<const PagedAttend> items) const override;
  RuntimeInfo runtime_info() const override;
  const EngineOptions& options() const override { return options_; }

 private:
  // Whether a call with `options` runs the fused kernel.
  bool UseFused(const AttentionOptions& options) const;
  // Whether Attend computes a call DecodeReadsInPlace takes through
  // AttendDecode: where the fused kernel's tile code is the portable one
  // because the CPU lacks AVX-512, the paged kernel's AVX2 code outruns its
  // small-rows path several times; with AVX-512, for a GQA group at f32
  // precision, reading the keys once for the group's rows (0.75 of the
  // streaming read against 0.43 on an AMX Xeon).
  bool DecodesPaged(const AttentionShape& shape,
                    const AttentionOptions& options) const;

  // Runs each sequence of a validated packed call as one kernel call over
  // strided views: `source` is the inputs' dtype, `query`, `key` and `value`
  // point at their first element (f32, or 16-bit elements of `source`).
  absl::Status RunPacked(const PackedShape& shape,
                         const AttentionOptions& options, DataType source,
                         const void* query, const void* key, const void* value,
                         AttentionOutputs outputs);

  // Validates an Attend's (or an AttendBatch part's) shape, spans and options.
  static absl::Status ValidateInputs(const AttentionShape& shape,
                                     const AttentionOptions& options,
                                     absl::Span<const float> query,
                                     absl::Span<const float> key,
                                     absl::Span<const float> value,
                                     const AttentionOutputs& outputs);

  // The team size of a call of `flops` (see NewStream).
  int TeamSize(double flops) const;

  // The options the fused kernel runs with after the unfused one, for the
  // output and lse of a call that asks for the weights; nullopt if the
  // unfused kernel's own answer stands (no weights, or --attention_kernel
  // unfused).
  std::optional<AttentionOptions> FusedOutputOptions(
      const AttentionOptions& options) const;

  // The scratch bytes RunSdpa allocates (see FusedWorkspaceBytes and
  // UnfusedWorkspaceBytes).
  std::optional<int64_t> SdpaWorkspaceBytes(const AttentionShape& shape,
                                            const AttentionOptions& options,
                                            bool key_value_packed) const;

  // The attention itself, by the path the options call for.
  absl::Status RunSdpa(dnnl::stream& stream, const SdpaProblem& problem,
                       double flops);

  // internal::RunLinear on the engine's oneDNN engine, `stop` polled between
  // runs of rows.
  absl::Status RunLinear(dnnl::stream& stream, const LinearProblem& problem,
                         Precision precision, const StopCheck& stop);

  // The unfused path's bytes of scores per slab.
  int64_t SlabBudget() const;

  // OK if `bytes` of scratch (nullopt: more than int64_t holds) is within
  // max_workspace_bytes, else RESOURCE_EXHAUSTED naming `what`.
  absl::Status CheckWorkspace(const std::string& what,
                              std::optional<int64_t> bytes) const;

  // A stream for one call, with the calling thread's OpenMP team sized for
  // `flops` (TeamSize).
  absl::StatusOr<dnnl::stream> NewStream(double flops);

  const EngineOptions options_;
  const dnnl::engine engine_;
  const int threads_;  // The team size of calls big enough to share.
  const TileKernels& kernels_;
  // Built matmuls by shape, kept across calls: 64 shapes at most, and 128
  // tile plans (a fused call uses up to kTilePlans · kKeyWidths = 45).
  SlabPlanCache plans_{64};
  TilePlanCache tile_plans_{128};
  // The fused kernel's scratch, kept between calls: up to 4 buffers of at most
  // 64 MiB each.
  ScratchPool scratch_{4, int64_t{64} << 20};
};

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_ATTENTION_ENGINE_IMPL_H_
