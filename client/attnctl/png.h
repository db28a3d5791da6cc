// 8-bit RGB images, and their PNG encoding through libpng. The image data is
// stored uncompressed (zlib level 0, no scanline filter): a heatmap is small,
// and every byte of the file stays predictable for the tests. The checksums
// and zlib framing the file carries come from zlib.
//
//   RgbImage image(640, 480);
//   image.Set(10, 20, {255, 0, 0});
//   std::string png = EncodePng(image);
//
// Everything here is thread-compatible: distinct objects may be used from
// distinct threads.
#ifndef ATTNSERVE_CLIENT_ATTNCTL_PNG_H_
#define ATTNSERVE_CLIENT_ATTNCTL_PNG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace attnserve {

struct Rgb {
  uint8_t red = 0;
  uint8_t green = 0;
  uint8_t blue = 0;
};

// A width x height image of 8-bit RGB pixels, row 0 at the top.
class RgbImage {
 public:
  // An image filled with `background`. Both dimensions must be positive.
  RgbImage(int width, int height, Rgb background = {255, 255, 255});

  int width() const { return width_; }
  int height() const { return height_; }

  // The pixel at column x, row y; both in range.
  Rgb Get(int x, int y) const;
  // Row y (in range) as width() * 3 bytes, red, green, blue.
  const uint8_t* Row(int y) const;
  // Sets the pixel at column x, row y; does nothing outside the image, so
  // callers may draw shapes that cross its edges.
  void Set(int x, int y, Rgb colour);
  // Fills the rectangle of `width` x `height` pixels whose top-left corner is
  // (x, y), clipped to the image.
  void FillRect(int x, int y, int width, int height, Rgb colour);

 private:
  int width_;
  int height_;
  std::vector<uint8_t> pixels_;  // Row-major, 3 bytes a pixel.
};

// zlib's CRC-32, as PNG chunks carry it (ISO-HDLC: reflected polynomial
// 0xEDB88320, initial value and final XOR 0xFFFFFFFF), continuing from `crc`
// (0 to start).
uint32_t Crc32(absl::string_view bytes, uint32_t crc = 0);

// zlib's Adler-32 (RFC 1950) of `bytes`, continuing from `adler` (1 to start).
uint32_t Adler32(absl::string_view bytes, uint32_t adler = 1);

// The zlib stream (RFC 1950) holding `bytes` in stored deflate blocks
// (RFC 1951, BTYPE 00) of at most 65535 bytes each: zlib at level 0, as the
// IDAT chunks of EncodePng hold the scanlines. Empty if zlib runs out of
// memory.
std::string ZlibStored(absl::string_view bytes);

// The bytes of a PNG file holding `image`, written by libpng: signature, IHDR
// (8-bit RGB, no interlace), IDAT chunks holding the scanlines with filter
// type 0 in stored deflate blocks, IEND. Empty if libpng fails (it reports
// why on stderr), which only running out of memory can make it do.
std::string EncodePng(const RgbImage& image);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTNCTL_PNG_H_
