// JPEG through libjpeg-turbo's libjpeg API. libjpeg reports errors by calling
// error_exit, which must not return: it longjmps back here. The functions that
// setjmp hold only C objects across the libjpeg calls, so nothing with a
// destructor is skipped by the jump.
#ifdef STOKER_HAVE_IMAGE

#include <algorithm>
#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
// clang-format off
#include <jpeglib.h>
#include <jerror.h>
// clang-format on

#include "stoker/image/codec.hpp"

namespace stoker::image::detail {

namespace {

struct ErrorManager {
  jpeg_error_mgr base;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  bool truncated;
};

[[noreturn]] void on_error(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

// Warnings are not printed. Running out of data is an error for us (libjpeg
// would pad the image with grey); corrupt entropy data that libjpeg can step
// over is tolerated, as the usual decoders tolerate it.
void on_message(j_common_ptr cinfo, int level) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) err->truncated = true;
}

void install(jpeg_error_mgr& base) {
  jpeg_std_error(&base);
  base.error_exit = on_error;
  base.emit_message = on_message;
}

// Inverted CMYK (Adobe's, which is what libjpeg hands back for Adobe files) or
// plain CMYK, to RGB: each channel is scaled by the black's complement.
void cmyk_to_rgb(const uint8_t* in, uint8_t* out, uint32_t count, bool inverted) {
  for (uint32_t i = 0; i < count; ++i, in += 4, out += 3) {
    uint32_t c = in[0], m = in[1], y = in[2], k = in[3];
    if (!inverted) {
      c = 255 - c;
      m = 255 - m;
      y = 255 - y;
      k = 255 - k;
    }
    out[0] = static_cast<uint8_t>((c * k + 127) / 255);
    out[1] = static_cast<uint8_t>((m * k + 127) / 255);
    out[2] = static_cast<uint8_t>((y * k + 127) / 255);
  }
}

}  // namespace

std::string decode_jpeg(const uint8_t* src, uint64_t size, const ChooseRegion& choose,
                        Window& window) {
  jpeg_decompress_struct cinfo;
  ErrorManager err;
  std::memset(&err, 0, sizeof err);
  install(err.base);
  cinfo.err = &err.base;
  // Nothing of automatic storage that the jump could leave half-updated is used
  // after it: the CMYK row lives in thread storage, the window is the caller's.
  thread_local std::vector<uint8_t> cmyk_row;
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    return err.message;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, src, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  window.width = cinfo.image_width;
  window.height = cinfo.image_height;
  Region region;
  try {
    region = choose(cinfo.image_width, cinfo.image_height);
  } catch (...) {
    jpeg_destroy_decompress(&cinfo);
    throw;
  }
  const bool cmyk = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
  cinfo.out_color_space = cmyk ? JCS_CMYK : JCS_RGB;
  cinfo.scale_num = region.eighths;
  cinfo.scale_denom = 8;
  cinfo.dct_method = JDCT_ISLOW;
  jpeg_start_decompress(&cinfo);
  window.scaled_width = cinfo.output_width;
  window.scaled_height = cinfo.output_height;
  // The region at the decoded scale, widened to whole pixels.
  auto scaled = [&](uint32_t v) { return JDIMENSION(uint64_t(v) * region.eighths / 8); };
  auto scaled_up = [&](uint32_t v) { return JDIMENSION((uint64_t(v) * region.eighths + 7) / 8); };
  JDIMENSION x0 = scaled(region.x0);
  JDIMENSION x1 = std::min<JDIMENSION>(scaled_up(region.x1), cinfo.output_width);
  JDIMENSION y0 = scaled(region.y0);
  JDIMENSION y1 = std::min<JDIMENSION>(scaled_up(region.y1), cinfo.output_height);
  if (x1 <= x0) x1 = std::min<JDIMENSION>(x0 + 1, cinfo.output_width);
  if (y1 <= y0) y1 = std::min<JDIMENSION>(y0 + 1, cinfo.output_height);
  JDIMENSION crop_x = x0, crop_width = x1 - x0;
  if (crop_width < cinfo.output_width) {
    // Moves crop_x down to an iMCU boundary and widens crop_width to match.
    jpeg_crop_scanline(&cinfo, &crop_x, &crop_width);
  }
  const JDIMENSION cols = cinfo.output_width;  // after cropping: the window's width
  window.x0 = crop_x;
  window.y0 = y0;
  window.cols = cols;
  window.rows = y1 - y0;
  window.pixels.resize(size_t(cols) * window.rows * 3);
  if (cmyk) cmyk_row.resize(size_t(cols) * 4);
  if (y0 > 0) jpeg_skip_scanlines(&cinfo, y0);
  for (JDIMENSION r = 0; r < window.rows; ++r) {
    uint8_t* out = window.pixels.data() + size_t(r) * cols * 3;
    JSAMPROW row = cmyk ? cmyk_row.data() : out;
    if (jpeg_read_scanlines(&cinfo, &row, 1) != 1) {
      std::snprintf(err.message, sizeof err.message, "decoding stopped at row %u",
                    unsigned(y0 + r));
      jpeg_destroy_decompress(&cinfo);
      return err.message;
    }
    if (cmyk) cmyk_to_rgb(cmyk_row.data(), out, cols, cinfo.saw_Adobe_marker);
  }
  // The rows below the region are never decoded.
  jpeg_abort_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  if (err.truncated) return "the data ends before the image does (a truncated JPEG)";
  return {};
}

std::string encode_jpeg(const uint8_t* rgb, uint32_t width, uint32_t height, int quality,
                        std::vector<uint8_t>& out) {
  jpeg_compress_struct cinfo;
  ErrorManager err;
  std::memset(&err, 0, sizeof err);
  install(err.base);
  cinfo.err = &err.base;
  unsigned char* buffer = nullptr;
  unsigned long length = 0;
  if (setjmp(err.jump)) {
    jpeg_destroy_compress(&cinfo);
    std::free(buffer);
    return err.message;
  }
  jpeg_create_compress(&cinfo);
  jpeg_mem_dest(&cinfo, &buffer, &length);
  cinfo.image_width = width;
  cinfo.image_height = height;
  cinfo.input_components = 3;
  cinfo.in_color_space = JCS_RGB;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < height) {
    JSAMPROW row = const_cast<uint8_t*>(rgb) + size_t(cinfo.next_scanline) * width * 3;
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  out.assign(buffer, buffer + length);
  jpeg_destroy_compress(&cinfo);
  std::free(buffer);
  return {};
}

}  // namespace stoker::image::detail

#endif  // STOKER_HAVE_IMAGE
