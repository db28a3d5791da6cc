// The vocabulary of attnserve's attention core: the shapes of a call, its
// options, where it writes, and what an engine computes with. Value types
// only; the engine that takes them is attention_engine.h. Code that describes,
// checks or counts calls (codecs, validators, metrics) needs this header alone.
//
// Tensors are packed row-major f32: query [B, H, Lq, Dk], key [B, Hkv, Lk, Dk],
// value [B, Hkv, Lk, Dv], output [B, H, Lq, Dv]. Query head h reads kv head h /
// (H / Hkv). The semantics are PyTorch's scaled_dot_product_attention(...,
// enable_gqa=True) and nn.MultiheadAttention; docs/api.md states them in full.
#ifndef ATTNSERVE_CORE_ATTENTION_TYPES_H_
#define ATTNSERVE_CORE_ATTENTION_TYPES_H_

#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attnserve/common/flops.h"
#include "attnserve/core/rotary.h"

namespace attnserve {

// The dimensions of one SDPA problem. Every field must be positive and heads %
// kv_heads == 0.
struct AttentionShape {
  int64_t batch = 1;      // B
  int64_t heads = 1;      // H, query heads
  int64_t kv_heads = 1;   // Hkv, key/value heads
  int64_t query_len = 1;  // Lq
  int64_t key_len = 1;    // Lk
  int64_t key_dim = 1;    // Dk, shared by query and key
  int64_t value_dim = 1;  // Dv

  // Element counts of each tensor. Only meaningful for a shape whose products
  // fit in int64_t, which the engine checks before using them.
  int64_t QueryElements() const { return batch * heads * query_len * key_dim; }
  int64_t KeyElements() const { return batch * kv_heads * key_len * key_dim; }
  int64_t ValueElements() const {
    return batch * kv_heads * key_len * value_dim;
  }
  int64_t OutputElements() const {
    return batch * heads * query_len * value_dim;
  }
  int64_t WeightsElements() const {
    return batch * heads * query_len * key_len;
  }
  int64_t HeadMeanWeightsElements() const {
    return batch * query_len * key_len;
  }
  int64_t LseElements() const { return batch * heads * query_len; }

  // The counts attnserve/common/flops.h takes.
  AttentionDims Dims() const {
    return {static_cast<double>(batch),     static_cast<double>(heads),
            static_cast<double>(query_len), static_cast<double>(key_len),
            static_cast<double>(key_dim),   static_cast<double>(value_dim)};
  }

  // "[B=1, H=8, Hkv=8, Lq=128, Lk=128, Dk=64, Dv=64]", for messages and logs.
  std::string DebugString() const;
};

// Which keys a query may see under `causal`: query i sees key j only if j <= i
// (kTopLeft, PyTorch's is_causal) or j <= i + L − Lq (kBottomRight, the
// KV-cache convention), where L is the batch item's key length: key_lengths[b]
// if given, else Lk.
enum class CausalAlignment { kTopLeft, kBottomRight };

enum class AttentionWeightsMode {
  kNone,
  kPerHead,   // [B, H, Lq, Lk]
  kHeadMean,  // [B, Lq, Lk], the mean over the H heads
};

enum class Precision {
  kFloat32,   // f32 everywhere.
  kBFloat16,  // bf16 inputs to every matmul, f32 accumulation, f32 softmax.
};

// A mask over the scores, broadcast to [B, H, Lq, Lk] as PyTorch broadcasts.
struct AttentionMask {
  // The mask's dims, left-padded with 1 to rank 4; each is 1 or the matching
  // [B, H, Lq, Lk].
  std::array<int64_t, 4> dims = {1, 1, 1, 1};
  // Exactly one is set, holding product(dims) packed row-major elements.
  // Boolean mask: nonzero = the query may attend the key.
  const uint8_t* allowed = nullptr;
  // Float mask: added to the scaled scores (−inf = masked).
  const float* bias = nullptr;
};

// Asked by a running computation, from any of its threads and between its
// tiles (every few milliseconds of work at most), whether to go on: OK goes
// on; an error stops it, and the call frees its scratch and returns that error
// with its outputs undefined. Must be thread-safe and cheap (a clock read and
// an atomic load). Empty: the computation runs to its end.
using StopCheck = std::function<absl::Status()>;

// The least logit softcap the kernels take: the smallest normal float. Below
// it 1 / softcap is inf, and a score of 0 would become 0 · inf = NaN.
inline constexpr float kMinSoftcap = std::numeric_limits<float>::min();
inline bool IsValidSoftcap(float softcap) {
  return std::isfinite(softcap) && softcap >= kMinSoftcap;
}
// The INVALID_ARGUMENT for a softcap IsValidSoftcap refuses, naming `field`
// (both numbers to float's 9 significant digits, so that the bound read back
// is the bound).
absl::Status SoftcapRefusal(absl::string_view field, float softcap);

// How one call computes. Defaults are PyTorch's.
struct AttentionOptions {
  // Multiplies Q Kᵀ. nullopt: 1 / sqrt(key_dim). Must be finite.
  std::optional<float> scale;
  bool causal = false;
  CausalAlignment causal_alignment = CausalAlignment::kTopLeft;
  // Empty, or one entry per batch item in [0, Lk]: keys at or past it are
  // padding.
  absl::Span<const int64_t> key_lengths;
  std::optional<AttentionMask> mask;
  // A sliding window (FlashAttention's window_size): query i of batch item b
  // sees only keys j with i + offset − window_left <= j <= i + offset +
  // window_right, where offset is 0 under kTopLeft and L − Lq under
  // kBottomRight (causal_alignment places the window even when causal is
  // false). −1: unbounded on that side. With causal, the window's right edge
  // is the causal one's at most.
  int64_t window_left = -1;
  int64_t window_right = -1;
  // The first num_sink_tokens keys are seen by every query on top of its
  // window (StreamingLLM's attention sinks). Causality, key_lengths and the
  // mask still apply to them.
  int64_t num_sink_tokens = 0;
  // Empty, or one slope per query head (H): ALiBi adds −slopes[h] · |i +
  // offset − j| to the scaled scores (offset as for the window), after the
  // softcap and before the mask.
  absl::Span<const float> alibi_slopes;
  // Logit softcap (Gemma 2): the scaled scores x become softcap · tanh(x /
  // softcap) before ALiBi, the mask and the softmax. nullopt: none; else
  // IsValidSoftcap.
  std::optional<float> softcap;
  // MultiHeadAttention with RoPE (ProjectionWeights::rope) only: each batch
  // item's query and key positions, [B, Lq] and [B, Lk], each in [0,
  // kMaxRotaryPosition]. Empty: 0 to L − 1 in every batch item.
  absl::Span<const int64_t> query_positions;
  absl::Span<const int64_t> key_positions;
  AttentionWeightsMode weights = AttentionWeightsMode::kNone;
  bool return_lse = false;
  Precision precision = Precision::kFloat32;
  // Stops the call early (a cancelled caller, a passed deadline). Not part of
  // what the call computes: batching and plan caches ignore it.
  StopCheck stop;
};

// Where a call writes. A query row that may attend to no key gets output 0,
// weights 0 and lse −inf.
struct AttentionOutputs {
  AttentionOutputs(absl::Span<float> output_span,
                   absl::Span<float> weights_span = {},
                   absl::Span<float> lse_span = {})
      : output(output_span), weights(weights_span), lse(lse_span) {}

  absl::Span<float> output;   // SDPA [B, H, Lq, Dv]; MHA [B, Lq, E].
  absl::Span<float> weights;  // Sized as options.weights asks; empty for kNone.
  // [B, H, Lq] natural-log log-sum-exp of the scores, if asked.
  absl::Span<float> lse;
};

// One request of a batched Attend (AttentionEngine::AttendBatch): its batch
// size and its tensors, sized for the batch's shape with that batch size.
struct AttendPart {
  int64_t batch = 1;
  absl::Span<const float> query, key, value;
  AttentionOutputs outputs{absl::Span<float>()};
};

// Packed sequences (FlashAttention's varlen layout): query [total_q, H, Dk],
// key [total_k, Hkv, Dk], value [total_k, Hkv, Dv], output [total_q, H, Dv],
// lse [H, total_q]. Sequence s owns query rows [cu_seqlens_q[s],
// cu_seqlens_q[s + 1]) and key rows [cu_seqlens_k[s], cu_seqlens_k[s + 1])
// and attends only within them; causal, the window and ALiBi place its
// queries as an Attend of its lengths would (Lq = its queries, L = its keys).
struct PackedShape {
  int64_t heads = 1;
  int64_t kv_heads = 1;
  int64_t key_dim = 1;
  int64_t value_dim = 1;
  // One more entry than sequences; start at 0 and never decrease.
  absl::Span<const int64_t> cu_seqlens_q;
  absl::Span<const int64_t> cu_seqlens_k;

  int64_t Sequences() const {
    return static_cast<int64_t>(cu_seqlens_q.size()) - 1;
  }
  int64_t TotalQuery() const { return cu_seqlens_q.back(); }
  int64_t TotalKey() const { return cu_seqlens_k.back(); }
};

// The dimensions of a multi-head attention (batch first).
struct MultiHeadShape {
  int64_t batch = 1;         // B
  int64_t query_len = 1;     // Lq
  int64_t key_len = 1;       // Lk; equals Lq for self-attention
  int64_t embed_dim = 1;     // E, of query_input and of the output
  int64_t kv_embed_dim = 1;  // Ekv, of kv_input; equals E for self-attention
  int64_t heads = 1;         // H
  int64_t kv_heads = 1;      // Hkv, divides H
  int64_t key_dim = 1;       // Dk per head
  int64_t value_dim = 1;     // Dv per head

  // The SDPA shape of the projected heads.
  AttentionShape Heads() const;
  // The counts attnserve/common/flops.h takes.
  ProjectionDims Projections() const {
    return {static_cast<double>(embed_dim), static_cast<double>(kv_embed_dim),
            static_cast<double>(kv_heads)};
  }
};

// Projection weights in torch.nn.Linear layout (W [out, in], y = x Wᵀ + b),
// f32, row-major. The spans are borrowed for the duration of a call.
struct ProjectionWeights {
  absl::Span<const float> w_q;  // [H·Dk, E]
  absl::Span<const float> w_k;  // [Hkv·Dk, Ekv]
  absl::Span<const float> w_v;  // [Hkv·Dv, Ekv]
  absl::Span<const float> w_o;  // [E, H·Dv]
  // Biases, each empty (no bias) or of its projection's output size.
  absl::Span<const float> b_q, b_k, b_v, b_o;
  // Optional: w_q, w_k, w_v stacked by rows ([H·Dk + Hkv·(Dk + Dv), E]) and
  // their biases likewise (empty when no projection has a bias), so that
  // self-attention projects in one GEMM.
  absl::Span<const float> w_qkv, b_qkv;
  // RoPE, applied to the projected queries and keys (attnserve/core/rotary.h)
  // at AttentionOptions' positions; nullopt: none.
  std::optional<RotaryEmbedding> rope;
};

// The runtime an engine computes with.
struct RuntimeInfo {
  std::string onednn_version;  // "2.6.3"
  // oneDNN's effective ISA: "avx512_core_bf16", "avx2", ...
  std::string cpu_isa;
  std::string threading;  // oneDNN's CPU threading runtime: "OMP", "TBB", "SEQ"
  int threads = 0;        // threads each call computes with
  std::string kernels;    // the fused kernel's code: "avx512" or "portable"

  // "oneDNN 2.6.3 (OMP), avx512_core_bf16, 2 threads, avx512 kernels".
  std::string Description() const;
};

// The two ways SDPA is computed.
enum class AttentionKernel {
  // The fused tiled kernel, which never holds the Lq×Lk scores, unless the
  // call asks for the attention weights (which are those scores' softmax).
  kAuto,
  // Always materialise the scores (in slabs): a baseline for benchmarks and
  // tests.
  kUnfused,
};

// How an engine is made (AttentionEngine::Create).
struct EngineOptions {
  // OpenMP threads each call computes with. 0: every core the process may use.
  int num_threads = 0;
  AttentionKernel kernel = AttentionKernel::kAuto;
  // Run the fused kernel's portable C++ code even where the CPU has AVX-512
  // (tests cover the fallback with it on any machine).
  bool portable_kernels = false;
  // Run the paged kernel's AVX2 code (what CPUs without AVX-512 run) even
  // where the CPU has AVX-512, so tests cover it on any AVX2 machine; Create
  // refuses it on a CPU without AVX2 and FMA. The tile kernels have no
  // AVX2 form: they keep theirs. portable_kernels wins over it.
  bool avx2_kernels = false;
  // The most scratch memory one call may allocate. A call that would need more
  // fails with RESOURCE_EXHAUSTED before allocating anything.
  int64_t max_workspace_bytes = int64_t{1} << 30;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_ATTENTION_TYPES_H_
