#include "heatmap.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace attnserve {
namespace {

constexpr int kGlyphWidth = 3;
constexpr int kGlyphHeight = 5;
constexpr int kPad = 2;
constexpr int kMaxCell = 64;
constexpr Rgb kBackground = {255, 255, 255};
constexpr Rgb kInk = {51, 51, 51};
constexpr Rgb kNaN = {255, 0, 255};

// Digits 0-9 in a 3x5 pixel font: five rows a glyph, the three low bits of
// each row its pixels, most significant bit leftmost.
constexpr uint8_t kDigitGlyphs[10][kGlyphHeight] = {
    {7, 5, 5, 5, 7}, {2, 6, 2, 2, 7}, {7, 1, 7, 4, 7}, {7, 1, 7, 1, 7},
    {5, 5, 7, 1, 1}, {7, 4, 7, 1, 7}, {7, 4, 7, 5, 7}, {7, 1, 1, 1, 1},
    {7, 5, 7, 5, 7}, {7, 5, 7, 1, 7}};

// matplotlib's viridis at 0, 1/8, ..., 1.
constexpr Rgb kViridis[9] = {{68, 1, 84},    {71, 45, 123},  {59, 82, 139},
                             {44, 114, 142}, {33, 145, 140}, {40, 174, 128},
                             {94, 201, 98},  {173, 220, 48}, {253, 231, 37}};

// Width in pixels of the decimal label of `index`: 3 per digit, 1 between.
int LabelWidth(int64_t index) {
  return static_cast<int>(absl::StrCat(index).size()) * (kGlyphWidth + 1) - 1;
}

// The least of 1, 2, 5, 10, 20, 50, ... whose multiple of `cell` is at least
// `min_pixels`.
int64_t TickStep(int cell, int min_pixels) {
  for (int64_t decade = 1;; decade *= 10) {
    for (int64_t factor : {1, 2, 5}) {
      if (decade * factor * cell >= min_pixels) return decade * factor;
    }
  }
}

// Draws `index` in the pixel font with its top-left corner at (x, y).
void DrawLabel(int64_t index, int x, int y, RgbImage& image) {
  for (char digit : absl::StrCat(index)) {
    const uint8_t* glyph = kDigitGlyphs[digit - '0'];
    for (int row = 0; row < kGlyphHeight; ++row) {
      for (int column = 0; column < kGlyphWidth; ++column) {
        if (glyph[row] & (4 >> column)) image.Set(x + column, y + row, kInk);
      }
    }
    x += kGlyphWidth + 1;
  }
}

// Left edge of column `column`'s label: centred on the cell if it fits.
int ColumnLabelX(const HeatmapLayout& layout, int64_t column) {
  return layout.left + static_cast<int>(column) * layout.cell +
         std::max(0, (layout.cell - LabelWidth(column)) / 2);
}

// Top edge of row `row`'s label: centred on the cell if it fits.
int RowLabelY(const HeatmapLayout& layout, int64_t row) {
  return layout.top + static_cast<int>(row) * layout.cell +
         std::max(0, (layout.cell - kGlyphHeight) / 2);
}

std::string HexColour(Rgb colour) {
  return absl::StrFormat("#%02x%02x%02x", colour.red, colour.green,
                         colour.blue);
}

}  // namespace

absl::StatusOr<HeatmapLayout> LayoutHeatmap(int64_t rows, int64_t columns,
                                            int cell) {
  if (rows <= 0 || columns <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the grid is ", rows, " x ", columns, ", expected at least 1 x 1"));
  }
  if (cell < 1 || cell > kMaxCell) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cell is ", cell, ", expected 1 to ", kMaxCell));
  }
  if (rows > kMaxHeatmapSide / cell || columns > kMaxHeatmapSide / cell) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a ", rows, " x ", columns, " grid of ", cell, "-pixel cells is over ",
        kMaxHeatmapSide,
        " pixels on a side; use a smaller --cell or fewer tokens"));
  }
  HeatmapLayout layout;
  layout.rows = rows;
  layout.columns = columns;
  layout.cell = cell;
  const int row_label_width = LabelWidth(rows - 1);
  const int column_label_width = LabelWidth(columns - 1);
  layout.left = kPad + row_label_width + kPad;
  layout.top = kPad + kGlyphHeight + kPad;
  const int right = kPad + std::max(0, column_label_width - cell);
  const int bottom = kPad + std::max(0, kGlyphHeight - cell);
  layout.width = layout.left + static_cast<int>(columns) * cell + right;
  layout.height = layout.top + static_cast<int>(rows) * cell + bottom;
  // The labels' margins count too: the image, not only its cells, is bounded.
  if (layout.width > kMaxHeatmapSide || layout.height > kMaxHeatmapSide) {
    return absl::InvalidArgumentError(
        absl::StrCat("a ", rows, " x ", columns, " grid of ", cell,
                     "-pixel cells with its labels is ", layout.width, " x ",
                     layout.height, " pixels, over ", kMaxHeatmapSide,
                     " on a side; use a smaller --cell or fewer tokens"));
  }
  layout.row_step = TickStep(cell, kGlyphHeight + 1);
  layout.column_step = TickStep(cell, column_label_width + 2);
  return layout;
}

Rgb ViridisColour(double fraction) {
  const double position = std::clamp(fraction, 0.0, 1.0) * 8.0;
  const int segment = std::min(7, static_cast<int>(position));
  const double t = position - segment;
  const Rgb& from = kViridis[segment];
  const Rgb& to = kViridis[segment + 1];
  const auto mix = [t](uint8_t a, uint8_t b) {
    return static_cast<uint8_t>(std::lround(a + (b - a) * t));
  };
  return {mix(from.red, to.red), mix(from.green, to.green),
          mix(from.blue, to.blue)};
}

Rgb CellColour(float value, float max_value) {
  if (std::isnan(value)) return kNaN;
  return ViridisColour(max_value > 0.0f ? value / max_value : 0.0);
}

float GridMax(const AttentionGrid& grid) {
  float max_value = 0.0f;
  for (float value : grid.values) {
    if (std::isfinite(value)) max_value = std::max(max_value, value);
  }
  return max_value;
}

RgbImage RenderHeatmapImage(const AttentionGrid& grid,
                            const HeatmapLayout& layout) {
  RgbImage image(layout.width, layout.height, kBackground);
  const float max_value = GridMax(grid);
  for (int64_t row = 0; row < grid.rows; ++row) {
    for (int64_t column = 0; column < grid.columns; ++column) {
      image.FillRect(
          layout.left + static_cast<int>(column) * layout.cell,
          layout.top + static_cast<int>(row) * layout.cell, layout.cell,
          layout.cell,
          CellColour(grid.values[row * grid.columns + column], max_value));
    }
  }
  for (int64_t row = 0; row < grid.rows; row += layout.row_step) {
    DrawLabel(row, layout.left - kPad - LabelWidth(row), RowLabelY(layout, row),
              image);
  }
  for (int64_t column = 0; column < grid.columns;
       column += layout.column_step) {
    DrawLabel(column, ColumnLabelX(layout, column), kPad, image);
  }
  return image;
}

absl::StatusOr<std::string> RenderHeatmapSvg(const AttentionGrid& grid,
                                             const HeatmapLayout& layout) {
  if (grid.rows * grid.columns > kMaxSvgCells) {
    return absl::InvalidArgumentError(
        absl::StrCat("a ", grid.rows, " x ", grid.columns, " grid is over ",
                     kMaxSvgCells, " cells for SVG; write a PNG instead"));
  }
  std::string svg = absl::StrFormat(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "viewBox=\"0 0 %d %d\">\n"
      "<rect width=\"%d\" height=\"%d\" fill=\"%s\"/>\n"
      "<g shape-rendering=\"crispEdges\">\n",
      layout.width, layout.height, layout.width, layout.height, layout.width,
      layout.height, HexColour(kBackground));
  const float max_value = GridMax(grid);
  for (int64_t row = 0; row < grid.rows; ++row) {
    for (int64_t column = 0; column < grid.columns; ++column) {
      const float value = grid.values[row * grid.columns + column];
      absl::StrAppendFormat(
          &svg,
          "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"%s\">"
          "<title>query %d, key %d: %g</title></rect>\n",
          layout.left + column * layout.cell, layout.top + row * layout.cell,
          layout.cell, layout.cell, HexColour(CellColour(value, max_value)),
          row, column, value);
    }
  }
  absl::StrAppendFormat(&svg,
                        "</g>\n<g font-family=\"monospace\" font-size=\"7\" "
                        "fill=\"%s\">\n",
                        HexColour(kInk));
  for (int64_t row = 0; row < grid.rows; row += layout.row_step) {
    absl::StrAppendFormat(
        &svg, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%d</text>\n",
        layout.left - kPad, RowLabelY(layout, row) + kGlyphHeight, row);
  }
  for (int64_t column = 0; column < grid.columns;
       column += layout.column_step) {
    absl::StrAppendFormat(&svg, "<text x=\"%d\" y=\"%d\">%d</text>\n",
                          ColumnLabelX(layout, column), kPad + kGlyphHeight,
                          column);
  }
  svg += "</g>\n</svg>\n";
  return svg;
}

}  // namespace attnserve
