// PNG through libpng, read from memory. libpng, like libjpeg, reports errors
// with a longjmp; the same rule holds: nothing with a destructor lives in the
// frames the jump crosses.
#ifdef STOKER_HAVE_IMAGE

#include <png.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "stoker/image/codec.hpp"

namespace stoker::image::detail {

namespace {

struct Source {
  const uint8_t* data;
  uint64_t left;
  char message[200];
};

void read_bytes(png_structp png, png_bytep out, png_size_t length) {
  auto* source = static_cast<Source*>(png_get_io_ptr(png));
  if (length > source->left)
    png_error(png, "the data ends before the image does (a truncated PNG)");
  std::memcpy(out, source->data, length);
  source->data += length;
  source->left -= length;
}

void on_error(png_structp png, png_const_charp message) {
  auto* source = static_cast<Source*>(png_get_error_ptr(png));
  std::snprintf(source->message, sizeof source->message, "%s", message);
  png_longjmp(png, 1);
}

void on_warning(png_structp, png_const_charp) {}

}  // namespace

std::string decode_png(const uint8_t* src, uint64_t size, const ChooseRegion& choose,
                       Window& window) {
  Source source{src, size, {0}};
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &source, on_error, on_warning);
  if (!png) return "out of memory";
  png_infop info = png_create_info_struct(png);
  // Rows of a whole interlaced image, or one row: thread storage, so the jump
  // leaves nothing of this frame half-updated.
  thread_local std::vector<uint8_t> rows;
  thread_local std::vector<png_bytep> row_pointers;
  if (!info || setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, info ? &info : nullptr, nullptr);
    return source.message[0] ? source.message : "out of memory";
  }
  png_set_read_fn(png, &source, read_bytes);
  png_read_info(png, info);
  const uint32_t width = png_get_image_width(png, info);
  const uint32_t height = png_get_image_height(png, info);
  window.width = width;
  window.height = height;
  window.scale_x = window.scale_y = 1;
  Region region;
  try {
    region = choose(width, height);
  } catch (...) {
    png_destroy_read_struct(&png, &info, nullptr);
    throw;
  }
  // Every kind of PNG to 8-bit RGB: palettes and small greys expanded, 16 bits
  // cut to their high byte, alpha dropped, grey copied to all three channels.
  png_set_palette_to_rgb(png);
  png_set_expand_gray_1_2_4_to_8(png);
  png_set_strip_16(png);
  png_set_strip_alpha(png);
  png_set_gray_to_rgb(png);
  const int passes = png_set_interlace_handling(png);
  png_read_update_info(png, info);
  if (png_get_channels(png, info) != 3 || png_get_rowbytes(png, info) != size_t(width) * 3) {
    png_destroy_read_struct(&png, &info, nullptr);
    return "a PNG whose pixels do not expand to 8-bit RGB";
  }
  const size_t stride = size_t(width) * 3;
  const uint32_t x0 = std::min(region.x0, width), x1 = std::min(std::max(region.x1, x0 + 1), width);
  const uint32_t y0 = std::min(region.y0, height),
                 y1 = std::min(std::max(region.y1, y0 + 1), height);
  window.x0 = x0;
  window.y0 = y0;
  window.cols = x1 - x0;
  window.rows = y1 - y0;
  try {
    window.pixels.resize(size_t(window.cols) * window.rows * 3);
    // An interlaced image is only complete after its last pass: it is decoded whole.
    rows.resize(passes > 1 ? stride * height : stride);
    row_pointers.resize(passes > 1 ? height : 0);
  } catch (...) {
    png_destroy_read_struct(&png, &info, nullptr);
    throw;
  }
  if (passes > 1) {
    for (uint32_t r = 0; r < height; ++r) row_pointers[r] = rows.data() + r * stride;
    png_read_image(png, row_pointers.data());
    for (uint32_t r = y0; r < y1; ++r) {
      std::memcpy(window.pixels.data() + size_t(r - y0) * window.cols * 3,
                  rows.data() + r * stride + size_t(x0) * 3, size_t(window.cols) * 3);
    }
  } else {
    // Rows up to the region's last; the rest of the image is never inflated.
    for (uint32_t r = 0; r < y1; ++r) {
      png_read_row(png, rows.data(), nullptr);
      if (r >= y0) {
        std::memcpy(window.pixels.data() + size_t(r - y0) * window.cols * 3,
                    rows.data() + size_t(x0) * 3, size_t(window.cols) * 3);
      }
    }
  }
  png_destroy_read_struct(&png, &info, nullptr);
  give_back_if_large(rows);
  give_back_if_large(row_pointers);
  return {};
}

}  // namespace stoker::image::detail

#endif  // STOKER_HAVE_IMAGE
