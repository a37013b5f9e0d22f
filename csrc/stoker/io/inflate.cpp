#include "stoker/io/inflate.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>

#include "stoker/errors.hpp"

namespace stoker::io {

namespace {

int window_bits(Wrapper wrapper) {
  switch (wrapper) {
    case Wrapper::kZlib:
      return MAX_WBITS;
    case Wrapper::kGzip:
      return MAX_WBITS + 16;
    default:
      return -MAX_WBITS;
  }
}

const char* wrapper_name(Wrapper wrapper) {
  switch (wrapper) {
    case Wrapper::kZlib:
      return "zlib";
    case Wrapper::kGzip:
      return "gzip";
    default:
      return "deflate";
  }
}

struct InflateStream {
  z_stream z{};
  explicit InflateStream(Wrapper wrapper) {
    if (inflateInit2(&z, window_bits(wrapper)) != Z_OK) throw Error("zlib: inflateInit2 failed");
  }
  ~InflateStream() { inflateEnd(&z); }
};

// Whether the bytes left after a gzip member start another member.
bool another_member(const z_stream& z, uint64_t in_left) {
  return z.avail_in + in_left >= 2 && z.next_in[0] == 0x1f &&
         (z.avail_in < 2 || z.next_in[1] == 0x8b);
}

}  // namespace

void inflate_exact(const uint8_t* src, uint64_t src_length, uint8_t* dest, uint64_t dest_length,
                   const std::string& path, uint64_t offset, Wrapper wrapper) {
  InflateStream stream(wrapper);
  z_stream& z = stream.z;
  const char* kind = wrapper_name(wrapper);
  uint64_t in_left = src_length;
  uint64_t out_left = dest_length;
  // zlib refuses a null buffer even when it is told to write nothing into it, and an
  // empty member's buffer may be null.
  uint8_t unused;
  z.next_in = const_cast<Bytef*>(src ? src : &unused);
  z.next_out = dest ? dest : &unused;
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
    if (status == Z_STREAM_END) {
      if (wrapper == Wrapper::kGzip && another_member(z, in_left)) {
        inflateReset(&z);
        continue;
      }
      break;
    }
    if (status == Z_DATA_ERROR || status == Z_NEED_DICT || status == Z_MEM_ERROR ||
        status == Z_STREAM_ERROR) {
      throw FormatError(
          path, offset,
          std::string("corrupt ") + kind + " data: " + (z.msg ? z.msg : "zlib error"));
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
      if (status == Z_STREAM_END && z.avail_out == 1 &&
          !(wrapper == Wrapper::kGzip && another_member(z, in_left))) {
        return;  // (the probe byte stayed unwritten: exactly dest_length were produced)
      }
      throw FormatError(path, offset,
                        std::string(kind) + " data inflates past its declared size of " +
                            std::to_string(dest_length) + " bytes (refused)");
    }
    if (status == Z_BUF_ERROR && z.avail_in == 0 && in_left == 0) {
      throw FormatError(path, offset,
                        std::string(kind) + " data ends early: " +
                            std::to_string(dest_length - out_left - z.avail_out) + " of " +
                            std::to_string(dest_length) + " bytes produced");
    }
  }
  uint64_t produced = dest_length - out_left - z.avail_out;
  if (produced != dest_length) {
    throw FormatError(path, offset,
                      std::string(kind) + " data inflates to " + std::to_string(produced) +
                          " bytes, but " + std::to_string(dest_length) + " were expected");
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

namespace {

// Slicing by four tables: shard indexes and Zarr chunks are checked at a few GB/s.
struct Crc32cTables {
  std::array<std::array<uint32_t, 256>, 4> t{};
  Crc32cTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int k = 1; k < 4; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
    }
  }
};

}  // namespace

uint32_t crc32c_of(const uint8_t* data, uint64_t length) {
  static const Crc32cTables tables;
  const auto& t = tables.t;
  uint32_t crc = 0xFFFFFFFFu;
  while (length >= 4) {
    crc ^= uint32_t(data[0]) | uint32_t(data[1]) << 8 | uint32_t(data[2]) << 16 |
           uint32_t(data[3]) << 24;
    crc = t[3][crc & 0xff] ^ t[2][(crc >> 8) & 0xff] ^ t[1][(crc >> 16) & 0xff] ^ t[0][crc >> 24];
    data += 4;
    length -= 4;
  }
  while (length-- > 0) crc = (crc >> 8) ^ t[0][(crc ^ *data++) & 0xff];
  return crc ^ 0xFFFFFFFFu;
}

// -- GzipFile -----------------------------------------------------------------------

namespace {
constexpr size_t kGzipInput = 1 << 20;
}

GzipFile::GzipFile(const std::string& path) : path_(path), fd_(open_for_read(path)) {
  if (inflateInit2(&z_, window_bits(Wrapper::kGzip)) != Z_OK) {
    throw Error("zlib: inflateInit2 failed");
  }
  input_.resize(kGzipInput);
}

GzipFile::~GzipFile() { inflateEnd(&z_); }

bool GzipFile::fill() {
  ssize_t got;
  do {
    got = ::pread(fd_.get(), input_.data(), input_.size(), static_cast<off_t>(file_offset_));
  } while (got < 0 && errno == EINTR);
  if (got < 0) throw ReadError(path_, file_offset_, errno, "read failed");
  z_.next_in = input_.data();
  z_.avail_in = static_cast<uInt>(got);
  file_offset_ += static_cast<uint64_t>(got);
  return got > 0;
}

void GzipFile::read(uint8_t* dest, uint64_t length) {
  uint8_t discard[16384];
  while (length > 0) {
    uInt want = static_cast<uInt>(std::min<uint64_t>(length, dest ? UINT_MAX : sizeof discard));
    z_.next_out = dest ? dest : discard;
    z_.avail_out = want;
    while (z_.avail_out > 0) {
      if (z_.avail_in == 0 && !fill()) {
        throw FormatError(
            path_, file_offset_,
            "the gzip stream ends after " + std::to_string(produced_ + (want - z_.avail_out)) +
                " inflated bytes, " + std::to_string(length - (want - z_.avail_out)) + " short");
      }
      if (member_ended_) {
        inflateReset(&z_);
        member_ended_ = false;
      }
      int status = inflate(&z_, Z_NO_FLUSH);
      if (status == Z_STREAM_END) {
        member_ended_ = true;
      } else if (status != Z_OK && status != Z_BUF_ERROR) {
        uint64_t at = file_offset_ - z_.avail_in;
        throw FormatError(path_, at,
                          std::string("corrupt gzip data: ") + (z_.msg ? z_.msg : "zlib error"));
      }
    }
    uInt done = want;
    produced_ += done;
    length -= done;
    if (dest) dest += done;
  }
}

void GzipFile::finish(uint64_t max_trailing) {
  uint8_t discard[16384];
  const uint64_t read_before = produced_;
  for (;;) {
    if (member_ended_) {
      // Between members: zero padding may follow the last one (gzip and
      // Python's gzip module accept it); anything else must be a member.
      while (z_.avail_in > 0 && z_.next_in[0] == 0) {
        ++z_.next_in;
        --z_.avail_in;
        if (z_.avail_in == 0 && !fill()) return;
      }
      if (z_.avail_in == 0 && !fill()) return;
      if (z_.next_in[0] != 0x1f) {
        throw FormatError(path_, file_offset_ - z_.avail_in,
                          "bytes after the last gzip member are neither another member nor "
                          "zero padding");
      }
      inflateReset(&z_);
      member_ended_ = false;
    }
    if (z_.avail_in == 0 && !fill()) {
      throw FormatError(path_, file_offset_,
                        "the gzip stream ends inside a member, " +
                            std::to_string(produced_ - read_before) + " inflated bytes after the " +
                            std::to_string(read_before) + " read: the file is truncated");
    }
    z_.next_out = discard;
    z_.avail_out = sizeof discard;
    int status = inflate(&z_, Z_NO_FLUSH);
    produced_ += sizeof discard - z_.avail_out;
    if (status == Z_STREAM_END) {
      member_ended_ = true;
    } else if (status != Z_OK && status != Z_BUF_ERROR) {
      throw FormatError(path_, file_offset_ - z_.avail_in,
                        std::string("corrupt gzip data: ") + (z_.msg ? z_.msg : "zlib error"));
    }
    if (produced_ - read_before > max_trailing) {
      throw FormatError(path_, file_offset_ - z_.avail_in,
                        "the gzip stream goes on past the " + std::to_string(read_before) +
                            " bytes read: more than " + std::to_string(max_trailing) +
                            " inflated bytes follow them (refused)");
    }
  }
}

bool GzipFile::at_end() {
  if (!member_ended_) return false;
  if (z_.avail_in == 0 && !fill()) return true;
  return false;
}

}  // namespace stoker::io
