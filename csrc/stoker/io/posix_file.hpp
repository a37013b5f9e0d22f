// Thin RAII and helpers over POSIX file descriptors, shared by the reader and
// the index parsers so that every read reports errors the same way.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace stoker::io {

class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  ~FileDescriptor();

  int get() const { return fd_; }

 private:
  int fd_ = -1;
};

// Opens read-only (close-on-exec); throws ReadError naming the path.
FileDescriptor open_for_read(const std::string& path);

// Size of an open file; throws ReadError.
uint64_t file_size(int fd, const std::string& path);

// Reads exactly `length` bytes at `offset`, retrying short reads and EINTR.
// End of file before `length` bytes is a FormatError (the file is shorter
// than whatever told us to read there); an OS failure is a ReadError.
void pread_exact(int fd, const std::string& path, void* dest, uint64_t length, uint64_t offset);

// Like pread_exact, but scatters the bytes at `offset` over `count` buffers
// (may modify `iov`). Same errors.
void preadv_exact(int fd, const std::string& path, struct iovec* iov, int count, uint64_t offset);

// Sizes of many files, stat'ed on `num_threads` threads (on a network mount
// each stat is a round trip). A file that cannot be stat'ed gets -errno.
std::vector<int64_t> stat_sizes(const std::vector<std::string>& paths, size_t num_threads);

}  // namespace stoker::io
