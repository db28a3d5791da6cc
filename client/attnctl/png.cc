#include "png.h"

#include <algorithm>
#include <array>
#include <cstddef>

namespace attnserve {
namespace {

// The 256-entry table of the byte-at-a-time CRC-32, built once.
const std::array<uint32_t, 256>& CrcTable() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> entries{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int bit = 0; bit < 8; ++bit) {
        c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      }
      entries[n] = c;
    }
    return entries;
  }();
  return table;
}

void AppendBigEndian32(uint32_t value, std::string* out) {
  out->push_back(static_cast<char>(value >> 24));
  out->push_back(static_cast<char>(value >> 16));
  out->push_back(static_cast<char>(value >> 8));
  out->push_back(static_cast<char>(value));
}

// Appends a PNG chunk: length, type, data, CRC-32 of type and data.
void AppendChunk(absl::string_view type, absl::string_view data,
                 std::string* out) {
  AppendBigEndian32(static_cast<uint32_t>(data.size()), out);
  const size_t type_start = out->size();
  out->append(type.data(), type.size());
  out->append(data.data(), data.size());
  AppendBigEndian32(Crc32(absl::string_view(out->data() + type_start,
                                            type.size() + data.size())),
                    out);
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
  const std::array<uint32_t, 256>& table = CrcTable();
  uint32_t c = crc ^ 0xFFFFFFFFu;
  for (char byte : bytes) {
    c = table[(c ^ static_cast<uint8_t>(byte)) & 0xFF] ^ (c >> 8);
  }
  return c ^ 0xFFFFFFFFu;
}

uint32_t Adler32(absl::string_view bytes, uint32_t adler) {
  constexpr uint32_t kModulus = 65521;
  // 5552 is the most bytes whose sums cannot overflow 32 bits before the
  // modulus is taken (zlib's NMAX).
  constexpr size_t kBlock = 5552;
  uint32_t a = adler & 0xFFFF, b = adler >> 16;
  for (size_t start = 0; start < bytes.size(); start += kBlock) {
    const size_t end = std::min(bytes.size(), start + kBlock);
    for (size_t i = start; i < end; ++i) {
      a += static_cast<uint8_t>(bytes[i]);
      b += a;
    }
    a %= kModulus;
    b %= kModulus;
  }
  return (b << 16) | a;
}

std::string ZlibStored(absl::string_view bytes) {
  constexpr size_t kMaxStoredBlock = 65535;
  std::string out;
  out.reserve(bytes.size() + bytes.size() / kMaxStoredBlock * 5 + 11);
  // CMF 0x78: deflate, 32 KiB window; FLG 0x01: no dictionary, fastest
  // level, and (CMF * 256 + FLG) % 31 == 0.
  out.push_back('\x78');
  out.push_back('\x01');
  size_t start = 0;
  do {
    const size_t length = std::min(kMaxStoredBlock, bytes.size() - start);
    const bool final_block = start + length == bytes.size();
    out.push_back(final_block ? '\x01' : '\x00');  // BFINAL, BTYPE 00.
    out.push_back(static_cast<char>(length & 0xFF));
    out.push_back(static_cast<char>(length >> 8));
    out.push_back(static_cast<char>(~length & 0xFF));
    out.push_back(static_cast<char>((~length >> 8) & 0xFF));
    out.append(bytes.data() + start, length);
    start += length;
  } while (start < bytes.size());
  AppendBigEndian32(Adler32(bytes), &out);
  return out;
}

std::string EncodePng(const RgbImage& image) {
  std::string header;
  AppendBigEndian32(static_cast<uint32_t>(image.width()), &header);
  AppendBigEndian32(static_cast<uint32_t>(image.height()), &header);
  // Bit depth 8, colour type 2 (RGB), compression 0, filter 0, no interlace.
  header.append({'\x08', '\x02', '\x00', '\x00', '\x00'});

  std::string scanlines;
  scanlines.reserve(static_cast<size_t>(image.height()) *
                    (1 + static_cast<size_t>(image.width()) * 3));
  for (int y = 0; y < image.height(); ++y) {
    scanlines.push_back('\x00');  // Filter type None.
    for (int x = 0; x < image.width(); ++x) {
      const Rgb pixel = image.Get(x, y);
      scanlines.push_back(static_cast<char>(pixel.red));
      scanlines.push_back(static_cast<char>(pixel.green));
      scanlines.push_back(static_cast<char>(pixel.blue));
    }
  }

  std::string png("\x89PNG\r\n\x1a\n", 8);
  AppendChunk("IHDR", header, &png);
  AppendChunk("IDAT", ZlibStored(scanlines), &png);
  AppendChunk("IEND", "", &png);
  return png;
}

}  // namespace attnserve
