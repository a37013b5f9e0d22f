// Images decoded straight into a batch: a JPEG or PNG member is decoded, cropped
// and resized by the reader's own threads into its place in the batch buffer,
// with no Python and no GIL. Only the part of the image the crop needs is
// decoded: JPEGs at 1/2, 1/4 or 1/8 scale in the DCT when the crop is at least
// that many times the output, and only the crop's rows and columns.
//
// Built without libjpeg or libpng, supported() is false and decode_into throws.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "stoker/io/decoder.hpp"

namespace stoker::image {

enum class Crop : uint8_t {
  kRandom = 0,  // a random area and aspect ratio (RandomResizedCrop's rules), resized
  kCenter = 1,  // the shorter side resized to size / 0.875, the centre cut out
  kNone = 2,    // the whole image resized to the output size
};

// Images larger than this are refused before anything is allocated for them: a
// tiny file can declare a huge size (a decompression bomb).
constexpr uint64_t kMaxPixels = 178956970;
// A compressed member that claims to inflate to more than this is refused unread.
constexpr uint64_t kMaxEncodedBytes = uint64_t(1) << 30;

// What a field's images become: every sample is height x width x 3 uint8.
struct Target {
  uint32_t height = 224;
  uint32_t width = 224;
  Crop crop = Crop::kRandom;
  double scale_min = 0.08, scale_max = 1.0;             // kRandom: fraction of the area
  double ratio_min = 3.0 / 4.0, ratio_max = 4.0 / 3.0;  // kRandom: width / height
  bool flip = false;                                    // a horizontal flip with probability 1/2
  bool channels_last = false;                           // (H, W, 3) per sample; else (3, H, W)
  bool blank_on_error = false;       // a member that does not decode is zeros, not an error
  uint64_t max_pixels = kMaxPixels;  // larger images are refused, unread
  uint64_t nbytes() const { return uint64_t(height) * width * 3; }
};

// The part of the source image that becomes the output, in source pixels.
struct Box {
  double x0 = 0, y0 = 0, x1 = 0, y1 = 0;
  bool flip = false;
};

// Whether this build can decode (it found libjpeg and libpng).
bool supported();

// A sample's crop seed, from its epoch's seed and its index alone.
uint64_t sample_seed(uint64_t epoch_seed, uint64_t sample);

// The crop of a `width` x `height` image: a pure function of the target and `seed`,
// so the same seed gives the same pixels on any thread.
Box choose_box(uint32_t width, uint32_t height, const Target& target, uint64_t seed);

// Decodes the image in `src` into `dest` (target.nbytes() bytes). Throws
// FormatError naming `path` and `offset` for bytes that are not a JPEG or PNG
// image this decoder reads, and before any large allocation for a size over
// kMaxPixels.
void decode_into(const uint8_t* src, uint64_t size, const Target& target, uint64_t seed,
                 uint8_t* dest, const std::string& path, uint64_t offset);

// The codes of an image member as stored, and deflated (a zip's).
constexpr io::Codec kImage{4};
constexpr io::Codec kDeflateImage{5};

// Registers both codes with the reader (their requests bring their field's
// decoder); again does nothing.
void register_decoders();

// The reader's decoder of a field's images: each member decoded into `target`,
// its crop seeded by the request's seed.
std::shared_ptr<const io::FieldDecoder> field_decoder(std::shared_ptr<const Target> target);

// A whole image decoded to RGB, rows of width * 3 bytes (for re-encoding and for
// the decode benchmark's ceiling).
struct Rgb {
  uint32_t width = 0, height = 0;
  std::vector<uint8_t> pixels;
};
Rgb decode_rgb(const uint8_t* src, uint64_t size, const std::string& path, uint64_t offset,
               uint64_t max_pixels = kMaxPixels);

// `image` resized (antialiased) to `width` x `height`.
Rgb resize_rgb(const Rgb& image, uint32_t width, uint32_t height);

// RGB pixels as a baseline JPEG of `quality` (1-100), 4:2:0.
std::vector<uint8_t> encode_jpeg(const Rgb& image, int quality);

}  // namespace stoker::image
