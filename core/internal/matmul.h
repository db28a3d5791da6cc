// Where the engine's matmuls meet the CPU: which element type a matmul of each
// precision reads on this machine, and the one place a matmul primitive
// descriptor is created, so that oneDNN implementations known to crash are
// never chosen.
//
// Two facts of oneDNN 2.6.3 (Debian 12's) that every path must respect:
//
// - It has a bf16 matmul only on CPUs with AVX-512 (avx512_core and up). On an
//   AVX2 CPU, BF16 precision is computed as f32 matmuls over operands rounded
//   to bf16 values (MatmulInput::kRoundedF32): bf16 × bf16 products are exact
//   in f32, so the arithmetic is the one a bf16 matmul with f32 accumulation
//   does, up to the order of the additions.
// - Its AMX bf16 brgemm matmul (brg:avx512_core_amx_bf16) executes AMX tile
//   instructions with a tile configuration that does not match on some shapes
//   (SIGILL, the whole process dies). MakeMatmulPrimitiveDesc never returns
//   that implementation for a shape in the avoided class (AvoidsAmxBf16Matmul);
//   it takes the next implementation oneDNN offers (brg:avx512_core_bf16).
//   docs/reliability.md says which shapes, why, and how the sweep that checks
//   it is run.
#ifndef ATTNSERVE_CORE_INTERNAL_MATMUL_H_
#define ATTNSERVE_CORE_INTERNAL_MATMUL_H_

#include <cstdint>

#include "attnserve/core/attention_types.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::internal {

// The element type a matmul's inputs are stored in.
enum class MatmulInput {
  kF32,         // F32 precision
  kBf16,        // BF16 precision, oneDNN's bf16 matmul
  kRoundedF32,  // BF16 precision on a CPU without one: f32 holding bf16 values
};

// Whether oneDNN has a bf16 matmul on this CPU. Probed once per process (a
// tiny primitive descriptor); thread-safe.
bool NativeBf16Matmuls();

// Makes BF16 precision use kRoundedF32 even where oneDNN has a bf16 matmul, so
// that tests check that path on every CPU. Not for production; set it while no
// call runs.
void EmulateBf16MatmulsForTesting(bool emulate);

// The input type of a matmul computed at `precision` on this CPU.
MatmulInput MatmulInputFor(Precision precision);

dnnl::memory::data_type DataTypeOf(MatmulInput input);
int64_t BytesOf(MatmulInput input);

// Writes `n` f32 values from `source` to `destination` rounded to the nearest
// bf16 value (ties to even); the two may be the same array.
void RoundToBf16Values(const float* source, int64_t n, float* destination);

// Whether MakeMatmulPrimitiveDesc keeps a bf16 matmul whose source is [..., m,
// k] and destination [..., m, n] off oneDNN 2.6's AMX kernel: every k that is
// not a multiple of 32. The kernel blocks k by 32; without a k tail it never
// runs the k-tail step whose tile configuration 2.6.3 leaves stale (SIGILL, or
// silently wrong results), whatever the thread count (docs/reliability.md).
bool AvoidsAmxBf16Matmul(int64_t m, int64_t k, int64_t n);

// The implementation name of oneDNN 2.6's AMX bf16 matmul.
inline constexpr char kAmxBf16MatmulImplementation[] =
    "brg:avx512_core_amx_bf16";

// Creates the primitive descriptor of `desc` with `attr` on `engine`, skipping
// kAmxBf16MatmulImplementation for shapes AvoidsAmxBf16Matmul names. Throws
// dnnl::error as dnnl::matmul::primitive_desc does (callers run it inside
// CallDnnl).
dnnl::matmul::primitive_desc MakeMatmulPrimitiveDesc(
    const dnnl::matmul::desc& desc, const dnnl::primitive_attr& attr,
    const dnnl::engine& engine);

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_MATMUL_H_
