// Where the rows of an array source (an HDF5 dataset, a Zarr array) lie: its
// shape, its chunk grid, each chunk's bytes and the filters that encode them.
// Learnt once at open (by Python: h5py for HDF5, the JSON for Zarr); reads
// then need no HDF5 or Zarr library at all.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace stoker::io {

// One step of a chunk's filter pipeline, in the order the writer applied them;
// a reader undoes them last to first.
enum class ChunkFilter : uint8_t {
  kZlib = 0,        // deflate with a zlib header (HDF5 deflate, Zarr zlib)
  kGzip = 1,        // deflate with a gzip header (Zarr gzip)
  kZstd = 2,        // a Zstandard frame (libzstd, opened at run time)
  kBlosc = 3,       // a c-blosc 1.x buffer (libblosc, opened at run time)
  kShuffle = 4,     // HDF5's byte shuffle; param: the element size
  kFletcher32 = 5,  // HDF5's Fletcher-32 checksum, 4 bytes after the data
  kCrc32c = 6,      // Zarr's crc32c codec, 4 bytes after the data
};

struct ChunkStep {
  ChunkFilter filter;
  uint32_t param = 0;
};

// A missing chunk (never written) reads as the fill value.
constexpr uint64_t kMissingChunk = UINT64_MAX;

struct ArrayLayout {
  uint64_t id = 0;   // unique in this process (next_layout_id): decoded chunks are cached by it
  std::string name;  // "data.h5:/images", for messages
  std::vector<uint64_t> shape;        // axis 0: rows (samples)
  std::vector<uint64_t> chunk_shape;  // same rank; edge chunks are stored whole
  uint32_t itemsize = 1;
  // The axis order a decoded chunk's bytes are in, outermost first (Zarr's
  // order "F" or transpose codec); empty: C order.
  std::vector<uint32_t> order;
  bool byteswap = false;      // stored big-endian: swapped after decoding
  std::vector<uint8_t> fill;  // one element, native byte order
  std::vector<ChunkStep> steps;
  std::vector<std::string> paths;  // the files the chunks are in
  // Per chunk, in C order over the chunk grid:
  std::vector<uint32_t> chunk_file;    // into paths
  std::vector<uint64_t> chunk_offset;  // kMissingChunk: not written
  std::vector<uint64_t> chunk_size;    // stored bytes
  std::vector<uint32_t> chunk_mask;    // bit i set: steps[i] was skipped (HDF5)

  uint64_t row_elements() const {
    uint64_t n = 1;
    for (size_t d = 1; d < shape.size(); ++d) n *= shape[d];
    return n;
  }
  uint64_t row_bytes() const { return row_elements() * itemsize; }
  uint64_t chunk_elements() const {
    uint64_t n = 1;
    for (uint64_t c : chunk_shape) n *= c;
    return n;
  }
  uint64_t chunk_bytes() const { return chunk_elements() * itemsize; }
  uint64_t grid(size_t d) const { return (shape[d] + chunk_shape[d] - 1) / chunk_shape[d]; }
  // Chunks per row: the product of the grid over axes 1..
  uint64_t chunks_per_row() const {
    uint64_t n = 1;
    for (size_t d = 1; d < shape.size(); ++d) n *= grid(d);
    return n;
  }
  uint64_t num_chunks() const { return shape.empty() ? 0 : grid(0) * chunks_per_row(); }

  // Checks the layout is whole and consistent; throws Error naming it.
  void check() const;
};

uint64_t next_layout_id();

}  // namespace stoker::io
