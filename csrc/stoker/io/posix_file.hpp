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

// What a file was when it was indexed. Inode, size and modification time
// together tell a replaced or rewritten file from the one indexed, and they
// agree between machines that share a file system. All zero: unknown.
struct FileIdentity {
  uint64_t inode = 0;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  bool known() const { return inode != 0 || size != 0 || mtime_ns != 0; }
  bool operator==(const FileIdentity& o) const {
    return inode == o.inode && size == o.size && mtime_ns == o.mtime_ns;
  }
  bool operator!=(const FileIdentity& o) const { return !(*this == o); }
};

FileIdentity identity_of(int fd, const std::string& path);

// Opens read-only (close-on-exec); throws ReadError naming the path.
FileDescriptor open_for_read(const std::string& path);

// Reads exactly `length` bytes at `offset`, retrying short reads and EINTR.
// End of file before `length` bytes is a FormatError (the file is shorter
// than whatever told us to read there); an OS failure is a ReadError.
void pread_exact(int fd, const std::string& path, void* dest, uint64_t length, uint64_t offset);

// Like pread_exact, but scatters the bytes at `offset` over `count` buffers
// (may modify `iov`). Same errors.
void preadv_exact(int fd, const std::string& path, struct iovec* iov, int count, uint64_t offset);

// Identities of many files, stat'ed on `num_threads` threads (on a network
// mount each stat is a round trip). `errors[i]` is the errno of a failed stat
// (EISDIR for a directory), 0 on success.
void stat_files(const std::vector<std::string>& paths, size_t num_threads,
                std::vector<FileIdentity>& identities, std::vector<int>& errors);

}  // namespace stoker::io
