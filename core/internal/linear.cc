#include "internal/linear.h"

#include <algorithm>
#include <unordered_map>

#include "attnserve/common/status_macros.h"
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

int64_t LinearRowsBetweenPolls(const LinearProblem& p) {
  const int64_t flops_per_row = std::max<int64_t>(1, 2 * p.in * p.out);
  return std::max(
      kLinearMinRowsBetweenPolls,
      (kLinearFlopsBetweenPolls + flops_per_row - 1) / flops_per_row);
}

absl::Status RunLinear(const dnnl::engine& engine, dnnl::stream& stream,
                       const LinearProblem& p, Precision precision,
                       const StopCheck& stop) {
  absl::Status stopped;
  ATTNSERVE_RETURN_IF_ERROR(CallDnnl("projection", [&] {
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
    const memory::desc w_t_md({p.in, p.out}, type, Dims{1, p.in});
    const memory::desc bias_md({1, p.out}, f32, memory::format_tag::ab);
    const int64_t step = LinearRowsBetweenPolls(p);
    // Rows in runs, the call polled between them; at most two shapes of
    // matmul, which oneDNN's primitive cache keeps.
    for (int64_t first = 0; first < p.rows; first += step) {
      if (stop && first > 0) {
        stopped = stop();
        if (!stopped.ok()) return;
      }
      const int64_t rows = std::min(step, p.rows - first);
      const memory::desc x_md({rows, p.in}, type, Dims{x_stride, 1});
      const memory::desc y_md({rows, p.out}, f32, Dims{p.y_stride, 1});
      const dnnl::matmul matmul(MakeMatmulPrimitiveDesc(
          p.bias != nullptr ? dnnl::matmul::desc(x_md, w_t_md, bias_md, y_md)
                            : dnnl::matmul::desc(x_md, w_t_md, y_md),
          dnnl::primitive_attr(), engine));
      const char* x_rows =
          static_cast<const char*>(x) + first * x_stride * BytesOf(input);
      std::unordered_map<int, memory> args = {
          {DNNL_ARG_SRC, memory(x_md, engine, const_cast<char*>(x_rows))},
          {DNNL_ARG_WEIGHTS, memory(w_t_md, engine, const_cast<void*>(w))},
          {DNNL_ARG_DST, memory(y_md, engine, p.y + first * p.y_stride)}};
      if (p.bias != nullptr) {
        args.emplace(DNNL_ARG_BIAS,
                     memory(bias_md, engine, const_cast<float*>(p.bias)));
      }
      matmul.execute(stream, args);
      stream.wait();
    }
  }));
  return stopped;
}

}  // namespace attnserve::internal
