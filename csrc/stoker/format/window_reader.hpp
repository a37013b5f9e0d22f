// Sequential-ish access to a shard's headers through a read-ahead window, so
// walking a tar of small members costs one pread per window, not per header.
// The bytes come from a file or from any ranged source (a remote shard's
// byte ranges fetched over HTTP), so one parser serves both.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "stoker/io/posix_file.hpp"

namespace stoker::format {

class WindowReader {
 public:
  // Fills dest with `length` bytes at `offset`, or throws.
  using ReadRange = std::function<void(uint8_t* dest, uint64_t length, uint64_t offset)>;

  explicit WindowReader(const std::string& path, uint64_t window = 64 * 1024);
  // A source of `size` bytes that are not a local file; `label` (a URL) names
  // it in errors. Its identity stays unknown.
  WindowReader(std::string label, uint64_t size, ReadRange read, uint64_t window);
  // The file reader's read_ points at this object.
  WindowReader(const WindowReader&) = delete;
  WindowReader& operator=(const WindowReader&) = delete;

  uint64_t size() const { return size_; }
  const io::FileIdentity& identity() const { return identity_; }
  const std::string& path() const { return path_; }
  // Pointer to bytes [offset, offset + length), valid until the next call.
  // Throws FormatError if the file ends before offset + length; `what` says
  // what was being read there.
  const uint8_t* at(uint64_t offset, uint64_t length, const char* what);

 private:
  std::string path_;
  io::FileDescriptor fd_;
  io::FileIdentity identity_;
  uint64_t size_;
  uint64_t window_;
  ReadRange read_;
  std::vector<uint8_t> buffer_;
  uint64_t buffer_start_ = 0;
  uint64_t buffer_length_ = 0;
};

}  // namespace stoker::format
