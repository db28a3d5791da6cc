// AttentionEngine: scaled dot-product attention on the CPU through oneDNN.
//
//   ATTNSERVE_ASSIGN_OR_RETURN(std::unique_ptr<AttentionEngine> engine,
//                              AttentionEngine::Create(EngineOptions{}));
//   AttentionShape shape;
//   shape.heads = shape.kv_heads = 8;
//   shape.query_len = shape.key_len = 128;
//   shape.key_dim = shape.value_dim = 64;
//   std::vector<float> output(shape.OutputElements());
//   ATTNSERVE_RETURN_IF_ERROR(engine->Attend(shape, AttentionOptions{}, query,
//   key, value,
//                                            absl::MakeSpan(output)));
//
// Tensors are packed row-major: query [B, H, Lq, Dk], key [B, Hkv, Lk, Dk],
// value [B, Hkv, Lk, Dv], output [B, H, Lq, Dv]. Query head h reads kv head h /
// (H / Hkv).
#ifndef ATTNSERVE_CORE_ATTENTION_ENGINE_H_
#define ATTNSERVE_CORE_ATTENTION_ENGINE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

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
  // fit in int64_t, which Attend checks before using them.
  int64_t QueryElements() const { return batch * heads * query_len * key_dim; }
  int64_t KeyElements() const { return batch * kv_heads * key_len * key_dim; }
  int64_t ValueElements() const {
    return batch * kv_heads * key_len * value_dim;
  }
  int64_t OutputElements() const {
    return batch * heads * query_len * value_dim;
  }

  // "[B=1, H=8, Hkv=8, Lq=128, Lk=128, Dk=64, Dv=64]", for messages and logs.
  std::string DebugString() const;
};

// How one call computes. Fields added later default to PyTorch's behaviour.
struct AttentionOptions {
  // Multiplies Q Kᵀ. nullopt: 1 / sqrt(key_dim).
  std::optional<float> scale;
};

struct EngineOptions {
  // OpenMP threads each Attend call computes with. 0: every core the process
  // may use.
  int num_threads = 0;
  // The most scratch memory one Attend call may allocate. A call that would
  // need more fails with RESOURCE_EXHAUSTED before allocating anything.
  int64_t max_workspace_bytes = int64_t{1} << 30;
};

// Computes attention. Thread-safe: Attend may be called from several threads at
// once, each call using its own oneDNN stream (though concurrent calls share,
// and so oversubscribe, the cores).
class AttentionEngine {
 public:
  // Creates an engine on the CPU. Returns INVALID_ARGUMENT for bad options and
  // INTERNAL if oneDNN cannot create a CPU engine.
  static absl::StatusOr<std::unique_ptr<AttentionEngine>> Create(
      const EngineOptions& options);

  AttentionEngine(const AttentionEngine&) = delete;
  AttentionEngine& operator=(const AttentionEngine&) = delete;
  virtual ~AttentionEngine() = default;

  // Writes softmax(scale · Q Kᵀ) V into `output`. The spans must hold exactly
  // the element counts of `shape`. Returns INVALID_ARGUMENT for an inconsistent
  // shape, span or option, RESOURCE_EXHAUSTED if the call would need more than
  // max_workspace_bytes of scratch, and INTERNAL if oneDNN fails. Non-finite
  // inputs propagate as IEEE arithmetic does.
  virtual absl::Status Attend(const AttentionShape& shape,
                              const AttentionOptions& options,
                              absl::Span<const float> query,
                              absl::Span<const float> key,
                              absl::Span<const float> value,
                              absl::Span<float> output) = 0;

  // The bytes of scratch memory Attend needs for `shape`, or nullopt if that
  // overflows int64_t or kv_heads is not positive.
  virtual std::optional<int64_t> WorkspaceBytes(
      const AttentionShape& shape) const = 0;

  // Names of the runtime, for build-info reporting: e.g. "oneDNN 2.6.3 (OMP)".
  static std::string RuntimeDescription();

 protected:
  AttentionEngine() = default;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_ATTENTION_ENGINE_H_
