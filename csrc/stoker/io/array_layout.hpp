// Where the elements of a chunked array (an HDF5 dataset, a Zarr array, the
// tiles of a TIFF image) lie: its shape, its chunk grid, each chunk's bytes and
// the filters that encode them. Learnt once at open (by Python: h5py for HDF5,
// the JSON for Zarr, the directory for TIFF); reads then need no HDF5, Zarr or
// TIFF library at all.
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
  // A TIFF tile (or strip) that is one JPEG stream (TIFF compression 7), its tables
  // perhaps only in ArrayLayout::jpeg_tables; it decodes to the chunk's uint8
  // (rows, columns, samples). param: kJpegYCbCr or kJpegRgb, the colour space stored.
  kJpeg = 7,
  // TIFF's horizontal differencing (predictor 2): each sample was stored as its
  // difference from the same sample of the pixel before it in its row, a row being
  // the chunk's last two axes (columns, then a pixel's samples: a tile of planes has
  // a last axis of 1). param: the element's bytes (1, 2, 4 or 8).
  kHorizontalPredictor = 8,
  // Parquet's page codecs: a raw snappy buffer (decoded by stoker itself) and a raw LZ4
  // block (LZ4_RAW, liblz4, opened at run time).
  kSnappy = 9,
  kLz4Raw = 10,
};

// kJpeg's params. YCbCr (photometric 6) is converted to RGB, as any JPEG decoder
// does; RGB (photometric 2, as Aperio writes) is left as it is stored, where a
// decoder left to guess would take it for YCbCr.
constexpr uint32_t kJpegYCbCr = 0;
constexpr uint32_t kJpegRgb = 1;

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
  bool byteswap = false;  // stored big-endian: swapped after decoding
  // The last chunks along axis 0 are stored clipped to the array, holding only its
  // rows (TIFF's last strip), where other formats store edge chunks whole. Needs C order.
  bool clipped_edge = false;
  std::vector<uint8_t> fill;  // one element, native byte order
  std::vector<ChunkStep> steps;
  // The JPEG tables a kJpeg step's abbreviated streams leave out (TIFF's tag 347):
  // loaded before each chunk is decoded. Empty: each stream is whole.
  std::vector<uint8_t> jpeg_tables;
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
  // The bytes chunk `c` decodes to: chunk_bytes(), or fewer for a clipped edge's.
  uint64_t decoded_bytes(uint64_t c) const {
    if (!clipped_edge || c / chunks_per_row() + 1 < grid(0)) return chunk_bytes();
    return (shape[0] - (grid(0) - 1) * chunk_shape[0]) * (chunk_bytes() / chunk_shape[0]);
  }
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

// A box of an array (a Codec::kArrayBox request): [start, start + extent) along
// each axis, inside the array (the caller clips a box at the edge and fills the
// padding itself). Element (i0, i1, ...) of the box lands at the request's
// dest_offset + sum(i_d * dest_strides[d]) bytes: the strides of the caller's
// patch buffer, which need not be C order.
struct ArrayBox {
  std::vector<uint64_t> start, extent, dest_strides;
};

uint64_t next_layout_id();

}  // namespace stoker::io
