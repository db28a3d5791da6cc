// Heatmaps of an attention grid: one cell per (query, key), query rows top
// to bottom, keys left to right, coloured by a viridis-like map scaled to the
// grid's maximum, with token indices on the axes. Rendered as an RGB image
// (for PNG, labels drawn in a built-in 3x5 pixel font) or as SVG (labels as
// text elements).
//
// Layout, in pixels, for R rows, C columns and cells of `cell` pixels; a label
// of n digits is 4n - 1 pixels wide and 5 high, and wr, wc are the widths of
// the labels R - 1 and C - 1:
//   left   = 2 + wr + 2          row labels, right-aligned next to the grid
//   top    = 2 + 5 + 2           column labels above the grid
//   right  = 2 + max(0, wc - cell)
//   bottom = 2 + max(0, 5 - cell)
//   width  = left + C * cell + right,  height = top + R * cell + bottom
// Every `row_step`-th row and `column_step`-th column is labelled, the step
// being the least of 1, 2, 5, 10, 20, 50, ... that keeps labels apart.
//
// The functions here are thread-safe.
#ifndef ATTNSERVE_CLIENT_ATTNCTL_HEATMAP_H_
#define ATTNSERVE_CLIENT_ATTNCTL_HEATMAP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "png.h"

namespace attnserve {

// A rows x columns grid of values, row-major.
struct AttentionGrid {
  int64_t rows = 0;
  int64_t columns = 0;
  std::vector<float> values;
};

// Where a heatmap's parts go; see the file comment.
struct HeatmapLayout {
  int64_t rows = 0;
  int64_t columns = 0;
  int cell = 0;  // Pixels on a side of one cell.
  int left = 0;  // The grid's top-left corner.
  int top = 0;
  int width = 0;  // The whole image.
  int height = 0;
  int64_t row_step = 1;  // Label every row_step-th row.
  int64_t column_step = 1;
};

// The most pixels on either side of a heatmap.
inline constexpr int kMaxHeatmapSide = 16384;
// The most cells an SVG heatmap holds.
inline constexpr int64_t kMaxSvgCells = int64_t{1} << 18;

// The layout of a rows x columns heatmap with cells of `cell` pixels.
// INVALID_ARGUMENT for a non-positive grid, `cell` outside [1, 64], or an
// image over kMaxHeatmapSide pixels on a side.
absl::StatusOr<HeatmapLayout> LayoutHeatmap(int64_t rows, int64_t columns,
                                            int cell);

// The colour of `fraction` (clamped to [0, 1]) on a viridis-like map:
// linear between matplotlib's viridis at every eighth, from dark purple
// (68, 1, 84) at 0 to yellow (253, 231, 37) at 1.
Rgb ViridisColour(double fraction);

// The colour of `value` in a heatmap whose largest value is `max_value`:
// ViridisColour(value / max_value) (0 when max_value is not positive), and
// magenta for NaN.
Rgb CellColour(float value, float max_value);

// The largest finite value of `grid`, or 0 if it has none.
float GridMax(const AttentionGrid& grid);

// The heatmap of `grid` (whose size matches `layout`) as an image.
RgbImage RenderHeatmapImage(const AttentionGrid& grid,
                            const HeatmapLayout& layout);

// The heatmap of `grid` as an SVG document, each cell a <rect> with a
// <title> holding its value. INVALID_ARGUMENT over kMaxSvgCells cells.
absl::StatusOr<std::string> RenderHeatmapSvg(const AttentionGrid& grid,
                                             const HeatmapLayout& layout);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTNCTL_HEATMAP_H_
