// Undoing an array chunk's filter pipeline (array_layout.hpp): inflate with
// zlib (linked), Zstandard, Blosc, Snappy and LZ4 with their libraries (opened with
// dlopen on first use, so none is needed to build or to import), HDF5's
// shuffle and checksums, Zarr's crc32c. Parquet pages use the same decompressors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "stoker/io/array_layout.hpp"

namespace stoker::image::detail {
struct EntropyMarks;
}  // namespace stoker::image::detail

namespace stoker::io {

// A part of a JPEG tile's rows and columns, all a caller will copy out of it: only
// that part is decoded (the rest of the chunk is left as it was).
struct ChunkRegion {
  uint32_t row0 = 0, row1 = UINT32_MAX, col0 = 0, col1 = UINT32_MAX;
  bool holds(const ChunkRegion& o) const {
    return row0 <= o.row0 && o.row1 <= row1 && col0 <= o.col0 && o.col1 <= col1;
  }
};

// The smallest region holding both.
inline ChunkRegion covering(const ChunkRegion& a, const ChunkRegion& b) {
  return {std::min(a.row0, b.row0), std::max(a.row1, b.row1), std::min(a.col0, b.col0),
          std::max(a.col1, b.col1)};
}

// Decodes a stored chunk of `layout` (`size` bytes at `src`, which it may
// overwrite) into exactly `want` decoded bytes (layout.decoded_bytes), skipping the steps
// `mask` marks. Returns where they are: `src` itself, one of the two scratch
// buffers or, when given, `into` (`want` bytes, where the last step to run writes
// its output: a buffer the caller keeps, saving a copy). `path`, `offset` and `where`
// (the chunk's coordinates) name the chunk in errors, which are FormatErrors. `marks`:
// a JPEG tile's entropy marks, used and added to (image::detail::decode_jpeg_tile).
uint8_t* decode_chunk(const ArrayLayout& layout, uint32_t mask, uint8_t* src, uint64_t size,
                      uint64_t want, std::vector<uint8_t>& scratch_a,
                      std::vector<uint8_t>& scratch_b, const std::string& path, uint64_t offset,
                      const std::string& where, const ChunkRegion& region = {},
                      uint8_t* into = nullptr, image::detail::EntropyMarks* marks = nullptr);

// Decompresses `n` bytes of zlib, gzip, zstd, snappy or raw lz4 data into exactly
// `size` bytes at `dest`; anything else (corrupt data, another size) is a FormatError at
// `path`, `offset`. zstd and lz4 need libzstd and liblz4, found at run time; snappy
// needs no library.
void decompress_exact(ChunkFilter filter, const uint8_t* src, uint64_t n, uint8_t* dest,
                      uint64_t size, const std::string& path, uint64_t offset);

// Folders searched for libzstd, libblosc and liblz4 before the loader's
// default path (Python passes the folder where the `blosc` distribution put its libblosc).
// Takes effect for a library not yet found.
void set_codec_search_dirs(std::vector<std::string> dirs);

// The file the library for `filter` was loaded from ("" for a filter that needs
// none, or whose library cannot be found).
std::string codec_library(ChunkFilter filter);

// "" when the library for `filter` can be used, else why not (what to install).
std::string codec_unavailable(ChunkFilter filter);

const char* filter_name(ChunkFilter filter);

}  // namespace stoker::io
