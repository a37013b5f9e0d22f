// The error kinds the core raises. The bindings map each onto a Python type
// (StokerError, ShardFormatError, ReadError, CudaError, CuFileError); every one carries the file
// and the byte offset it is about, so a user can find the bad bytes.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace stoker {

class Error : public std::runtime_error {
 public:
  Error(std::string path, uint64_t offset, const std::string& what)
      : std::runtime_error(path + ": offset " + std::to_string(offset) + ": " + what),
        path_(std::move(path)),
        offset_(offset),
        detail_(what) {}
  // For errors that are about no file in particular (bad arguments, misuse).
  explicit Error(const std::string& what) : std::runtime_error(what), offset_(0), detail_(what) {}

  const std::string& path() const { return path_; }
  uint64_t offset() const { return offset_; }
  // What went wrong, without the file and offset.
  const std::string& detail() const { return detail_; }

 private:
  std::string path_;
  uint64_t offset_;
  std::string detail_;
};

// Text read from outside (a member's name, a header field, a server's bytes)
// in quotes for a message, cut after `limit` bytes, control characters shown
// as \xNN: a megabyte-long name, or one with a newline in it, never makes an
// error longer than a line. (Bytes that are not UTF-8 are escaped where the
// message becomes a Python string.)
inline std::string quoted(std::string_view text, size_t limit = 200) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "'";
  for (unsigned char c : text.substr(0, limit)) {
    if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '\'';
  if (text.size() > limit) out += "... (" + std::to_string(text.size()) + " bytes)";
  return out;
}

// The bytes of a shard are not what its format (or its index) says.
class FormatError : public Error {
 public:
  using Error::Error;
};

// The operating system refused: a missing file, EIO, a permission problem.
class ReadError : public Error {
 public:
  ReadError(std::string path, uint64_t offset, int err, const std::string& what)
      : Error(std::move(path), offset, what), errno_(err) {}
  int error_number() const { return errno_; }

 private:
  int errno_;
};

// CUDA is unusable here (no driver, no device, a forked child of a CUDA
// parent) or a driver call failed.
class CudaError : public Error {
 public:
  using Error::Error;
};

// A cuFile call failed; callers fall back to the bounce path.
class CuFileError : public CudaError {
 public:
  using CudaError::CudaError;
};

}  // namespace stoker
