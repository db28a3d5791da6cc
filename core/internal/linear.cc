#include "internal/linear.h"

#include <unordered_map>

#include "internal/bf16_buffer.h"
#include "internal/dnnl_status.h"
#include "internal/matmul.h"

namespace attnserve::internal {

using dnnl::memory;
using Dims = memory::dims;

int64_t LinearWorkspaceBytes(const LinearProblem& p, Precision precision) {
  const MatmulInput input = MatmulInputFor(precision);
  return input == MatmulInput::kF32
             ? 0
             : BytesOf(input) * (p.rows * p.in + p.out * p.in);
}

absl::Status RunLinear(const dnnl::engine& engine, dnnl::stream& stream,
                       const LinearProblem& p, Precision precision) {
  return CallDnnl("projection", [&] {
    const MatmulInput input = MatmulInputFor(precision);
    Bf16Buffer x_bf16, w_bf16;
    const void* x = p.x;
    const void* w = p.w;
    int64_t x_stride = p.x_stride;
    if (input != MatmulInput::kF32) {
      x_bf16 = Bf16Buffer::PackMatrix(p.x, p.rows, p.in, p.x_stride, input);
      w_bf16 = Bf16Buffer::PackMatrix(p.w, p.out, p.in, p.in, input);
      x = x_bf16.data();
      w = w_bf16.data();
      x_stride = p.in;
    }
    const auto type = DataTypeOf(input);
    const auto f32 = memory::data_type::f32;
    const memory::desc x_md({p.rows, p.in}, type, Dims{x_stride, 1});
    const memory::desc w_t_md({p.in, p.out}, type, Dims{1, p.in});
    const memory::desc y_md({p.rows, p.out}, f32, Dims{p.y_stride, 1});
    const memory::desc bias_md({1, p.out}, f32, memory::format_tag::ab);
    const dnnl::matmul matmul(MakeMatmulPrimitiveDesc(
        p.bias != nullptr ? dnnl::matmul::desc(x_md, w_t_md, bias_md, y_md)
                          : dnnl::matmul::desc(x_md, w_t_md, y_md),
        dnnl::primitive_attr(), engine));
    std::unordered_map<int, memory> args = {
        {DNNL_ARG_SRC, memory(x_md, engine, const_cast<void*>(x))},
        {DNNL_ARG_WEIGHTS, memory(w_t_md, engine, const_cast<void*>(w))},
        {DNNL_ARG_DST, memory(y_md, engine, p.y)}};
    if (p.bias != nullptr) {
      args.emplace(DNNL_ARG_BIAS,
                   memory(bias_md, engine, const_cast<float*>(p.bias)));
    }
    matmul.execute(stream, args);
    stream.wait();
  });
}

}  // namespace attnserve::internal
