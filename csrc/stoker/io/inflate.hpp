#pragma once

#include <zlib.h>

#include <cstdint>
#include <string>
#include <vector>

#include "stoker/io/posix_file.hpp"

namespace stoker::io {

// What surrounds the deflate stream: nothing (a zip member), a zlib header and
// Adler-32 (HDF5's deflate filter, Zarr's zlib), or gzip's header and CRC-32
// (Zarr's gzip, .nii.gz; several members one after another are one stream).
enum class Wrapper : uint8_t { kRaw, kZlib, kGzip };

// Inflates a deflate stream into exactly `dest_length` bytes. A stream that
// would produce more (a decompression bomb, or a lying header) stops at the
// limit and is refused, so memory stays bounded by what the index says.
// `path` and `offset` only name the member in errors.
void inflate_exact(const uint8_t* src, uint64_t src_length, uint8_t* dest, uint64_t dest_length,
                   const std::string& path, uint64_t offset, Wrapper wrapper = Wrapper::kRaw);

uint32_t crc32_of(const uint8_t* data, uint64_t length);
// CRC-32C (Castagnoli), as Zarr's crc32c codec and shard indexes store it.
uint32_t crc32c_of(const uint8_t* data, uint64_t length);

// A gzip file (one member or several) read from the start as a stream of its
// inflated bytes: a .nii.gz volume is one such stream, with no random access.
class GzipFile {
 public:
  explicit GzipFile(const std::string& path);
  ~GzipFile();
  GzipFile(const GzipFile&) = delete;
  GzipFile& operator=(const GzipFile&) = delete;

  // Inflates exactly `length` more bytes into `dest` (nullptr: discards them).
  // A file that ends first, or is corrupt, is a FormatError naming the
  // compressed offset where it went wrong.
  void read(uint8_t* dest, uint64_t length);
  // Whether the stream has ended (every member inflated, nothing after them).
  bool at_end();
  // Inflates (discarding) to the end of the stream, so that every member's
  // CRC-32 and ISIZE are checked, the last one's too. A FormatError naming the
  // compressed offset when more than `max_trailing` inflated bytes follow what
  // was read, when the file ends inside a member, or when what follows the
  // last member is neither another member nor zero padding.
  void finish(uint64_t max_trailing);
  uint64_t produced() const { return produced_; }
  const std::string& path() const { return path_; }

 private:
  bool fill();  // more compressed bytes; false at end of file

  std::string path_;
  FileDescriptor fd_;
  z_stream z_{};
  std::vector<uint8_t> input_;
  uint64_t file_offset_ = 0;  // compressed bytes read so far
  uint64_t produced_ = 0;
  bool member_ended_ = false;  // between members (or at the end)
};

}  // namespace stoker::io
