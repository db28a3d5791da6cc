#include "attnserve/core/attention_engine.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/common/dtype.h"
#include "attnserve/common/flops.h"
#include "attnserve/common/status_macros.h"
#include "internal/attention_engine_impl.h"
#include "internal/dnnl_status.h"
#include "internal/fused_attention.h"
#include "internal/linear.h"
#include "internal/paged_attention.h"
#include "internal/score_mods.h"
#include "internal/sdpa_problem.h"
#include "internal/unfused_attention.h"
#include "internal/validation.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve {
namespace internal {
namespace {

// Scores beyond this many bytes per slab stop paying for themselves: they no
// longer fit any cache, and a slab this size already gives every core work.
constexpr int64_t kSlabTargetBytes = int64_t{64} << 20;

// Calls with fewer FLOPs run on one thread.
constexpr double kParallelFlops = 1 << 20;

// `bytes` of 16-bit `dtype` elements widened into `copy`, as a span of it.
absl::Span<const float> Widened(DataType dtype, absl::Span<const char> bytes,
                                std::vector<float>* copy) {
  copy->resize(bytes.size() / 2);
  ConvertToFloat32(dtype, bytes.data(), static_cast<int64_t>(copy->size()),
                   copy->data());
  return absl::MakeConstSpan(*copy);
}

// Whether 16-bit elements can be read at `bytes` as uint16_t.
bool Aligned16(absl::Span<const char> bytes) {
  return reinterpret_cast<uintptr_t>(bytes.data()) % 2 == 0;
}

// The engine sizes its thread team on the full (non-causal) count.
double AttentionFlops(const AttentionShape& s) {
  return AttentionFlops(s.Dims(), /*causal=*/false);
}

const char* IsaName(dnnl::cpu_isa isa) {
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

}  // namespace

AttentionEngineImpl::AttentionEngineImpl(const EngineOptions& options,
                                         dnnl::engine engine)
    : options_(options),
      engine_(std::move(engine)),
      threads_(options.num_threads > 0 ? options.num_threads
                                       : DefaultComputeThreads()),
      kernels_(SelectTileKernels(options.portable_kernels)) {}

absl::Status AttentionEngineImpl::Attend(const AttentionShape& shape,
                                         const AttentionOptions& options,
                                         absl::Span<const float> query,
                                         absl::Span<const float> key,
                                         absl::Span<const float> value,
                                         AttentionOutputs outputs) {
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateInputs(shape, options, query, key, value, outputs));
  // Decode on the paged kernel, which checks its own workspace.
  if (DecodesPaged(shape, options)) {
    return AttendDecode(
        shape, options, query, DataType::kFloat32,
        absl::MakeConstSpan(reinterpret_cast<const char*>(key.data()),
                            key.size() * sizeof(float)),
        absl::MakeConstSpan(reinterpret_cast<const char*>(value.data()),
                            value.size() * sizeof(float)),
        outputs);
  }
  ATTNSERVE_RETURN_IF_ERROR(
      CheckWorkspace(absl::StrCat("attention for shape ", shape.DebugString()),
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

bool AttentionEngineImpl::DecodeReadsInPlace(
    const AttentionShape& shape, const AttentionOptions& options) const {
  // The paged kernel places its one query row at the last key (bottom-right):
  // the same as top-left for a plain non-causal row, not for a window or
  // ALiBi.
  const bool bottom_right =
      options.causal_alignment == CausalAlignment::kBottomRight;
  return shape.query_len == 1 && !options.mask &&
         options.weights == AttentionWeightsMode::kNone &&
         (!options.causal || bottom_right) &&
         (!HasScoreMods(options) || bottom_right);
}

bool AttentionEngineImpl::DecodesPaged(const AttentionShape& shape,
                                       const AttentionOptions& options) const {
  // An engine told to run the portable code (tests of it) keeps its fused
  // kernel for decode too.
  if (options_.portable_kernels || !UseFused(options) ||
      !DecodeReadsInPlace(shape, options)) {
    return false;
  }
  if (std::string_view(kernels_.name) == "portable") return true;
  // With AVX-512, the fused kernel's small-rows tiles read each key block once
  // per query row; the paged kernel reads it once for four rows of a GQA group
  // (at f32 precision: at BF16 it would round f32 keys and values through a
  // buffer).
  return options.precision == Precision::kFloat32 &&
         shape.heads / shape.kv_heads >= 2;
}

absl::Status AttentionEngineImpl::AttendDecode(
    const AttentionShape& shape, const AttentionOptions& options,
    absl::Span<const float> query, DataType dtype, absl::Span<const char> key,
    absl::Span<const char> value, AttentionOutputs outputs) {
  if (!DecodeReadsInPlace(shape, options)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AttendDecode takes decode (Lq = 1) without a mask, weights or a "
        "top-left causal mask, window or ALiBi; got ",
        shape.DebugString()));
  }
  PageLayout layout;
  layout.page_tokens = shape.key_len;
  layout.kv_heads = shape.kv_heads;
  layout.key_dim = shape.key_dim;
  layout.value_dim = shape.value_dim;
  layout.dtype = dtype;
  const size_t batch = static_cast<size_t>(shape.batch);
  if (static_cast<int64_t>(key.size()) != shape.batch * layout.KeyBytes() ||
      static_cast<int64_t>(value.size()) != shape.batch * layout.ValueBytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key and value hold ", key.size(), " and ", value.size(),
        " bytes, expected ", shape.batch * layout.KeyBytes(), " and ",
        shape.batch * layout.ValueBytes(), " for ", shape.DebugString()));
  }
  const int64_t heads = shape.heads;
  if (static_cast<int64_t>(query.size()) != shape.QueryElements() ||
      static_cast<int64_t>(outputs.output.size()) != shape.OutputElements() ||
      (!outputs.lse.empty() &&
       static_cast<int64_t>(outputs.lse.size()) != shape.batch * heads) ||
      (!options.key_lengths.empty() &&
       static_cast<int64_t>(options.key_lengths.size()) != shape.batch)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "query, output, lse or key_lengths do not fit ", shape.DebugString()));
  }
  const float scale = options.scale.value_or(
      1.0f / std::sqrt(static_cast<float>(shape.key_dim)));
  std::vector<const char*> key_pages(batch), value_pages(batch);
  std::vector<PagedAttend> items(batch);
  for (size_t b = 0; b < batch; ++b) {
    key_pages[b] = key.data() + b * layout.KeyBytes();
    value_pages[b] = value.data() + b * layout.ValueBytes();
    PagedAttend& item = items[b];
    item.layout = layout;
    item.pages = absl::MakeConstSpan(&key_pages[b], 1);
    item.value_pages = absl::MakeConstSpan(&value_pages[b], 1);
    item.length =
        options.key_lengths.empty() ? shape.key_len : options.key_lengths[b];
    item.heads = heads;
    item.query_len = 1;
    item.query =
        query.subspan(b * heads * shape.key_dim, heads * shape.key_dim);
    item.scale = scale;
    item.window_left = options.window_left;
    item.num_sink_tokens = options.num_sink_tokens;
    item.softcap = options.softcap.value_or(0.0f);
    item.alibi_slopes = options.alibi_slopes;
    item.precision = options.precision;
    item.output = outputs.output.subspan(b * heads * shape.value_dim,
                                         heads * shape.value_dim);
    if (!outputs.lse.empty()) item.lse = outputs.lse.subspan(b * heads, heads);
  }
  // ValidatePagedAttend (in AttendPaged) checks the lengths against the page.
  return AttendPaged(items, options.stop);
}

absl::Status AttentionEngineImpl::AttendHalf(
    const AttentionShape& shape, const AttentionOptions& options,
    DataType dtype, absl::Span<const char> query, absl::Span<const char> key,
    absl::Span<const char> value, AttentionOutputs outputs) {
  if (dtype == DataType::kFloat32) {
    return absl::InvalidArgumentError(
        "AttendHalf takes BFLOAT16 or FLOAT16 inputs; got FLOAT32");
  }
  ATTNSERVE_RETURN_IF_ERROR(ValidateShape(shape));
  const std::pair<const char*, int64_t> spans[] = {
      {"query", static_cast<int64_t>(query.size())},
      {"key", static_cast<int64_t>(key.size())},
      {"value", static_cast<int64_t>(value.size())}};
  const int64_t expected[] = {shape.QueryElements(), shape.KeyElements(),
                              shape.ValueElements()};
  for (int i = 0; i < 3; ++i) {
    if (spans[i].second != 2 * expected[i]) {
      return absl::InvalidArgumentError(absl::StrCat(
          spans[i].first, " has ", spans[i].second, " bytes, expected ",
          2 * expected[i], " (", expected[i], " 16-bit elements)"));
    }
  }
  ATTNSERVE_RETURN_IF_ERROR(ValidateOptionsAndOutputs(shape, options, outputs,
                                                      shape.OutputElements()));
  std::vector<float> query_copy, key_copy, value_copy;
  if (DecodeReadsInPlace(shape, options)) {
    return AttendDecode(shape, options, Widened(dtype, query, &query_copy),
                        dtype, key, value, outputs);
  }
  if (!UseFused(options) || !Aligned16(query) || !Aligned16(key) ||
      !Aligned16(value)) {
    return Attend(shape, options, Widened(dtype, query, &query_copy),
                  Widened(dtype, key, &key_copy),
                  Widened(dtype, value, &value_copy), outputs);
  }
  ATTNSERVE_RETURN_IF_ERROR(
      CheckWorkspace(absl::StrCat("attention for shape ", shape.DebugString()),
                     FusedWorkspaceBytes(shape, options, threads_,
                                         /*key_value_packed=*/true, dtype)));
  SdpaProblem problem = MakeSdpaProblem(shape, options, outputs);
  problem.input_dtype = dtype;
  problem.half_query = reinterpret_cast<const uint16_t*>(query.data());
  problem.half_key = reinterpret_cast<const uint16_t*>(key.data());
  problem.half_value = reinterpret_cast<const uint16_t*>(value.data());
  problem.output = outputs.output.data();
  ATTNSERVE_ASSIGN_OR_RETURN(dnnl::stream stream,
                             NewStream(AttentionFlops(shape)));
  return RunSdpa(stream, problem, AttentionFlops(shape));
}

std::optional<int64_t> AttentionEngineImpl::AttendHalfWorkspaceBytes(
    const AttentionShape& shape, const AttentionOptions& options,
    DataType dtype) const {
  // The routes of AttendHalf: decode widens its query; the unfused kernel
  // widens all three.
  const double query = 4.0 * static_cast<double>(shape.QueryElements());
  std::optional<int64_t> scratch;
  double copies = 0;
  if (DecodeReadsInPlace(shape, options)) {
    scratch = SdpaWorkspaceBytes(shape, options, /*key_value_packed=*/true);
    copies = query;
  } else if (UseFused(options)) {
    scratch = FusedWorkspaceBytes(shape, options, threads_,
                                  /*key_value_packed=*/true, dtype);
  } else {
    scratch = SdpaWorkspaceBytes(shape, options, /*key_value_packed=*/true);
    copies = query + 4.0 * static_cast<double>(shape.KeyElements() +
                                               shape.ValueElements());
  }
  if (!scratch || static_cast<double>(*scratch) + copies > 9e18) {
    return std::nullopt;
  }
  return *scratch + static_cast<int64_t>(copies);
}

std::optional<int64_t> AttentionEngineImpl::AttendWorkspaceBytes(
    const AttentionShape& shape, const AttentionOptions& options) const {
  return SdpaWorkspaceBytes(shape, options, /*key_value_packed=*/true);
}

absl::Status AttentionEngineImpl::AttendBatch(
    const AttentionShape& shape, const AttentionOptions& options,
    absl::Span<const AttendPart> parts) {
  if (!AttendBatchable(options)) {
    return absl::InvalidArgumentError(
        "AttendBatch takes options without weights, key_lengths or a mask "
        "over the batch, on the fused kernel");
  }
  if (parts.empty()) {
    return absl::InvalidArgumentError("AttendBatch has no parts, expected 1+");
  }
  AttentionShape total = shape;
  total.batch = 0;
  AttentionShape entry_shape = shape;  // One batch entry.
  entry_shape.batch = 1;
  std::vector<BatchTensors> batches;
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
      BatchTensors entry;
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
  ATTNSERVE_RETURN_IF_ERROR(ValidateShape(total));
  // Requests of one B are cut into tiles and key splits as each would be
  // alone, so that batching changes no bit of their answers.
  Tiling tiling;
  const bool alike =
      std::all_of(parts.begin(), parts.end(), [&](const AttendPart& part) {
        return part.batch == parts.front().batch;
      });
  AttentionShape alone = shape;  // One part, when they are alike.
  alone.batch = parts.front().batch;
  if (alike) {
    tiling.batch = alone.batch;
    tiling.threads = TeamSize(AttentionFlops(alone));
  }
  const absl::Status fits = CheckWorkspace(
      absl::StrCat("attention for shape ", total.DebugString()),
      FusedWorkspaceBytes(total, options, threads_, /*key_value_packed=*/true,
                          DataType::kFloat32, tiling));
  if (!fits.ok()) {
    if (!alike || parts.size() == 1) return fits;
    // The lone splits of many parts can take more scratch than the batch's
    // own would: each part is then computed alone, as it would be unbatched.
    for (const AttendPart& part : parts) {
      ATTNSERVE_RETURN_IF_ERROR(Attend(alone, options, part.query, part.key,
                                       part.value, part.outputs));
    }
    return absl::OkStatus();
  }

  SdpaProblem problem =
      MakeSdpaProblem(total, options, AttentionOutputs(absl::Span<float>()));
  problem.batches = batches;
  problem.tiling = tiling;
  ATTNSERVE_ASSIGN_OR_RETURN(dnnl::stream stream,
                             NewStream(AttentionFlops(total)));
  return RunSdpa(stream, problem, AttentionFlops(total));
}

absl::Status AttentionEngineImpl::AttendPacked(const PackedShape& shape,
                                               const AttentionOptions& options,
                                               absl::Span<const float> query,
                                               absl::Span<const float> key,
                                               absl::Span<const float> value,
                                               AttentionOutputs outputs) {
  ATTNSERVE_RETURN_IF_ERROR(ValidatePacked(shape, options, query.size(),
                                           key.size(), value.size(), outputs));
  return RunPacked(shape, options, DataType::kFloat32, query.data(), key.data(),
                   value.data(), outputs);
}

absl::Status AttentionEngineImpl::AttendPackedHalf(
    const PackedShape& shape, const AttentionOptions& options, DataType dtype,
    absl::Span<const char> query, absl::Span<const char> key,
    absl::Span<const char> value, AttentionOutputs outputs) {
  if (dtype == DataType::kFloat32) {
    return absl::InvalidArgumentError(
        "AttendPackedHalf takes BFLOAT16 or FLOAT16 inputs; got FLOAT32");
  }
  const std::pair<const char*, absl::Span<const char>> spans[] = {
      {"query", query}, {"key", key}, {"value", value}};
  bool aligned = true;
  for (const auto& [name, bytes] : spans) {
    if (bytes.size() % 2 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " has ", bytes.size(), " bytes, expected 16-bit elements"));
    }
    aligned = aligned && Aligned16(bytes);
  }
  ATTNSERVE_RETURN_IF_ERROR(ValidatePacked(shape, options, query.size() / 2,
                                           key.size() / 2, value.size() / 2,
                                           outputs));
  if (!UseFused(options) || !aligned) {
    std::vector<float> query_copy, key_copy, value_copy;
    return AttendPacked(shape, options, Widened(dtype, query, &query_copy),
                        Widened(dtype, key, &key_copy),
                        Widened(dtype, value, &value_copy), outputs);
  }
  return RunPacked(shape, options, dtype, query.data(), key.data(),
                   value.data(), outputs);
}

absl::Status AttentionEngineImpl::RunPacked(const PackedShape& shape,
                                            const AttentionOptions& options,
                                            DataType source, const void* query,
                                            const void* key, const void* value,
                                            AttentionOutputs outputs) {
  const int64_t h = shape.heads, hkv = shape.kv_heads;
  const int64_t dk = shape.key_dim, dv = shape.value_dim;
  const int64_t total_q = shape.TotalQuery();
  std::vector<float> lse;
  for (int64_t s = 0; s < shape.Sequences(); ++s) {
    const int64_t q0 = shape.cu_seqlens_q[s];
    const int64_t k0 = shape.cu_seqlens_k[s];
    AttentionShape one;
    one.heads = h;
    one.kv_heads = hkv;
    one.query_len = shape.cu_seqlens_q[s + 1] - q0;
    one.key_len = shape.cu_seqlens_k[s + 1] - k0;
    one.key_dim = dk;
    one.value_dim = dv;
    if (one.query_len == 0) continue;
    float* const output = outputs.output.data() + q0 * h * dv;
    if (one.key_len == 0) {  // Rows that see no key.
      std::fill(output, output + one.query_len * h * dv, 0.0f);
      for (int64_t head = 0; !outputs.lse.empty() && head < h; ++head) {
        std::fill_n(outputs.lse.data() + head * total_q + q0, one.query_len,
                    -std::numeric_limits<float>::infinity());
      }
      continue;
    }
    ATTNSERVE_RETURN_IF_ERROR(CheckWorkspace(
        absl::StrCat("packed sequence ", s, " of shape ", one.DebugString()),
        source == DataType::kFloat32
            ? SdpaWorkspaceBytes(one, options, /*key_value_packed=*/false)
            : FusedWorkspaceBytes(one, options, threads_,
                                  /*key_value_packed=*/false, source)));
    if (!outputs.lse.empty())
      lse.resize(static_cast<size_t>(h * one.query_len));
    SdpaProblem problem = MakeSdpaProblem(
        one, options,
        AttentionOutputs(absl::Span<float>(), {}, absl::MakeSpan(lse)));
    // Token-major rows read as [1, heads, L, D] through strides.
    problem.query_strides = {0, dk, h * dk, 1};
    problem.key_strides = {0, dk, hkv * dk, 1};
    problem.value_strides = {0, dv, hkv * dv, 1};
    if (source == DataType::kFloat32) {
      problem.query = static_cast<const float*>(query) + q0 * h * dk;
      problem.key = static_cast<const float*>(key) + k0 * hkv * dk;
      problem.value = static_cast<const float*>(value) + k0 * hkv * dv;
    } else {
      problem.input_dtype = source;
      problem.half_query = static_cast<const uint16_t*>(query) + q0 * h * dk;
      problem.half_key = static_cast<const uint16_t*>(key) + k0 * hkv * dk;
      problem.half_value = static_cast<const uint16_t*>(value) + k0 * hkv * dv;
    }
    problem.output = output;
    problem.output_strides = {0, dv, h * dv, 1};
    ATTNSERVE_ASSIGN_OR_RETURN(dnnl::stream stream,
                               NewStream(AttentionFlops(one)));
    ATTNSERVE_RETURN_IF_ERROR(RunSdpa(stream, problem, AttentionFlops(one)));
    for (int64_t head = 0; !outputs.lse.empty() && head < h; ++head) {
      std::copy_n(lse.data() + head * one.query_len, one.query_len,
                  outputs.lse.data() + head * total_q + q0);
    }
  }
  return absl::OkStatus();
}

bool AttentionEngineImpl::AttendBatchable(
    const AttentionOptions& options) const {
  return UseFused(options) && options.key_lengths.empty() &&
         (!options.mask || options.mask->dims[0] == 1);
}

bool AttentionEngineImpl::AttendRunsOnCallingThread(
    const AttentionShape& shape) const {
  return AttentionFlops(shape) < kParallelFlops;
}

RuntimeInfo AttentionEngineImpl::runtime_info() const {
  RuntimeInfo info = OneDnnRuntimeInfo();
  info.threads = threads_;
  info.kernels = kernels_.name;
  return info;
}

bool AttentionEngineImpl::UseFused(const AttentionOptions& options) const {
  return options_.kernel == AttentionKernel::kAuto &&
         options.weights == AttentionWeightsMode::kNone;
}

absl::Status AttentionEngineImpl::ValidateInputs(
    const AttentionShape& shape, const AttentionOptions& options,
    absl::Span<const float> query, absl::Span<const float> key,
    absl::Span<const float> value, const AttentionOutputs& outputs) {
  ATTNSERVE_RETURN_IF_ERROR(ValidateShape(shape));
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateSpanSize("query", query.size(), shape.QueryElements()));
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateSpanSize("key", key.size(), shape.KeyElements()));
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateSpanSize("value", value.size(), shape.ValueElements()));
  return ValidateOptionsAndOutputs(shape, options, outputs,
                                   shape.OutputElements());
}

int AttentionEngineImpl::TeamSize(double flops) const {
  return flops < kParallelFlops ? 1 : threads_;
}

std::optional<int64_t> AttentionEngineImpl::SdpaWorkspaceBytes(
    const AttentionShape& shape, const AttentionOptions& options,
    bool key_value_packed) const {
  if (UseFused(options)) {
    return FusedWorkspaceBytes(shape, options, threads_, key_value_packed);
  }
  const std::optional<int64_t> unfused = UnfusedWorkspaceBytes(
      shape, options.precision, SlabBudget(), key_value_packed);
  const std::optional<AttentionOptions> output_options =
      FusedOutputOptions(options);
  if (!unfused || !output_options) return unfused;
  // The fused kernel runs once the unfused one has freed its scratch.
  const std::optional<int64_t> fused =
      FusedWorkspaceBytes(shape, *output_options, threads_, key_value_packed);
  if (!fused) return std::nullopt;
  return std::max(*unfused, *fused);
}

absl::Status AttentionEngineImpl::RunSdpa(dnnl::stream& stream,
                                          const SdpaProblem& problem,
                                          double flops) {
  if (UseFused(*problem.options)) {
    return RunFusedAttention(engine_, problem, TeamSize(flops), kernels_,
                             tile_plans_, scratch_);
  }
  const std::optional<AttentionOptions> output_options =
      FusedOutputOptions(*problem.options);
  if (!output_options) {
    return RunUnfusedAttention(engine_, stream, problem, SlabBudget(), plans_);
  }
  // The weights asked of an engine that runs the fused kernel: the unfused
  // kernel gives them (without its product P·V), and the fused kernel the
  // output and lse, so that asking for the weights changes no other answer.
  // (The unfused P·V takes 0 · NaN for a key no row sees, NaN in a padded
  // value row, into the output; the fused kernel never reads such a key.)
  SdpaProblem weights_only = problem;
  weights_only.output = nullptr;
  ATTNSERVE_RETURN_IF_ERROR(
      RunUnfusedAttention(engine_, stream, weights_only, SlabBudget(), plans_));
  SdpaProblem output_only = problem;
  output_only.options = &*output_options;
  output_only.weights = {};
  return RunFusedAttention(engine_, output_only, TeamSize(flops), kernels_,
                           tile_plans_, scratch_);
}

std::optional<AttentionOptions> AttentionEngineImpl::FusedOutputOptions(
    const AttentionOptions& options) const {
  if (options_.kernel != AttentionKernel::kAuto ||
      options.weights == AttentionWeightsMode::kNone) {
    return std::nullopt;
  }
  AttentionOptions without_weights = options;
  without_weights.weights = AttentionWeightsMode::kNone;
  return without_weights;
}

absl::Status AttentionEngineImpl::AttendPaged(
    absl::Span<const PagedAttend> items, const StopCheck& stop) {
  ATTNSERVE_RETURN_IF_ERROR(ValidatePagedAttend(items));
  ATTNSERVE_RETURN_IF_ERROR(
      CheckWorkspace("paged attention", PagedWorkspaceBytes(items)));
  double flops = 0;
  for (const PagedAttend& item : items) {
    flops += AttentionFlops(item.Dims(), /*causal=*/false);
  }
  const PagedCode code = options_.portable_kernels ? PagedCode::kPortable
                         : options_.avx2_kernels   ? PagedCode::kAvx2
                                                   : PagedCode::kNative;
  return RunPagedAttention(items, TeamSize(flops), code, stop);
}

int64_t AttentionEngineImpl::PagedWorkspaceBytes(
    absl::Span<const PagedAttend> items) const {
  return internal::PagedWorkspaceBytes(items, threads_);
}

absl::Status AttentionEngineImpl::RunLinear(dnnl::stream& stream,
                                            const LinearProblem& problem,
                                            Precision precision,
                                            const StopCheck& stop) {
  return internal::RunLinear(engine_, stream, problem, precision, stop);
}

int64_t AttentionEngineImpl::SlabBudget() const {
  return std::min(options_.max_workspace_bytes, kSlabTargetBytes);
}

absl::Status AttentionEngineImpl::CheckWorkspace(
    const std::string& what, std::optional<int64_t> bytes) const {
  if (bytes && *bytes <= options_.max_workspace_bytes) return absl::OkStatus();
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
absl::StatusOr<dnnl::stream> AttentionEngineImpl::NewStream(double flops) {
  omp_set_num_threads(TeamSize(flops));
  dnnl::stream stream;
  ATTNSERVE_RETURN_IF_ERROR(
      CallDnnl("creating a stream", [&] { stream = dnnl::stream(engine_); }));
  return stream;
}

}  // namespace internal

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
  if (options.avx2_kernels && !internal::PagedAvx2OnThisCpu()) {
    return absl::InvalidArgumentError(
        "avx2_kernels is set, expected a CPU with AVX2 and FMA; this one "
        "lacks at least one of them");
  }
  dnnl::engine engine;
  ATTNSERVE_RETURN_IF_ERROR(internal::CallDnnl("creating a CPU engine", [&] {
    engine = dnnl::engine(dnnl::engine::kind::cpu, 0);
  }));
  return std::unique_ptr<AttentionEngine>(
      new internal::AttentionEngineImpl(options, std::move(engine)));
}

RuntimeInfo OneDnnRuntimeInfo() {
  RuntimeInfo info;
  const dnnl_version_t* version = dnnl_version();
  info.onednn_version =
      absl::StrCat(version->major, ".", version->minor, ".", version->patch);
  info.threading = version->cpu_runtime == DNNL_RUNTIME_OMP   ? "OMP"
                   : version->cpu_runtime == DNNL_RUNTIME_TBB ? "TBB"
                   : version->cpu_runtime == DNNL_RUNTIME_SEQ ? "SEQ"
                                                              : "other";
  info.cpu_isa = internal::IsaName(dnnl::get_effective_cpu_isa());
  return info;
}

int DefaultComputeThreads() { return omp_get_max_threads(); }

bool PreferredKeysTransposed() {
  return internal::PagedKeysTransposedOnThisCpu();
}

}  // namespace attnserve
