// Thin RAII and helpers over POSIX file descriptors, shared by the reader and
// the index parsers so that every read reports errors the same way.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "stoker/io/byte_vector.hpp"

namespace stoker::io {

class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  FileDescriptor(FileDescriptor&& other) noexcept
      : fd_(other.fd_), map_(other.map_), map_size_(other.map_size_) {
    other.fd_ = -1;
    other.map_ = nullptr;
    other.map_size_ = 0;
  }
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  ~FileDescriptor();

  int get() const { return fd_; }

  // Maps the whole file read-only, best effort (a file system that refuses, an empty
  // file: left unmapped), so that bytes_at can hand a decoder the page cache's own pages
  // instead of a copy of them (the copy was a sixth of a Parquet epoch's time).
  void map();
  const uint8_t* mapped() const { return map_; }
  uint64_t mapped_size() const { return map_size_; }

 private:
  void unmap();
  int fd_ = -1;
  const uint8_t* map_ = nullptr;
  uint64_t map_size_ = 0;
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

// Whether bytes_at makes a mapping's pages present before handing them out. kNo is for
// bytes whose pages were made present when their unit was decoded (a Parquet column chunk
// whose values stay in the file's mapping): walking a megabyte of present pages again, for
// every batch that takes a few rows of the unit, was a fifth of a shuffled epoch's CPU. A
// page the kernel has let go of since is faulted back in; only then could a disk's read
// error, which making pages present turns into pread's ReadError, be a SIGBUS instead.
enum class Prefault : uint8_t { kYes, kNo };

// The `length` bytes at `offset`, for a decoder that only reads them: a pointer into the
// file's mapping, once the file is seen to still hold them and (kYes) their pages are made
// present (MADV_POPULATE_READ: one call, not a fault per page), or else read into
// `scratch` as pread_exact reads (same errors: a file cut shorter since it was opened is
// a short read, never a SIGBUS in the decoder). Valid while `fd` and `scratch` are.
const uint8_t* bytes_at(const FileDescriptor& fd, const std::string& path, uint64_t offset,
                        uint64_t length, ByteVector& scratch, Prefault prefault = Prefault::kYes);

// Makes the pages that lie wholly inside [data, data + size), memory about to be written
// whole, present in one call (MADV_POPULATE_WRITE) instead of a fault each as the writes
// reach them: on the development machine 60 us against 110-150 us for 192 KiB of fresh
// memory, and about 2 us where the pages are present already. Does nothing on kernels
// before 5.14, or when the call fails (the writes then fault the pages in as before).
void populate_for_write(void* data, size_t size);

// Like pread_exact, but scatters the bytes at `offset` over `count` buffers
// (may modify `iov`). Same errors.
void preadv_exact(int fd, const std::string& path, struct iovec* iov, int count, uint64_t offset);

// Identities of many files, stat'ed on `num_threads` threads (on a network
// mount each stat is a round trip). `errors[i]` is the errno of a failed stat
// (EISDIR for a directory), 0 on success.
void stat_files(const std::vector<std::string>& paths, size_t num_threads,
                std::vector<FileIdentity>& identities, std::vector<int>& errors);

}  // namespace stoker::io
