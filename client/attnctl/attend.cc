#include "attend.h"

#include <cmath>
#include <cstdio>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli.h"
#include "request_flags.h"
#include "tensor_io.h"
#include "weights.h"

ABSL_FLAG(std::string, output, "", "attend, mha: write the output .npy here.");
ABSL_FLAG(std::string, weights_out, "",
          "attend, mha: write the attention weights .npy here (needs "
          "--return_weights=per_head or head_mean).");
ABSL_FLAG(std::string, lse_out, "",
          "attend, mha: write lse [B, H, Lq] .npy here (implies "
          "--return_lse).");

namespace attnserve {
namespace {

// Applies --weights_out and --lse_out to `options`. INVALID_ARGUMENT if
// --weights_out is set while --return_weights is none.
absl::Status ApplyOutputFlags(v1::AttentionOptions* options) {
  if (!absl::GetFlag(FLAGS_lse_out).empty()) options->set_return_lse(true);
  if (!absl::GetFlag(FLAGS_weights_out).empty() &&
      options->return_weights() == v1::AttentionOptions::NONE) {
    return absl::InvalidArgumentError(
        "--weights_out needs --return_weights=per_head or head_mean");
  }
  return absl::OkStatus();
}

std::string Describe(const v1::Tensor& tensor) {
  return absl::StrCat("[", absl::StrJoin(tensor.shape(), ", "), "] ",
                      v1::DType_Name(tensor.dtype()));
}

// Prints a result's shape, checksum (sum and sum of absolute values) and the
// server's timings.
int PrintResult(const v1::Tensor& output_tensor, const v1::ServerTiming& timing,
                absl::Duration round_trip) {
  absl::StatusOr<std::vector<float>> output = FloatValues(output_tensor);
  if (!output.ok()) return Fail(output.status());
  double sum = 0.0, sum_abs = 0.0;
  for (float value : *output) {
    sum += value;
    sum_abs += std::abs(value);
  }
  std::printf("output shape %s\n", Describe(output_tensor).c_str());
  std::printf("checksum sum=%.6f sum_abs=%.6f\n", sum, sum_abs);
  std::printf(
      "server queue_us=%lld compute_us=%lld server_us=%lld, round trip %s\n",
      static_cast<long long>(timing.queue_us()),
      static_cast<long long>(timing.compute_us()),
      static_cast<long long>(timing.server_us()),
      absl::FormatDuration(round_trip).c_str());
  return kExitOk;
}

// Writes the response's output, weights and lse to the files the flags name.
template <typename Response>
int WriteResults(const Response& response) {
  const std::pair<std::string, const v1::Tensor*> files[] = {
      {absl::GetFlag(FLAGS_output), &response.output()},
      {absl::GetFlag(FLAGS_weights_out), &response.weights()},
      {absl::GetFlag(FLAGS_lse_out), &response.lse()}};
  for (const auto& [path, tensor] : files) {
    if (path.empty()) continue;
    const absl::Status written = WriteTensorFile(path, *tensor);
    if (!written.ok()) return Fail(written);
    std::printf("wrote %s %s\n", path.c_str(), Describe(*tensor).c_str());
  }
  return kExitOk;
}

template <typename Response>
int Report(const Response& response, absl::Duration round_trip) {
  const int printed =
      PrintResult(response.output(), response.timing(), round_trip);
  if (printed != kExitOk) return printed;
  return WriteResults(response);
}

}  // namespace

int RunAttend(Client& client) {
  absl::StatusOr<v1::AttendRequest> request =
      AttendRequestFromFlags(InputMode::kFilesOrDemo);
  if (!request.ok()) return UsageError(request.status());
  const absl::Status applied = ApplyOutputFlags(request->mutable_options());
  if (!applied.ok()) return UsageError(applied);

  const absl::Time start = absl::Now();
  absl::StatusOr<v1::AttendResponse> response =
      client.Attend(*request, CallTimeout());
  const absl::Duration round_trip = absl::Now() - start;
  if (!response.ok()) return Fail(response.status());
  return Report(*response, round_trip);
}

int RunMultiHead(Client& client) {
  absl::StatusOr<MultiHeadDraft> draft =
      MultiHeadDraftFromFlags(InputMode::kFilesOrDemo);
  if (!draft.ok()) return UsageError(draft.status());
  v1::MultiHeadAttentionRequest& request = draft->request;
  const absl::Status applied = ApplyOutputFlags(request.mutable_options());
  if (!applied.ok()) return UsageError(applied);
  if (draft->needs_random_inputs) {
    absl::StatusOr<v1::WeightsInfo> info = WeightsInfoFor(client, request);
    if (!info.ok()) return Fail(info.status());
    const absl::Status added = AddRandomMultiHeadInputs(*info, &request);
    if (!added.ok()) return UsageError(added);
  }

  const absl::Time start = absl::Now();
  absl::StatusOr<v1::MultiHeadAttentionResponse> response =
      client.MultiHeadAttention(request, CallTimeout());
  const absl::Duration round_trip = absl::Now() - start;
  if (!response.ok()) return Fail(response.status());
  if (request.has_weights()) {
    std::printf("weights inline\n");
  } else {
    std::printf("weights %s version %lld\n", request.weights_name().c_str(),
                static_cast<long long>(response->weights_version()));
  }
  return Report(*response, round_trip);
}

}  // namespace attnserve
