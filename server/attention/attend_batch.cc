#include "attnserve/server/attention/attend_batch.h"

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/server/attention/response_tensors.h"
#include "attnserve/server/tensors/tensor_codec.h"

namespace attnserve {

std::string AttendBatchKey(const AttentionEngine& engine,
                           const v1::AttendRequest& request,
                           const AttendWork& work) {
  const v1::AttentionOptions& options = request.options();
  if (options.key_lengths_size() > 0 || work.packed || work.inputs_in_place) {
    return "";
  }
  if (work.plan.mask_dims && (*work.plan.mask_dims)[0] != 1) return "";
  if (!engine.AttendBatchable(work.plan.options) ||
      engine.DecodeReadsInPlace(work.shape, RoutedOptions(work.plan))) {
    return "";
  }
  const AttentionShape& s = work.shape;
  return absl::StrCat("attend:", request.query().dtype(), ",",
                      request.key().dtype(), ",", request.value().dtype(), ":",
                      s.batch, ",", s.heads, ",", s.kv_heads, ",", s.query_len,
                      ",", s.key_len, ",", s.key_dim, ",", s.value_dim, ":",
                      options.SerializeAsString());
}

absl::Status ComputeAttendBatch(AttentionEngine& engine,
                                absl::Span<const AttendBatchItem> items) {
  const AttendWork& first = *items.front().work;
  // Each item's f32 inputs (in place for FLOAT32) and its response tensors,
  // which the engine writes in place.
  std::vector<std::vector<float>> storage(3 * items.size());
  std::vector<std::unique_ptr<AttentionResponseTensors>> tensors;
  std::vector<AttendPart> parts;
  for (size_t i = 0; i < items.size(); ++i) {
    const AttendBatchItem& item = items[i];
    const AttentionShape& s = item.work->shape;
    const int64_t output_shape[] = {s.batch, s.heads, s.query_len, s.value_dim};
    v1::AttendResponse* response = item.response;
    tensors.push_back(std::make_unique<AttentionResponseTensors>(
        item.work->plan, s, output_shape, response->mutable_output(),
        /*weights=*/nullptr,
        item.work->plan.options.return_lse ? response->mutable_lse()
                                           : nullptr));
    AttendPart part;
    part.batch = s.batch;
    part.query = FloatElements(item.request->query(), &storage[3 * i]);
    part.key = FloatElements(item.request->key(), &storage[3 * i + 1]);
    part.value = FloatElements(item.request->value(), &storage[3 * i + 2]);
    part.outputs = tensors.back()->outputs();
    parts.push_back(part);
  }
  std::vector<float> mask_copy;
  ATTNSERVE_RETURN_IF_ERROR(engine.AttendBatch(
      first.shape,
      BindOptions(first.plan, items.front().request->options(), &mask_copy),
      parts));
  for (const auto& item_tensors : tensors) item_tensors->Finish();
  return absl::OkStatus();
}

}  // namespace attnserve
