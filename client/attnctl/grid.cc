#include "grid.h"

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attnserve/common/files.h"
#include "attnserve/common/status_macros.h"
#include "cli.h"
#include "png.h"
#include "request_flags.h"

ABSL_FLAG(std::string, png, "", "grid: write the heatmap as a PNG here.");
ABSL_FLAG(std::string, svg, "", "grid: write the heatmap as an SVG here.");
ABSL_FLAG(int32_t, cell, 8, "grid: pixels on a side of one cell (1 to 64).");
ABSL_FLAG(int64_t, head, -1,
          "grid: draw this query head (PER_HEAD weights); negative: the mean "
          "over heads (HEAD_MEAN).");
ABSL_FLAG(int64_t, batch_index, 0, "grid: the batch item to draw.");

namespace attnserve {
namespace {

// Checks --batch_index and --head against the query [B, H, Lq, Dk] and the
// grid's size against the pictures' limits, before anything is sent.
absl::Status CheckGridRequest(const v1::AttendRequest& request,
                              int64_t batch_index, int64_t head, int cell,
                              bool svg) {
  const v1::Tensor& query = request.query();
  const v1::Tensor& key = request.key();
  if (query.shape_size() != 4 || key.shape_size() != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("query has shape [", absl::StrJoin(query.shape(), ", "),
                     "] and key [", absl::StrJoin(key.shape(), ", "),
                     "], expected [B, H, Lq, Dk] and [B, Hkv, Lk, Dk]"));
  }
  if (batch_index < 0 || batch_index >= query.shape(0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--batch_index is ", batch_index, ", expected 0 to ",
                     query.shape(0) - 1, " (B - 1)"));
  }
  if (head >= query.shape(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--head is ", head, ", expected 0 to ", query.shape(1) - 1,
                     " (H - 1), or negative for the mean"));
  }
  ATTNSERVE_RETURN_IF_ERROR(
      LayoutHeatmap(query.shape(2), key.shape(2), cell).status());
  if (svg && query.shape(2) * key.shape(2) > kMaxSvgCells) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a ", query.shape(2), " x ", key.shape(2), " grid is over ",
        kMaxSvgCells, " cells for --svg; write a --png instead"));
  }
  return absl::OkStatus();
}

// Whether `a` and `b`, both set, are one file: the same path once "." and
// ".." and links are resolved, or (existing) the same inode.
bool NameOneFile(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  std::error_code error;
  if (std::filesystem::equivalent(a, b, error)) return true;
  // weakly_canonical leaves a relative path none of whose parts exist as it
  // is: made absolute first.
  const auto resolved = [&error](const std::string& path) {
    return std::filesystem::weakly_canonical(
        std::filesystem::absolute(path, error), error);
  };
  const std::filesystem::path first = resolved(a);
  if (error) return a == b;
  const std::filesystem::path second = resolved(b);
  return error ? a == b : first == second;
}

}  // namespace

absl::StatusOr<AttentionGrid> ExtractGrid(const v1::Tensor& weights,
                                          int64_t batch_index, int64_t head) {
  const bool per_head = head >= 0;
  const int rank = per_head ? 4 : 3;
  if (weights.shape_size() != rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weights have shape [", absl::StrJoin(weights.shape(), ", "),
        "], expected ", per_head ? "[B, H, Lq, Lk]" : "[B, Lq, Lk]"));
  }
  const int64_t batch = weights.shape(0);
  const int64_t heads = per_head ? weights.shape(1) : 1;
  if (batch_index < 0 || batch_index >= batch || head >= heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch item ", batch_index,
                     (per_head ? absl::StrCat(", head ", head) : std::string()),
                     " is outside weights of shape [",
                     absl::StrJoin(weights.shape(), ", "), "]"));
  }
  ATTNSERVE_ASSIGN_OR_RETURN(std::vector<float> values, FloatValues(weights));
  AttentionGrid grid;
  grid.rows = weights.shape(rank - 2);
  grid.columns = weights.shape(rank - 1);
  const int64_t size = grid.rows * grid.columns;
  const int64_t offset = (batch_index * heads + (per_head ? head : 0)) * size;
  grid.values.assign(values.begin() + offset, values.begin() + offset + size);
  return grid;
}

int RunGrid(Client& client) {
  const std::string png_path = absl::GetFlag(FLAGS_png);
  const std::string svg_path = absl::GetFlag(FLAGS_svg);
  const int64_t head = absl::GetFlag(FLAGS_head);
  const int64_t batch_index = absl::GetFlag(FLAGS_batch_index);
  const int cell = absl::GetFlag(FLAGS_cell);
  if (png_path.empty() && svg_path.empty()) {
    return UsageError(absl::InvalidArgumentError("grid needs --png or --svg"));
  }
  if (NameOneFile(png_path, svg_path)) {
    return UsageError(absl::InvalidArgumentError(
        absl::StrCat("--png and --svg name one file, ", png_path,
                     ": the SVG would overwrite the PNG; give each its own")));
  }
  absl::StatusOr<v1::AttendRequest> request =
      AttendRequestFromFlags(InputMode::kFilesOrDemo);
  if (!request.ok()) return UsageError(request.status());
  request->mutable_options()->set_return_weights(
      head >= 0 ? v1::AttentionOptions::PER_HEAD
                : v1::AttentionOptions::HEAD_MEAN);
  const absl::Status checked =
      CheckGridRequest(*request, batch_index, head, cell, !svg_path.empty());
  if (!checked.ok()) return UsageError(checked);

  absl::StatusOr<v1::AttendResponse> response =
      client.Attend(*request, CallTimeout());
  if (!response.ok()) return Fail(response.status());
  absl::StatusOr<AttentionGrid> grid =
      ExtractGrid(response->weights(), batch_index, head);
  if (!grid.ok()) return Fail(grid.status());
  absl::StatusOr<HeatmapLayout> layout =
      LayoutHeatmap(grid->rows, grid->columns, cell);
  if (!layout.ok()) return Fail(layout.status());

  const std::string what =
      absl::StrCat(head >= 0 ? absl::StrCat("head ", head) : "mean over heads",
                   ", batch item ", batch_index, ", ", grid->rows,
                   " queries x ", grid->columns, " keys, cells of ", cell,
                   " px, max weight ", GridMax(*grid));
  const std::pair<std::string, bool> outputs[] = {{png_path, true},
                                                  {svg_path, false}};
  for (const auto& [path, is_png] : outputs) {
    if (path.empty()) continue;
    absl::StatusOr<std::string> bytes =
        is_png ? EncodePng(RenderHeatmapImage(*grid, *layout))
               : RenderHeatmapSvg(*grid, *layout);
    if (bytes.ok() && bytes->empty()) {
      bytes = absl::ResourceExhaustedError("libpng could not encode the PNG");
    }
    if (!bytes.ok()) return Fail(bytes.status());
    const absl::Status written = WriteOutputFile(path, *bytes);
    if (!written.ok()) return Fail(written);
    std::printf("wrote %s %dx%d px, %zu bytes: %s\n", path.c_str(),
                layout->width, layout->height, bytes->size(), what.c_str());
  }
  return kExitOk;
}

}  // namespace attnserve
