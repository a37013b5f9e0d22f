#include "stoker/io/inflate.hpp"

#include <zlib.h>

#include <algorithm>
#include <climits>

#include "stoker/errors.hpp"

namespace stoker::io {

namespace {

struct InflateStream {
  z_stream z{};
  InflateStream() {
    if (inflateInit2(&z, -MAX_WBITS) != Z_OK) throw Error("zlib: inflateInit2 failed");
  }
  ~InflateStream() { inflateEnd(&z); }
};

}  // namespace

void inflate_exact(const uint8_t* src, uint64_t src_length, uint8_t* dest, uint64_t dest_length,
                   const std::string& path, uint64_t offset) {
  InflateStream stream;
  z_stream& z = stream.z;
  uint64_t in_left = src_length;
  uint64_t out_left = dest_length;
  z.next_in = const_cast<Bytef*>(src);
  z.next_out = dest;
  for (;;) {
    // zlib counts in 32-bit words; feed it at most that much at a time.
    if (z.avail_in == 0 && in_left > 0) {
      z.avail_in = static_cast<uInt>(std::min<uint64_t>(in_left, UINT_MAX));
      in_left -= z.avail_in;
    }
    if (z.avail_out == 0 && out_left > 0) {
      z.avail_out = static_cast<uInt>(std::min<uint64_t>(out_left, UINT_MAX));
      out_left -= z.avail_out;
    }
    int status = inflate(&z, Z_NO_FLUSH);
    if (status == Z_STREAM_END) break;
    if (status == Z_DATA_ERROR || status == Z_NEED_DICT || status == Z_MEM_ERROR) {
      throw FormatError(path, offset,
                        std::string("corrupt deflate data: ") + (z.msg ? z.msg : "zlib error"));
    }
    if (z.avail_out == 0 && out_left == 0) {
      // Output is full but the stream has not ended: it inflates past the
      // declared size. Check whether it ends right here before refusing.
      uint8_t probe;
      z.next_out = &probe;
      z.avail_out = 1;
      if (z.avail_in == 0 && in_left > 0) {
        z.avail_in = static_cast<uInt>(std::min<uint64_t>(in_left, UINT_MAX));
        in_left -= z.avail_in;
      }
      status = inflate(&z, Z_NO_FLUSH);
      if (status == Z_STREAM_END && z.avail_out == 1) break;
      throw FormatError(path, offset,
                        "deflate member inflates past its declared size of " +
                            std::to_string(dest_length) + " bytes (refused)");
    }
    if (status == Z_BUF_ERROR && z.avail_in == 0 && in_left == 0) {
      throw FormatError(path, offset,
                        "deflate data ends early: " + std::to_string(z.total_out) + " of " +
                            std::to_string(dest_length) + " bytes produced");
    }
  }
  uint64_t produced = z.total_out;
  if (produced != dest_length) {
    throw FormatError(path, offset,
                      "deflate member inflates to " + std::to_string(produced) +
                          " bytes, but its header declares " + std::to_string(dest_length));
  }
}

uint32_t crc32_of(const uint8_t* data, uint64_t length) {
  uLong crc = crc32(0L, Z_NULL, 0);
  while (length > 0) {
    uInt chunk = static_cast<uInt>(std::min<uint64_t>(length, UINT_MAX));
    crc = crc32(crc, data, chunk);
    data += chunk;
    length -= chunk;
  }
  return static_cast<uint32_t>(crc);
}

}  // namespace stoker::io
