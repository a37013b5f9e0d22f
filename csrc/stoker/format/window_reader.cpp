#include "stoker/format/window_reader.hpp"

#include <algorithm>
#include <utility>

#include "stoker/errors.hpp"

namespace stoker::format {

WindowReader::WindowReader(const std::string& path, uint64_t window)
    : path_(path),
      fd_(io::open_for_read(path)),
      identity_(io::identity_of(fd_.get(), path)),
      size_(identity_.size),
      window_(window),
      read_([this](uint8_t* dest, uint64_t length, uint64_t offset) {
        io::pread_exact(fd_.get(), path_, dest, length, offset);
      }) {}

WindowReader::WindowReader(std::string label, uint64_t size, ReadRange read, uint64_t window)
    : path_(std::move(label)), size_(size), window_(window), read_(std::move(read)) {}

const uint8_t* WindowReader::at(uint64_t offset, uint64_t length, const char* what) {
  if (offset > size_ || length > size_ - offset) {
    throw FormatError(path_, offset,
                      std::string("truncated: ") + what + " needs " + std::to_string(length) +
                          " bytes but the file ends at " + std::to_string(size_));
  }
  if (offset >= buffer_start_ && offset + length <= buffer_start_ + buffer_length_) {
    return buffer_.data() + (offset - buffer_start_);
  }
  uint64_t want = std::min(std::max(length, window_), size_ - offset);
  if (buffer_.size() < want) buffer_.resize(want);
  read_(buffer_.data(), want, offset);
  buffer_start_ = offset;
  buffer_length_ = want;
  return buffer_.data();
}

}  // namespace stoker::format
