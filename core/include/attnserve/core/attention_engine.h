// AttentionEngine: scaled dot-product and multi-head attention on the CPU
// through oneDNN. The shapes, options and outputs it takes are in
// attention_types.h, which this header includes.
//
// clang-format off
//   ATTNSERVE_ASSIGN_OR_RETURN(std::unique_ptr<AttentionEngine> engine,
//                              AttentionEngine::Create(EngineOptions{}));
//   AttentionShape shape;
//   shape.heads = shape.kv_heads = 8;
//   shape.query_len = shape.key_len = 128;
//   shape.key_dim = shape.value_dim = 64;
//   std::vector<float> output(shape.OutputElements());
//   AttentionOptions options;
//   options.causal = true;
//   ATTNSERVE_RETURN_IF_ERROR(engine->Attend(shape, options, query, key, value,
//                                            absl::MakeSpan(output)));
// clang-format on
//
// query, key and value are spans of shape.QueryElements(), KeyElements() and
// ValueElements() floats, laid out as attention_types.h states.
#ifndef ATTNSERVE_CORE_ATTENTION_ENGINE_H_
#define ATTNSERVE_CORE_ATTENTION_ENGINE_H_

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attnserve/core/attention_types.h"
#include "attnserve/core/paged_attention.h"

namespace attnserve {

// Computes attention. Thread-safe: calls may run concurrently, each with its
// own oneDNN stream (though concurrent calls share, and so oversubscribe, the
// cores).
class AttentionEngine {
 public:
  // Creates an engine on the CPU. Returns INVALID_ARGUMENT for bad options and
  // INTERNAL if oneDNN cannot create a CPU engine.
  static absl::StatusOr<std::unique_ptr<AttentionEngine>> Create(
      const EngineOptions& options);

  AttentionEngine(const AttentionEngine&) = delete;
  AttentionEngine& operator=(const AttentionEngine&) = delete;
  virtual ~AttentionEngine() = default;

  // Writes softmax(scale · Q Kᵀ + mask) V into outputs.output, and the weights
  // and lse if asked. Spans must hold exactly the element counts of `shape` and
  // `options`. Returns INVALID_ARGUMENT for an inconsistent shape, span or
  // option, RESOURCE_EXHAUSTED if the call would need more than
  // max_workspace_bytes of scratch, INTERNAL if oneDNN fails. Non-finite inputs
  // propagate as IEEE arithmetic does. options.stop, if set, may stop the call
  // early with its error.
  virtual absl::Status Attend(const AttentionShape& shape,
                              const AttentionOptions& options,
                              absl::Span<const float> query,
                              absl::Span<const float> key,
                              absl::Span<const float> value,
                              AttentionOutputs outputs) = 0;

  // Whether AttendDecode takes `shape` and `options`: decode (Lq = 1) seeing
  // every key up to its batch entry's key length — no causal mask, or the
  // bottom-right one, which for Lq = 1 hides nothing — with no mask and no
  // weights asked.
  virtual bool DecodeReadsInPlace(const AttentionShape& shape,
                                  const AttentionOptions& options) const = 0;

  // Attend for a call DecodeReadsInPlace takes, whose key [B, Hkv, Lk, Dk]
  // and value [B, Hkv, Lk, Dv] are packed in `dtype` (FLOAT32, BFLOAT16 or
  // FLOAT16): the paged kernel reads them where they lie, each batch entry's
  // keys and values one page, widening in registers (no f32 copy). Errors as
  // for Attend, and INVALID_ARGUMENT for a call it does not take or spans
  // that do not fit.
  virtual absl::Status AttendDecode(const AttentionShape& shape,
                                    const AttentionOptions& options,
                                    absl::Span<const float> query,
                                    DataType dtype, absl::Span<const char> key,
                                    absl::Span<const char> value,
                                    AttentionOutputs outputs) = 0;

  // Attend for a query, key and value that arrive as 16-bit `dtype` elements
  // (BFLOAT16 or FLOAT16), laid out as Attend's, 2 bytes each: read where they
  // lie, with no f32 copy of the call's tensors. Decode calls go to
  // AttendDecode. The fused kernel widens one block of keys and values at a
  // time into each thread's buffers where its tiles compute in f32 (f32
  // precision), and reads bf16 inputs in place (f16 ones through a bf16
  // copy) where they compute in bf16. The unfused kernel (weights asked, or
  // an engine made with it) widens the three to f32 copies first, as does a
  // call whose spans are not 2-byte aligned. Results equal Attend's over the
  // widened values. Errors as for Attend, and INVALID_ARGUMENT for another
  // dtype or spans that do not fit.
  virtual absl::Status AttendHalf(const AttentionShape& shape,
                                  const AttentionOptions& options,
                                  DataType dtype, absl::Span<const char> query,
                                  absl::Span<const char> key,
                                  absl::Span<const char> value,
                                  AttentionOutputs outputs) = 0;

  // Packed sequences of different lengths without padding (PackedShape).
  // `options` take everything but key_lengths, a mask and weights
  // (INVALID_ARGUMENT naming them); each sequence computes as an Attend of
  // its own lengths, its queries that see no key getting output 0 and lse
  // −inf. Errors as for Attend.
  virtual absl::Status AttendPacked(const PackedShape& shape,
                                    const AttentionOptions& options,
                                    absl::Span<const float> query,
                                    absl::Span<const float> key,
                                    absl::Span<const float> value,
                                    AttentionOutputs outputs) = 0;

  // AttendPacked for a query, key and value that arrive as 16-bit `dtype`
  // elements (BFLOAT16 or FLOAT16), token-major as AttendPacked's: each
  // sequence read where it lies, as AttendHalf reads an Attend's (native bf16
  // tiles read a bf16 copy of each sequence's strided keys and values).
  // Results equal AttendPacked's over the widened values. Errors as for
  // AttendPacked and AttendHalf.
  virtual absl::Status AttendPackedHalf(
      const PackedShape& shape, const AttentionOptions& options, DataType dtype,
      absl::Span<const char> query, absl::Span<const char> key,
      absl::Span<const char> value, AttentionOutputs outputs) = 0;

  // Computes several Attends alike but for B in one kernel call (dynamic
  // batching), reading and writing each part's tensors where they are: as
  // Attend over the parts' batches in order, `shape.batch` ignored. Parts of
  // equal B get the same bits as each computed alone by Attend (but decode,
  // which Attend may answer on the paged kernel), and are computed one after
  // the other when their lone tiling would pass the workspace limit together;
  // parts of unequal B may differ from that in the last bits. `options` must be
  // AttendBatchable. Errors as for Attend, and INVALID_ARGUMENT naming the part
  // whose spans do not fit.
  virtual absl::Status AttendBatch(const AttentionShape& shape,
                                   const AttentionOptions& options,
                                   absl::Span<const AttendPart> parts) = 0;

  // Whether AttendBatch takes `options`: the fused kernel's options (no weights
  // asked, the kernel not forced unfused), no key_lengths, and a mask, if any,
  // with no batch dimension (the parts share it).
  virtual bool AttendBatchable(const AttentionOptions& options) const = 0;

  // Multi-head attention: projects query_input [B, Lq, E] to Q and kv_input [B,
  // Lk, Ekv] (empty for self-attention, which uses query_input) to K and V,
  // runs SDPA per head, concatenates the heads and projects with w_o into
  // outputs.output [B, Lq, E]. Errors as for Attend.
  virtual absl::Status MultiHeadAttention(const MultiHeadShape& shape,
                                          const ProjectionWeights& weights,
                                          const AttentionOptions& options,
                                          absl::Span<const float> query_input,
                                          absl::Span<const float> kv_input,
                                          AttentionOutputs outputs) = 0;

  // Attention of each item's query over its paged cache
  // (attnserve/core/paged_attention.h), all items in one parallel pass: the
  // decode steps of many sequences in one call. Reads the pages in their
  // dtype, where they lie. Returns INVALID_ARGUMENT naming the item whose
  // layout, pages or spans do not fit, RESOURCE_EXHAUSTED over
  // max_workspace_bytes, and the error of `stop` (attention_types.h) if it
  // stops the call.
  virtual absl::Status AttendPaged(absl::Span<const PagedAttend> items,
                                   const StopCheck& stop) = 0;
  absl::Status AttendPaged(absl::Span<const PagedAttend> items) {
    return AttendPaged(items, StopCheck());
  }

  // The scratch bytes AttendPaged would allocate for `items` (which must be
  // valid).
  virtual int64_t PagedWorkspaceBytes(
      absl::Span<const PagedAttend> items) const = 0;

  // The scratch bytes an Attend of `shape` with `options` would allocate
  // (beyond its inputs and outputs), nullopt if more than int64_t holds. The
  // shape must be valid. Servers check it before queueing a request.
  virtual std::optional<int64_t> AttendWorkspaceBytes(
      const AttentionShape& shape, const AttentionOptions& options) const = 0;

  // The same for an AttendHalf of `dtype` inputs (aligned spans): its scratch
  // and any f32 copies it makes of them.
  virtual std::optional<int64_t> AttendHalfWorkspaceBytes(
      const AttentionShape& shape, const AttentionOptions& options,
      DataType dtype) const = 0;

  // Whether an Attend of `shape` runs on the calling thread alone (no OpenMP
  // team): calls under 2^20 FLOPs do, since waking a team costs more than their
  // arithmetic. The shape must be valid. Servers run such calls without
  // handing them to another thread.
  virtual bool AttendRunsOnCallingThread(const AttentionShape& shape) const = 0;

  // What the engine computes with, for logs and build-info metrics.
  virtual RuntimeInfo runtime_info() const = 0;

  // The options it was created with (max_workspace_bytes: the scratch limit
  // a call is refused over).
  virtual const EngineOptions& options() const = 0;

 protected:
  AttentionEngine() = default;
};

// The oneDNN this process runs with, without an engine: RuntimeInfo's
// onednn_version, threading and cpu_isa (threads 0, kernels empty).
RuntimeInfo OneDnnRuntimeInfo();

// The compute threads EngineOptions::num_threads 0 stands for: OpenMP's
// maximum (OMP_NUM_THREADS, else the cores this process may run on).
int DefaultComputeThreads();

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_ATTENTION_ENGINE_H_
