#include "png.h"

// libpng's header, not this directory's png.h: angle brackets search only the
// include path, where client/attnctl is not.
#include <png.h>
#include <zlib.h>

#include <algorithm>
#include <csetjmp>
#include <cstddef>

namespace attnserve {
namespace {

// libpng's write callback: appends to the std::string behind the io pointer.
void AppendToString(png_structp png, png_bytep data, png_size_t length) {
  static_cast<std::string*>(png_get_io_ptr(png))
      ->append(reinterpret_cast<const char*>(data), length);
}

// libpng's flush callback: nothing to flush in memory.
void FlushNothing(png_structp) {}

// Writes `image` through `png` and `info` into `out`; false if libpng failed.
// libpng reports failure by longjmp back to the setjmp here, so nothing in this
// function owns anything with a destructor.
bool WritePng(png_structp png, png_infop info, const RgbImage& image,
              std::string* out) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_set_write_fn(png, out, AppendToString, FlushNothing);
  png_set_IHDR(png, info, static_cast<png_uint_32>(image.width()),
               static_cast<png_uint_32>(image.height()), 8, PNG_COLOR_TYPE_RGB,
               PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  // Filter type 0 on every scanline, stored deflate blocks.
  png_set_filter(png, PNG_FILTER_TYPE_BASE, PNG_FILTER_NONE);
  png_set_compression_level(png, Z_NO_COMPRESSION);
  png_write_info(png, info);
  for (int y = 0; y < image.height(); ++y) png_write_row(png, image.Row(y));
  png_write_end(png, nullptr);
  return true;
}

}  // namespace

RgbImage::RgbImage(int width, int height, Rgb background)
    : width_(width),
      height_(height),
      pixels_(static_cast<size_t>(width) * static_cast<size_t>(height) * 3) {
  FillRect(0, 0, width, height, background);
}

Rgb RgbImage::Get(int x, int y) const {
  const size_t at = (static_cast<size_t>(y) * width_ + x) * 3;
  return {pixels_[at], pixels_[at + 1], pixels_[at + 2]};
}

const uint8_t* RgbImage::Row(int y) const {
  return pixels_.data() + static_cast<size_t>(y) * width_ * 3;
}

void RgbImage::Set(int x, int y, Rgb colour) {
  if (x < 0 || y < 0 || x >= width_ || y >= height_) return;
  const size_t at = (static_cast<size_t>(y) * width_ + x) * 3;
  pixels_[at] = colour.red;
  pixels_[at + 1] = colour.green;
  pixels_[at + 2] = colour.blue;
}

void RgbImage::FillRect(int x, int y, int width, int height, Rgb colour) {
  const int x_end = std::min(width_, x + width);
  const int y_end = std::min(height_, y + height);
  for (int row = std::max(0, y); row < y_end; ++row) {
    for (int column = std::max(0, x); column < x_end; ++column) {
      Set(column, row, colour);
    }
  }
}

uint32_t Crc32(absl::string_view bytes, uint32_t crc) {
  return static_cast<uint32_t>(
      crc32_z(crc, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size()));
}

uint32_t Adler32(absl::string_view bytes, uint32_t adler) {
  return static_cast<uint32_t>(adler32_z(
      adler, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size()));
}

std::string ZlibStored(absl::string_view bytes) {
  uLongf length = compressBound(bytes.size());
  std::string out(length, '\0');
  // compressBound leaves room enough: only running out of memory fails.
  const int status = compress2(reinterpret_cast<Bytef*>(out.data()), &length,
                               reinterpret_cast<const Bytef*>(bytes.data()),
                               bytes.size(), Z_NO_COMPRESSION);
  if (status != Z_OK) return std::string();
  out.resize(length);
  return out;
}

std::string EncodePng(const RgbImage& image) {
  std::string out;
  png_structp png =
      png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  if (png == nullptr) return out;
  png_infop info = png_create_info_struct(png);
  const bool written = info != nullptr && WritePng(png, info, image, &out);
  png_destroy_write_struct(&png, &info);
  if (!written) out.clear();
  return out;
}

}  // namespace attnserve
