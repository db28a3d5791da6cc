#include "internal/matmul.h"

#include <atomic>
#include <cstring>

#include "attnserve/common/dtype.h"

namespace attnserve::internal {
namespace {

std::atomic<bool> emulate_for_testing{false};

bool ProbeNativeBf16Matmuls() {
  using dnnl::memory;
  try {
    const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    const memory::desc a({2, 2}, memory::data_type::bf16,
                         memory::format_tag::ab);
    const memory::desc c({2, 2}, memory::data_type::f32,
                         memory::format_tag::ab);
    dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, a, c), engine);
    return true;
  } catch (const dnnl::error&) {
    return false;  // "could not create a primitive descriptor iterator"
  }
}

bool IsAmxBf16(const dnnl::matmul::primitive_desc& pd) {
  return std::strcmp(pd.impl_info_str(), kAmxBf16MatmulImplementation) == 0;
}

}  // namespace

bool NativeBf16Matmuls() {
  static const bool native = ProbeNativeBf16Matmuls();
  return native;
}

void EmulateBf16MatmulsForTesting(bool emulate) {
  emulate_for_testing.store(emulate);
}

MatmulInput MatmulInputFor(Precision precision) {
  if (precision == Precision::kFloat32) return MatmulInput::kF32;
  return NativeBf16Matmuls() && !emulate_for_testing.load()
             ? MatmulInput::kBf16
             : MatmulInput::kRoundedF32;
}

dnnl::memory::data_type DataTypeOf(MatmulInput input) {
  return input == MatmulInput::kBf16 ? dnnl::memory::data_type::bf16
                                     : dnnl::memory::data_type::f32;
}

int64_t BytesOf(MatmulInput input) {
  return input == MatmulInput::kBf16 ? 2 : 4;
}

void RoundToBf16Values(const float* source, int64_t n, float* destination) {
  for (int64_t i = 0; i < n; ++i) {
    destination[i] = BFloat16ToFloat32(Float32ToBFloat16(source[i]));
  }
}

bool AvoidsAmxBf16Matmul(int64_t /*m*/, int64_t k, int64_t /*n*/) {
  return k % 32 != 0;
}

dnnl::matmul::primitive_desc MakeMatmulPrimitiveDesc(
    const dnnl::matmul::desc& desc, const dnnl::primitive_attr& attr,
    const dnnl::engine& engine) {
  dnnl::matmul::primitive_desc pd(desc, attr, engine);
  const dnnl_memory_desc_t& src = desc.data.src_desc;
  const dnnl_memory_desc_t& dst = desc.data.dst_desc;
  const int64_t m = src.dims[src.ndims - 2];
  const int64_t k = src.dims[src.ndims - 1];
  const int64_t n = dst.dims[dst.ndims - 1];
  if (!AvoidsAmxBf16Matmul(m, k, n)) return pd;
  while (IsAmxBf16(pd)) {
    if (!pd.next_impl()) {
      throw dnnl::error(dnnl_unimplemented,
                        "no matmul implementation but the AMX one this "
                        "oneDNN crashes on for this shape");
    }
  }
  return pd;
}

}  // namespace attnserve::internal
