// A PNG encoder for 8-bit RGB images that needs no zlib: the image data goes
// into the zlib stream as stored (uncompressed) deflate blocks, with the
// CRC-32 and Adler-32 checksums computed here.
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

// CRC-32 as PNG and zlib use it (ISO-HDLC: reflected polynomial 0xEDB88320,
// initial value and final XOR 0xFFFFFFFF), continuing from `crc` (0 to start).
uint32_t Crc32(absl::string_view bytes, uint32_t crc = 0);

// Adler-32 (RFC 1950) of `bytes`, continuing from `adler` (1 to start).
uint32_t Adler32(absl::string_view bytes, uint32_t adler = 1);

// The zlib stream (RFC 1950) holding `bytes` in stored deflate blocks
// (RFC 1951, BTYPE 00) of at most 65535 bytes each.
std::string ZlibStored(absl::string_view bytes);

// The bytes of a PNG file holding `image`: signature, IHDR (8-bit RGB, no
// interlace), one IDAT with filter type 0 on every scanline, IEND.
std::string EncodePng(const RgbImage& image);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTNCTL_PNG_H_
