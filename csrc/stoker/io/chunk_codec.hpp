// Undoing an array chunk's filter pipeline (array_layout.hpp): inflate with
// zlib (linked), Zstandard and Blosc with libzstd and libblosc (opened with
// dlopen on first use, so neither is needed to build or to import), HDF5's
// shuffle and checksums, Zarr's crc32c.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "stoker/io/array_layout.hpp"

namespace stoker::io {

// Decodes a stored chunk of `layout` (`size` bytes at `src`, which it may
// overwrite) into its `layout.chunk_bytes()` decoded bytes, skipping the steps
// `mask` marks. Returns where they are: `src` itself or one of the two
// scratch buffers. `path`, `offset` and `where` (the chunk's coordinates)
// name the chunk in errors, which are FormatErrors.
uint8_t* decode_chunk(const ArrayLayout& layout, uint32_t mask, uint8_t* src, uint64_t size,
                      std::vector<uint8_t>& scratch_a, std::vector<uint8_t>& scratch_b,
                      const std::string& path, uint64_t offset, const std::string& where);

// Decompresses `n` bytes of zlib, gzip or zstd data into exactly `size` bytes at
// `dest`; anything else (corrupt data, another size) is a FormatError at `path`,
// `offset`. zstd needs libzstd, found at run time.
void decompress_exact(ChunkFilter filter, const uint8_t* src, uint64_t n, uint8_t* dest,
                      uint64_t size, const std::string& path, uint64_t offset);

// Folders searched for libzstd and libblosc before the loader's default path
// (Python passes the folder where the `blosc` distribution put its libblosc).
// Takes effect for a library not yet found.
void set_codec_search_dirs(std::vector<std::string> dirs);

// The file the library for `filter` was loaded from ("" for a filter that needs
// none, or whose library cannot be found).
std::string codec_library(ChunkFilter filter);

// "" when the library for `filter` can be used, else why not (what to install).
std::string codec_unavailable(ChunkFilter filter);

const char* filter_name(ChunkFilter filter);

}  // namespace stoker::io
