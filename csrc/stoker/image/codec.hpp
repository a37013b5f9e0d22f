// The decoders behind decode_into: each reads an image's header, asks which part
// of it is needed, and decodes just that part (a window) into RGB rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "stoker/io/byte_vector.hpp"

namespace stoker::image::detail {

// The part of the source image to decode, in source pixels: [x0, x1) x [y0, y1).
// `eighths`: the scale the decoder may decode at, in eighths: 8, 4, 2 or 1 (a
// JPEG is shrunk that much in the DCT; libjpeg-turbo's SIMD covers those scales).
struct Region {
  uint32_t x0 = 0, y0 = 0, x1 = 0, y1 = 0;
  uint32_t eighths = 8;
};

// Given the source's width and height, the region to decode. Called once, after
// the header is read and before any pixel is decoded.
using ChooseRegion = std::function<Region(uint32_t width, uint32_t height)>;

// Decoded pixels: rows [y0, y0 + rows) and columns [x0, x0 + cols) of the image
// as decoded (scale_x and scale_y decoded pixels to a source pixel), RGB, rows of
// cols * 3 bytes.
struct Window {
  uint32_t x0 = 0, y0 = 0, cols = 0, rows = 0;
  uint32_t width = 0, height = 0;  // the source's size
  double scale_x = 1, scale_y = 1;
  std::vector<uint8_t> pixels;
};

// What one decoder may allocate for a single image besides its output window.
constexpr long kMaxDecoderMemory = 512L << 20;

// Thread-local buffers are given back once a large image made them grow past this.
constexpr size_t kKeepBytes = 16u << 20;

template <typename T>
void give_back_if_large(std::vector<T>& buffer) {
  io::give_back_if_larger(buffer, kKeepBytes);
}

// Each returns an empty string on success, else what is wrong with the bytes.
std::string decode_jpeg(const uint8_t* src, uint64_t size, const ChooseRegion& choose,
                        Window& window);
std::string decode_png(const uint8_t* src, uint64_t size, const ChooseRegion& choose,
                       Window& window);

// Whether a JPEG tile of that size is the one the caller expects: an empty string,
// else what is wrong with it. Asked after the header is read, before any pixel is
// decoded, so that `dest` is never written past.
using TileCheck = std::function<std::string(uint32_t width, uint32_t height, uint32_t components)>;

// A TIFF tile (or strip) that is one JPEG stream, decoded whole into `dest` as
// rows of width * components bytes: grey (one component) or RGB (three). The
// stream may be abbreviated (tables left out): `tables` (TIFF's JPEGTables, may
// be empty) are loaded first. `rgb`: three components are RGB as stored (Aperio's
// photometric 2), not YCbCr to convert. Empty string on success.
// The rows [row0, row1) and columns [col0, col1) of a tile a caller needs; the
// default: all of it.
struct TileRegion {
  uint32_t row0 = 0, row1 = UINT32_MAX, col0 = 0, col1 = UINT32_MAX;
};

// libjpeg-turbo writes a row that starts on a 16-byte boundary around the cache (see
// read_rows in jpeg.cpp). Rows a caller means to read back soon go into a buffer that
// starts this far past a cache line: kSkewedRoom bytes more than the rows take.
constexpr size_t kSkewedRoom = 64 + 8;
inline uint8_t* skewed_start(uint8_t* buffer) {
  const auto base = reinterpret_cast<uintptr_t>(buffer);
  return buffer + (64 - base % 64) % 64 + 8;
}

// Where libjpeg's Huffman decoder stood at the start of each MCU of one JPEG tile, as
// decodes of the tile passed them. A tile written without restart markers can only be
// entropy-decoded from its start: a later decode restores the mark before the first MCU
// it needs instead, and steps over the MCUs of the columns it crops away, which it
// decodes otherwise only to get past them. 24 bytes an MCU: 6 KiB a 256² 4:2:0 tile.
struct EntropyMarks {
  static constexpr uint32_t kUnset = UINT32_MAX;
  struct Mark {
    uint64_t bits = 0;          // the bit buffer
    uint32_t offset = kUnset;   // bytes of the tile consumed
    uint8_t bits_left = 0;      // of the bit buffer's bits, not yet used
    uint8_t unread_marker = 0;  // a marker the decoder has read up to
    int16_t dc[3] = {0, 0, 0};  // each component's last DC coefficient
  };
  std::vector<Mark> marks;  // one an MCU, in the stream's order; empty: none recorded
  size_t bytes() const { return marks.capacity() * sizeof(Mark); }
};

// Whether marks work with the libjpeg this process loaded: checked once, by decoding a
// small JPEG of stoker's own both ways (the marks read libjpeg-turbo's decoder state,
// which its API does not expose). Where they do not, they are never used.
bool entropy_marks_work();

// MCUs that decodes have stepped over by restoring marks, in this process.
uint64_t entropy_mcus_stepped_over();

// MCUs that decodes have skimmed with stoker's own entropy decoder (those between a mark
// and the first MCU a decode uses), in this process.
uint64_t entropy_mcus_skimmed();

// Whether decodes may skim (they do unless told otherwise: a test compares decodes made
// without it); returns what it was.
bool allow_entropy_skim(bool allowed);

// `region`: only that part of dest is written (with the same values as a whole decode):
// rows past it are never decoded and, with libjpeg-turbo's cropping and skipping, the
// columns and rows before it are not transformed. `marks`, when given, are used and
// added to (the MCUs this decode passed), for a tile that is a baseline JPEG without
// restart markers of at most three components. With them, a decode also stops after the
// last MCU it uses, not at the end of its MCU row: whether a tile cut short fails depends
// on where the part ends, never on what was decoded of the tile before (a restored mark
// puts the decoder exactly where a decode from the start would be; stoker's skim decoder,
// used only on tiles whose entropy data is plain, at the same bit position).
std::string decode_jpeg_tile(const uint8_t* tables, uint64_t tables_size, const uint8_t* src,
                             uint64_t size, bool rgb, const TileCheck& check, uint8_t* dest,
                             const TileRegion& region = {}, EntropyMarks* marks = nullptr);

// A JPEG of RGB rows; empty string on success.
std::string encode_jpeg(const uint8_t* rgb, uint32_t width, uint32_t height, int quality,
                        std::vector<uint8_t>& out);

// Antialiased resampling (a triangle filter widened by the scale factor when
// shrinking) of the box [x0, x1) x [y0, y1) of `src` (cols x rows RGB, rows of
// cols * 3 bytes) to out_width x out_height, mirrored when `flip`, written as
// (H, W, 3) when `channels_last`, else as (3, H, W).
void resample(const uint8_t* src, uint32_t cols, uint32_t rows, double x0, double y0, double x1,
              double y1, uint32_t out_width, uint32_t out_height, bool flip, bool channels_last,
              uint8_t* dest);

}  // namespace stoker::image::detail
