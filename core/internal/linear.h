// torch.nn.Linear on oneDNN matmul: y = x wᵀ + b, with w in [out, in] layout
// read as wᵀ through strides (never transposed in memory).
#ifndef ATTNSERVE_CORE_INTERNAL_LINEAR_H_
#define ATTNSERVE_CORE_INTERNAL_LINEAR_H_

#include <cstdint>

#include "absl/status/status.h"
#include "attnserve/core/attention_types.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::internal {

struct LinearProblem {
  int64_t rows = 0;  // M: rows of x and y
  int64_t in = 0;    // K: features in
  int64_t out = 0;   // N: features out
  const float* x = nullptr;
  int64_t x_stride = 0;         // elements between rows of x
  const float* w = nullptr;     // [out, in], row-major
  const float* bias = nullptr;  // [out], or null for none
  float* y = nullptr;
  int64_t y_stride = 0;  // elements between rows of y, so y may be a column
                         // block of a wider matrix
};

// Scratch bytes RunLinear allocates: bf16 copies of x and w at kBFloat16,
// nothing at kFloat32.
int64_t LinearWorkspaceBytes(const LinearProblem& problem, Precision precision);

// A run of rows holds about this many FLOPs (tens of milliseconds on two
// cores), and at least kLinearMinRowsBetweenPolls rows, so that the GEMMs
// keep their rate.
inline constexpr int64_t kLinearFlopsBetweenPolls = int64_t{1} << 32;
inline constexpr int64_t kLinearMinRowsBetweenPolls = 256;

// The rows of `problem` RunLinear computes between polls of its stop check.
int64_t LinearRowsBetweenPolls(const LinearProblem& problem);

// Computes y. At kBFloat16, x and w are rounded to bf16 and accumulated in f32.
// Rows go in runs of LinearRowsBetweenPolls, `stop` (if set) polled between
// them: its error ends the call, the rows after it not computed.
absl::Status RunLinear(const dnnl::engine& engine, dnnl::stream& stream,
                       const LinearProblem& problem, Precision precision,
                       const StopCheck& stop = StopCheck());

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_LINEAR_H_
