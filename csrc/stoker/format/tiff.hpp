// TIFF and BigTIFF image directories (IFDs), read without libtiff: where each
// tile or strip of every image lies, and what a decoder needs to know about it,
// so that patches of tiled TIFFs and pyramidal whole-slide images (.svs,
// tifffile's SubIFD pyramids) are read as byte ranges like any other sample.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace stoker::format {

// Values are as the file stores them, widened to 64 bits (BigTIFF allows
// LONG8 for any of them), with the TIFF defaults where a tag is absent.
struct TiffDirectory {
  uint64_t offset = 0;  // of the IFD in the file
  bool big_endian = false;
  bool big_tiff = false;
  uint64_t width = 0;                        // ImageWidth (256)
  uint64_t length = 0;                       // ImageLength (257)
  uint64_t tile_width = 0;                   // TileWidth (322); 0 when stripped
  uint64_t tile_length = 0;                  // TileLength (323); 0 when stripped
  uint64_t rows_per_strip = 0;               // RowsPerStrip (278); default: length
  uint64_t samples_per_pixel = 1;            // 277
  std::vector<uint64_t> bits_per_sample{1};  // 258, one value per sample as stored
  uint64_t sample_format = 1;                // 339
  uint64_t compression = 1;                  // 259
  std::optional<uint64_t> photometric;       // 262: required by TIFF, missing in some files
  uint64_t planar_config = 1;                // 284: 1 contiguous, 2 separate planes
  uint64_t predictor = 1;                    // 317
  uint64_t new_subfile_type = 0;             // 254
  std::vector<uint8_t> jpeg_tables;          // 347
  uint64_t ycbcr_subsampling[2] = {2, 2};    // 530
  std::string description;                   // 270, up to its first NUL
  // TileOffsets/TileByteCounts (324/325) or StripOffsets/StripByteCounts
  // (273/279): one per tile (strip), row by row, each plane after the other
  // when planar_config is 2. Every range lies inside the file.
  std::vector<uint64_t> offsets;
  std::vector<uint64_t> byte_counts;
  std::vector<TiffDirectory> sub_directories;  // SubIFDs (330)

  bool tiled() const { return tile_width != 0; }
};

// Fills dest with `length` bytes at `offset` of the source, or throws. The
// parser asks only for ranges inside the `file_size` it was given.
using TiffRead = std::function<void(uint8_t* dest, uint64_t length, uint64_t offset)>;

// The main IFD chain in order, each with its SubIFDs. Throws FormatError
// naming `path` and the offending byte for anything it cannot trust; it reads
// only directories and their values, never image data, and allocates no more
// than a small multiple of `file_size`.
std::vector<TiffDirectory> parse_tiff(const TiffRead& read, uint64_t file_size,
                                      const std::string& path);
std::vector<TiffDirectory> read_tiff(const std::string& path);

// How many tiles (strips) the directory's image needs: its grid, times the
// samples per pixel for separate planes. Throws FormatError if that overflows.
uint64_t tiff_chunk_count(const TiffDirectory& d, const std::string& path);

}  // namespace stoker::format
