// The PNG writer's checksums and stream framing against published values, and
// the heatmap's documented layout and colours.
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "attnctl/heatmap.h"
#include "attnctl/png.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

uint32_t BigEndian32(const std::string& bytes, size_t at) {
  return static_cast<uint32_t>(static_cast<uint8_t>(bytes[at])) << 24 |
         static_cast<uint32_t>(static_cast<uint8_t>(bytes[at + 1])) << 16 |
         static_cast<uint32_t>(static_cast<uint8_t>(bytes[at + 2])) << 8 |
         static_cast<uint32_t>(static_cast<uint8_t>(bytes[at + 3]));
}

TEST(Crc32Test, MatchesTheCheckValueOfCrc32IsoHdlc) {
  EXPECT_EQ(Crc32("123456789"), 0xCBF43926u);
  EXPECT_EQ(Crc32(""), 0u);
  EXPECT_EQ(Crc32("IEND"), 0xAE426082u);  // Every PNG's last four bytes.
}

TEST(Crc32Test, ContinuesAcrossPieces) {
  EXPECT_EQ(Crc32("6789", Crc32("12345")), Crc32("123456789"));
}

TEST(Adler32Test, MatchesPublishedValues) {
  EXPECT_EQ(Adler32("Wikipedia"), 0x11E60398u);
  EXPECT_EQ(Adler32(""), 1u);
}

TEST(Adler32Test, StaysExactPastTheOverflowBlock) {
  const std::string bytes(100000, '\xff');
  uint32_t a = 1, b = 0;  // The definition, one byte at a time.
  for (char byte : bytes) {
    a = (a + static_cast<uint8_t>(byte)) % 65521;
    b = (b + a) % 65521;
  }
  EXPECT_EQ(Adler32(bytes), (b << 16) | a);
}

TEST(ZlibStoredTest, EmptyInputIsOneFinalEmptyBlock) {
  EXPECT_EQ(ZlibStored(""),
            std::string("\x78\x01\x01\x00\x00\xff\xff\x00\x00\x00\x01", 11));
}

TEST(ZlibStoredTest, SplitsIntoBlocksOfAtMost65535Bytes) {
  const std::string bytes(70000, 'a');
  const std::string stream = ZlibStored(bytes);
  ASSERT_EQ(stream.size(), 2 + 5 + 65535 + 5 + (70000 - 65535) + 4);
  EXPECT_EQ(stream.substr(2, 5), std::string("\x00\xff\xff\x00\x00", 5));
  const size_t second = 2 + 5 + 65535;
  const uint16_t length = 70000 - 65535;
  EXPECT_EQ(stream[second], '\x01');  // BFINAL.
  EXPECT_EQ(static_cast<uint8_t>(stream[second + 1]), length & 0xff);
  EXPECT_EQ(static_cast<uint8_t>(stream[second + 2]), length >> 8);
  EXPECT_EQ(static_cast<uint8_t>(stream[second + 3]), (~length) & 0xff);
  EXPECT_EQ(BigEndian32(stream, stream.size() - 4), Adler32(bytes));
}

TEST(EncodePngTest, WritesSignatureHeaderAndChecksummedChunks) {
  RgbImage image(3, 2, {10, 20, 30});
  image.Set(2, 1, {255, 0, 0});
  const std::string png = EncodePng(image);
  ASSERT_GT(png.size(), 8u + 25 + 12 + 12);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_EQ(BigEndian32(png, 8), 13u);
  EXPECT_EQ(png.substr(12, 4), "IHDR");
  EXPECT_EQ(BigEndian32(png, 16), 3u);  // Width.
  EXPECT_EQ(BigEndian32(png, 20), 2u);  // Height.
  EXPECT_EQ(png.substr(24, 5), std::string("\x08\x02\x00\x00\x00", 5));
  EXPECT_EQ(BigEndian32(png, 29), Crc32(png.substr(12, 17)));
  const uint32_t idat_length = BigEndian32(png, 33);
  EXPECT_EQ(png.substr(37, 4), "IDAT");
  // Two scanlines of 1 + 3 * 3 bytes, stored: 2 + 5 + 20 + 4.
  EXPECT_EQ(idat_length, 31u);
  const std::string stream = png.substr(41, idat_length);
  EXPECT_EQ(stream.substr(7, 10), std::string("\x00\x0a\x14\x1e\x0a\x14\x1e"
                                              "\x0a\x14\x1e",
                                              10));
  EXPECT_EQ(stream.substr(24, 3), std::string("\xff\x00\x00", 3));
  EXPECT_EQ(png.substr(png.size() - 12),
            std::string("\x00\x00\x00\x00IEND\xae\x42\x60\x82", 12));
}

TEST(RgbImageTest, ClipsDrawingAtTheEdges) {
  RgbImage image(4, 4);
  image.FillRect(-2, 2, 10, 10, {1, 2, 3});
  image.Set(-1, 0, {9, 9, 9});
  image.Set(4, 0, {9, 9, 9});
  EXPECT_EQ(image.Get(0, 2).red, 1);
  EXPECT_EQ(image.Get(3, 3).blue, 3);
  EXPECT_EQ(image.Get(0, 1).red, 255);
}

TEST(LayoutHeatmapTest, FollowsTheDocumentedFormula) {
  struct Case {
    int64_t rows, columns;
    int cell;
    int left, top, width, height;
    int64_t row_step, column_step;
  };
  // left = 2 + wr + 2, top = 9, right = 2 + max(0, wc - cell),
  // bottom = 2 + max(0, 5 - cell); a label of n digits is 4n - 1 wide.
  const Case cases[] = {
      {12, 12, 8, 11, 9, 11 + 96 + 2, 9 + 96 + 2, 1, 2},
      {1, 1, 8, 7, 9, 7 + 8 + 2, 9 + 8 + 2, 1, 1},
      {40, 150, 4, 11, 9, 11 + 600 + 2 + 7, 9 + 160 + 2 + 1, 2, 5},
      {1000, 3, 1, 15, 9, 15 + 3 + 2 + 2, 9 + 1000 + 2 + 4, 10, 5},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message()
                 << c.rows << " x " << c.columns << " @ " << c.cell);
    absl::StatusOr<HeatmapLayout> layout =
        LayoutHeatmap(c.rows, c.columns, c.cell);
    ASSERT_TRUE(layout.ok()) << layout.status();
    EXPECT_EQ(layout->left, c.left);
    EXPECT_EQ(layout->top, c.top);
    EXPECT_EQ(layout->width, c.width);
    EXPECT_EQ(layout->height, c.height);
    EXPECT_EQ(layout->row_step, c.row_step);
    EXPECT_EQ(layout->column_step, c.column_step);
  }
}

TEST(LayoutHeatmapTest, RefusesEmptyGridsBadCellsAndHugeImages) {
  EXPECT_FALSE(LayoutHeatmap(0, 4, 8).ok());
  EXPECT_FALSE(LayoutHeatmap(4, 4, 0).ok());
  EXPECT_FALSE(LayoutHeatmap(4, 4, 65).ok());
  EXPECT_FALSE(LayoutHeatmap(4, 2049, 8).ok());
  // The labels' margins count: 2,048 cells of 8 pixels fill the side alone
  // (a 16412-pixel image was written, 2026-12-06).
  EXPECT_FALSE(LayoutHeatmap(4, 2048, 8).ok());
  EXPECT_FALSE(LayoutHeatmap(2048, 4, 8).ok());
  const absl::StatusOr<HeatmapLayout> widest = LayoutHeatmap(2040, 2040, 8);
  ASSERT_TRUE(widest.ok()) << widest.status();
  EXPECT_LE(widest->width, kMaxHeatmapSide);
  EXPECT_LE(widest->height, kMaxHeatmapSide);
}

TEST(ViridisColourTest, RunsFromPurpleToYellowThroughTheAnchors) {
  const Rgb low = ViridisColour(0.0), middle = ViridisColour(0.5),
            high = ViridisColour(1.0), clamped = ViridisColour(7.0);
  EXPECT_EQ((std::array<int, 3>{low.red, low.green, low.blue}),
            (std::array<int, 3>{68, 1, 84}));
  EXPECT_EQ((std::array<int, 3>{middle.red, middle.green, middle.blue}),
            (std::array<int, 3>{33, 145, 140}));
  EXPECT_EQ((std::array<int, 3>{high.red, high.green, high.blue}),
            (std::array<int, 3>{253, 231, 37}));
  EXPECT_EQ(clamped.red, high.red);
  // Halfway between the 0 and 1/8 anchors.
  EXPECT_EQ(ViridisColour(1.0 / 16).green, 23);
}

TEST(CellColourTest, ScalesToTheMaximumAndMarksNaN) {
  EXPECT_EQ(CellColour(0.25f, 0.25f).red, 253);
  EXPECT_EQ(CellColour(0.0f, 0.25f).red, 68);
  EXPECT_EQ(CellColour(0.5f, 0.0f).red, 68);
  const Rgb nan = CellColour(std::numeric_limits<float>::quiet_NaN(), 1.0f);
  EXPECT_EQ((std::array<int, 3>{nan.red, nan.green, nan.blue}),
            (std::array<int, 3>{255, 0, 255}));
}

TEST(RenderHeatmapImageTest, PutsQueriesDownKeysAcrossAndLabelsTheAxes) {
  AttentionGrid grid{2, 3, {0.0f, 0.0f, 1.0f, 0.5f, 0.0f, 0.0f}};
  absl::StatusOr<HeatmapLayout> layout = LayoutHeatmap(2, 3, 6);
  ASSERT_TRUE(layout.ok());
  const RgbImage image = RenderHeatmapImage(grid, *layout);
  ASSERT_EQ(image.width(), layout->width);
  // Query 0, key 2 holds the maximum; query 1, key 0 half of it.
  EXPECT_EQ(image.Get(layout->left + 2 * 6 + 3, layout->top + 3).red, 253);
  EXPECT_EQ(image.Get(layout->left + 3, layout->top + 6 + 3).green, 145);
  EXPECT_EQ(image.Get(layout->left + 3, layout->top + 3).red, 68);
  // The '0' of row 0: its top row is three pixels of ink.
  for (int dx = 0; dx < 3; ++dx) {
    EXPECT_EQ(image.Get(layout->left - 5 + dx, layout->top).red, 51);
  }
}

TEST(RenderHeatmapSvgTest, HasOneTitledRectPerCellAndTextLabels) {
  AttentionGrid grid{2, 2, {0.25f, 0.75f, 1.0f, 0.0f}};
  absl::StatusOr<HeatmapLayout> layout = LayoutHeatmap(2, 2, 8);
  ASSERT_TRUE(layout.ok());
  absl::StatusOr<std::string> svg = RenderHeatmapSvg(grid, *layout);
  ASSERT_TRUE(svg.ok());
  size_t titles = 0;
  for (size_t at = svg->find("<title>"); at != std::string::npos;
       at = svg->find("<title>", at + 1)) {
    ++titles;
  }
  EXPECT_EQ(titles, 4u);
  EXPECT_NE(svg->find("<title>query 0, key 1: 0.75</title>"),
            std::string::npos);
  EXPECT_NE(svg->find("text-anchor=\"end\">1</text>"), std::string::npos);
  EXPECT_NE(svg->find("#fde725"), std::string::npos);

  AttentionGrid big{1024, 1024, std::vector<float>(1024 * 1024)};
  absl::StatusOr<HeatmapLayout> big_layout = LayoutHeatmap(1024, 1024, 1);
  ASSERT_TRUE(big_layout.ok());
  EXPECT_FALSE(RenderHeatmapSvg(big, *big_layout).ok());
}

}  // namespace
}  // namespace attnserve
