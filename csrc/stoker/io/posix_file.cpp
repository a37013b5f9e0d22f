#include "stoker/io/posix_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "stoker/errors.hpp"
#include "stoker/io/thread_pool.hpp"

namespace stoker::io {

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

FileDescriptor::~FileDescriptor() {
  if (fd_ >= 0) ::close(fd_);
}

FileDescriptor open_for_read(const std::string& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    int err = errno;
    throw ReadError(path, 0, err, std::string("cannot open: ") + std::strerror(err));
  }
  struct stat st;
  if (::fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw ReadError(path, 0, EISDIR, "is a directory, not a shard or sample file");
  }
  return FileDescriptor(fd);
}

uint64_t file_size(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    throw ReadError(path, 0, err, std::string("cannot stat: ") + std::strerror(err));
  }
  return static_cast<uint64_t>(st.st_size);
}

void pread_exact(int fd, const std::string& path, void* dest, uint64_t length, uint64_t offset) {
  auto* out = static_cast<char*>(dest);
  uint64_t done = 0;
  while (done < length) {
    // Linux caps one read at about 2 GiB; ask for less and loop.
    size_t want = static_cast<size_t>(std::min<uint64_t>(length - done, 1ull << 30));
    ssize_t got = ::pread(fd, out + done, want, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      throw ReadError(path, offset + done, err,
                      std::string("read of ") + std::to_string(length) +
                          " bytes failed: " + std::strerror(err));
    }
    if (got == 0) {
      throw FormatError(path, offset + done,
                        "short read: wanted " + std::to_string(length) + " bytes at offset " +
                            std::to_string(offset) + " but the file ends at " +
                            std::to_string(offset + done) +
                            " (was it truncated or replaced after it was indexed?)");
    }
    done += static_cast<uint64_t>(got);
  }
}

std::vector<int64_t> stat_sizes(const std::vector<std::string>& paths, size_t num_threads) {
  std::vector<int64_t> sizes(paths.size());
  parallel_for(paths.size(), num_threads, [&](size_t i) {
    struct stat st;
    if (::stat(paths[i].c_str(), &st) != 0) {
      sizes[i] = -errno;
    } else if (S_ISDIR(st.st_mode)) {
      sizes[i] = -EISDIR;
    } else {
      sizes[i] = static_cast<int64_t>(st.st_size);
    }
  });
  return sizes;
}

}  // namespace stoker::io
