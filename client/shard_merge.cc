#include "shard_merge.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "attnserve/proto/tensors.h"

namespace attnserve::internal {
namespace {

int64_t Product(const v1::Tensor& tensor, int from, int to) {
  int64_t product = 1;
  for (int d = from; d < to; ++d) product *= tensor.shape(d);
  return product;
}

}  // namespace

v1::Tensor Slice(const v1::Tensor& tensor, int dim, int64_t begin,
                 int64_t end) {
  const int64_t element = DTypeBytes(tensor.dtype());
  const int64_t outer = Product(tensor, 0, dim);
  const int64_t length = tensor.shape(dim);
  const int64_t inner = Product(tensor, dim + 1, tensor.shape_size()) * element;
  v1::Tensor slice;
  slice.set_dtype(tensor.dtype());
  slice.mutable_shape()->CopyFrom(tensor.shape());
  slice.set_shape(dim, end - begin);
  std::string* data = slice.mutable_data();
  data->reserve(static_cast<size_t>(outer * (end - begin) * inner));
  for (int64_t o = 0; o < outer; ++o) {
    data->append(tensor.data(),
                 static_cast<size_t>((o * length + begin) * inner),
                 static_cast<size_t>((end - begin) * inner));
  }
  return slice;
}

absl::Status CheckOutputDtype(v1::DType dtype) {
  if (dtype == v1::DTYPE_UNSPECIFIED || dtype == v1::FLOAT32 ||
      dtype == v1::BFLOAT16 || dtype == v1::FLOAT16) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "options.output_dtype is ",
      v1::DType_IsValid(dtype) ? v1::DType_Name(dtype)
                               : absl::StrCat(static_cast<int>(dtype)),
      ", expected FLOAT32, BFLOAT16 or FLOAT16 (or unset: the "
      "query's)"));
}

void MergeByLse(const std::vector<std::vector<float>>& outputs,
                const std::vector<std::vector<float>>& lses, int64_t rows,
                int64_t value_dim, std::vector<float>* output,
                std::vector<float>* lse) {
  constexpr double kInfinity = std::numeric_limits<double>::infinity();
  output->assign(static_cast<size_t>(rows * value_dim), 0.0f);
  lse->assign(static_cast<size_t>(rows), 0.0f);
  std::vector<double> row(static_cast<size_t>(value_dim));
  for (int64_t r = 0; r < rows; ++r) {
    double max_lse = -kInfinity;
    bool nan = false;
    for (const auto& part_lse : lses) {
      max_lse = std::max<double>(max_lse, part_lse[r]);
      nan = nan || std::isnan(part_lse[r]);
    }
    if (nan) {
      // A NaN row (a NaN query, say) in any shard is NaN in the whole call,
      // as one call over every key gives it.
      constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
      std::fill_n(output->begin() + r * value_dim, value_dim, kNan);
      (*lse)[r] = kNan;
      continue;
    }
    if (max_lse == -kInfinity) {
      (*lse)[r] = -std::numeric_limits<float>::infinity();
      continue;  // No key in any shard: the output stays 0.
    }
    double total = 0.0;
    std::fill(row.begin(), row.end(), 0.0);
    for (size_t s = 0; s < outputs.size(); ++s) {
      const double weight = std::exp(lses[s][r] - max_lse);
      total += weight;
      for (int64_t v = 0; v < value_dim; ++v) {
        row[v] += weight * outputs[s][r * value_dim + v];
      }
    }
    for (int64_t v = 0; v < value_dim; ++v) {
      (*output)[r * value_dim + v] = static_cast<float>(row[v] / total);
    }
    (*lse)[r] = static_cast<float>(max_lse + std::log(total));
  }
}

}  // namespace attnserve::internal
