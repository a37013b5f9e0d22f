#include <algorithm>
#include <cmath>
#include <cstring>

#include "stoker/errors.hpp"
#include "stoker/image/codec.hpp"
#include "stoker/image/image.hpp"

namespace stoker::image {

namespace {

// A counter-based stream of random numbers (splitmix64): each sample's draws
// depend on its seed alone, never on which thread decodes it or when.
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

// splitmix64's finaliser: every bit of `z` spread over every bit of the result.
uint64_t scramble(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

struct Random {
  uint64_t state;
  uint64_t next() { return scramble(state += kGolden); }
  double uniform(double lo, double hi) { return lo + (hi - lo) * ((next() >> 11) * 0x1.0p-53); }
  // An integer in [0, n).
  uint64_t below(uint64_t n) { return n ? next() % n : 0; }
};

enum class Format { kJpeg, kPng, kOther };

Format sniff(const uint8_t* src, uint64_t size) {
  static constexpr uint8_t kPngSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (size >= 3 && src[0] == 0xff && src[1] == 0xd8 && src[2] == 0xff) return Format::kJpeg;
  if (size >= 8 && std::memcmp(src, kPngSignature, 8) == 0) return Format::kPng;
  return Format::kOther;
}

std::string first_bytes(const uint8_t* src, uint64_t size) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (uint64_t i = 0; i < std::min<uint64_t>(size, 8); ++i) {
    if (i) out += ' ';
    out += kHex[src[i] >> 4];
    out += kHex[src[i] & 15];
  }
  return out;
}

[[noreturn]] void unsupported() {
  throw Error(
      "this build of stoker was made without libjpeg-turbo and libpng, so it cannot decode "
      "images: install their development files (Debian: apt-get install libjpeg62-turbo-dev "
      "libpng-dev; Ubuntu: libjpeg-turbo8-dev libpng-dev) and reinstall stoker");
}

// Decodes the part of `src` that `choose` asks for, or throws FormatError.
void decode_window(const uint8_t* src, uint64_t size, const detail::ChooseRegion& choose,
                   detail::Window& window, const std::string& path, uint64_t offset,
                   uint64_t max_pixels) {
  if (!supported()) unsupported();
  if (size == 0) throw FormatError(path, offset, "an empty member is not an image");
  Format format = sniff(src, size);
  if (format == Format::kOther) {
    throw FormatError(path, offset,
                      "not a JPEG or PNG image (it starts with " + first_bytes(src, size) + ")");
  }
  auto checked = [&](uint32_t width, uint32_t height) {
    if (width == 0 || height == 0) throw FormatError(path, offset, "an image of no pixels");
    if (uint64_t(width) * height > max_pixels) {
      throw FormatError(path, offset,
                        "an image of " + std::to_string(width) + " x " + std::to_string(height) +
                            " pixels, more than the " + std::to_string(max_pixels) +
                            " allowed (a corrupt header, or a decompression bomb)");
    }
    return choose(width, height);
  };
  std::string problem = format == Format::kJpeg ? detail::decode_jpeg(src, size, checked, window)
                                                : detail::decode_png(src, size, checked, window);
  if (!problem.empty()) {
    throw FormatError(path, offset, (format == Format::kJpeg ? "JPEG: " : "PNG: ") + problem);
  }
}

}  // namespace

#ifdef STOKER_HAVE_IMAGE
bool supported() { return true; }
#else
bool supported() { return false; }
namespace detail {
std::string decode_jpeg(const uint8_t*, uint64_t, const ChooseRegion&, Window&) { unsupported(); }
std::string decode_png(const uint8_t*, uint64_t, const ChooseRegion&, Window&) { unsupported(); }
std::string decode_jpeg_tile(const uint8_t*, uint64_t, const uint8_t*, uint64_t, bool,
                             const TileCheck&, uint8_t*, const TileRegion&, EntropyMarks*) {
  unsupported();
}
bool entropy_marks_work() { return false; }
uint64_t entropy_mcus_stepped_over() { return 0; }
uint64_t entropy_mcus_skimmed() { return 0; }
bool allow_entropy_skim(bool) { return false; }
std::string encode_jpeg(const uint8_t*, uint32_t, uint32_t, int, std::vector<uint8_t>&) {
  unsupported();
}
}  // namespace detail
#endif

uint64_t sample_seed(uint64_t epoch_seed, uint64_t sample) {
  return scramble(epoch_seed ^ scramble(sample + kGolden));
}

Box choose_box(uint32_t width, uint32_t height, const Target& target, uint64_t seed) {
  Random random{seed};
  Box box{0, 0, double(width), double(height), false};
  const double w = width, h = height;
  if (target.crop == Crop::kRandom) {
    // RandomResizedCrop's rules: ten tries at an area and a log-uniform aspect
    // ratio that fit, then the whole image cut to the nearest allowed ratio.
    const double area = w * h;
    const double log_lo = std::log(target.ratio_min), log_hi = std::log(target.ratio_max);
    bool found = false;
    for (int attempt = 0; attempt < 10 && !found; ++attempt) {
      double target_area = area * random.uniform(target.scale_min, target.scale_max);
      double aspect = std::exp(random.uniform(log_lo, log_hi));
      double cw = std::round(std::sqrt(target_area * aspect));
      double ch = std::round(std::sqrt(target_area / aspect));
      if (cw > 0 && cw <= w && ch > 0 && ch <= h) {
        double top = double(random.below(uint64_t(h - ch) + 1));
        double left = double(random.below(uint64_t(w - cw) + 1));
        box = {left, top, left + cw, top + ch, false};
        found = true;
      }
    }
    if (!found) {
      double cw = w, ch = h;
      if (w / h < target.ratio_min) {
        ch = std::round(cw / target.ratio_min);
      } else if (w / h > target.ratio_max) {
        cw = std::round(ch * target.ratio_max);
      }
      double top = std::floor((h - ch) / 2), left = std::floor((w - cw) / 2);
      box = {left, top, left + cw, top + ch, false};
    }
  } else if (target.crop == Crop::kCenter) {
    // The shorter side to size / 0.875 (224 -> 256), then the centre: one
    // resampling of the box that those two steps would keep.
    double shorter = std::floor(std::min(target.height, target.width) / 0.875);
    double factor = std::max({shorter / std::min(w, h), target.width / w, target.height / h});
    double cw = target.width / factor, ch = target.height / factor;
    double left = (w - cw) / 2, top = (h - ch) / 2;
    box = {left, top, left + cw, top + ch, false};
  }
  if (target.flip) box.flip = (random.next() >> 63) != 0;
  return box;
}

void decode_into(const uint8_t* src, uint64_t size, const Target& target, uint64_t seed,
                 uint8_t* dest, const std::string& path, uint64_t offset) {
  thread_local detail::Window window;
  Box box;
  auto choose = [&](uint32_t width, uint32_t height) {
    box = choose_box(width, height, target, seed);
    // Shrink in the DCT by the largest of 2, 4 and 8 that keeps the box at least
    // the output's size, and decode only the box and the filter's reach around it.
    double bw = box.x1 - box.x0, bh = box.y1 - box.y0;
    uint32_t eighths = 8;
    while (eighths > 1 && bw * eighths / 16 >= target.width && bh * eighths / 16 >= target.height) {
      eighths /= 2;
    }
    // The filter reaches about one output pixel's worth of source past the box;
    // a decoded pixel of a shrunk JPEG covers 8 / eighths source pixels.
    double slack = 2.0 * 8 / eighths;
    double reach_x = std::ceil(std::max(bw / target.width, 1.0)) + slack;
    double reach_y = std::ceil(std::max(bh / target.height, 1.0)) + slack;
    detail::Region region;
    region.x0 = uint32_t(std::max(0.0, std::floor(box.x0 - reach_x)));
    region.y0 = uint32_t(std::max(0.0, std::floor(box.y0 - reach_y)));
    region.x1 = uint32_t(std::min(double(width), std::ceil(box.x1 + reach_x)));
    region.y1 = uint32_t(std::min(double(height), std::ceil(box.y1 + reach_y)));
    region.eighths = eighths;
    return region;
  };
  decode_window(src, size, choose, window, path, offset, target.max_pixels);
  // The box in the window's pixels (the window may be decoded at a smaller scale).
  const double fx = window.scale_x, fy = window.scale_y;
  detail::resample(window.pixels.data(), window.cols, window.rows, box.x0 * fx - window.x0,
                   box.y0 * fy - window.y0, box.x1 * fx - window.x0, box.y1 * fy - window.y0,
                   target.width, target.height, box.flip, target.channels_last, dest);
  detail::give_back_if_large(window.pixels);
}

Rgb decode_rgb(const uint8_t* src, uint64_t size, const std::string& path, uint64_t offset,
               uint64_t max_pixels) {
  detail::Window window;
  auto whole = [](uint32_t width, uint32_t height) {
    return detail::Region{0, 0, width, height, 8};
  };
  decode_window(src, size, whole, window, path, offset, max_pixels);
  return Rgb{window.cols, window.rows, std::move(window.pixels)};
}

Rgb resize_rgb(const Rgb& image, uint32_t width, uint32_t height) {
  Rgb out{width, height, std::vector<uint8_t>(size_t(width) * height * 3)};
  detail::resample(image.pixels.data(), image.width, image.height, 0, 0, image.width, image.height,
                   width, height, false, true, out.pixels.data());
  return out;
}

std::vector<uint8_t> encode_jpeg(const Rgb& image, int quality) {
  std::vector<uint8_t> out;
  std::string problem =
      detail::encode_jpeg(image.pixels.data(), image.width, image.height, quality, out);
  if (!problem.empty()) throw Error("JPEG encoding failed: " + problem);
  return out;
}

}  // namespace stoker::image
