#include "stoker/io/posix_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <new>

#include "stoker/errors.hpp"
#include "stoker/io/thread_pool.hpp"

namespace stoker::io {

namespace {

uint64_t page_bytes() {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

}  // namespace

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    unmap();
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    map_ = other.map_;
    map_size_ = other.map_size_;
    present_ = std::move(other.present_);
    other.fd_ = -1;
    other.map_ = nullptr;
    other.map_size_ = 0;
  }
  return *this;
}

FileDescriptor::~FileDescriptor() {
  unmap();
  if (fd_ >= 0) ::close(fd_);
}

namespace {

// Linux's value (asm-generic), for headers older than the kernels that have it: a wheel is
// built against old headers and run on new kernels.
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

// Whether the kernel takes MADV_POPULATE_READ (5.14 and later): without it a mapping's
// faults past the end of a file cut shorter since it was opened would kill the process,
// so files are not mapped and every read goes through pread.
bool kernel_populates(const void* at, size_t length) {
  static const bool works =
      ::madvise(const_cast<void*>(at), length, MADV_POPULATE_READ) == 0 || errno != EINVAL;
  return works;
}

}  // namespace

void FileDescriptor::map() {
  struct stat st;
  if (map_ != nullptr || fd_ < 0 || ::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode) ||
      st.st_size <= 0) {
    return;
  }
  void* at = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd_, 0);
  if (at == MAP_FAILED) return;
  if (!kernel_populates(at, std::min<size_t>(static_cast<size_t>(st.st_size), 4096))) {
    ::munmap(at, static_cast<size_t>(st.st_size));
    return;
  }
  const uint64_t page = page_bytes();
  try {
    present_ =
        std::make_unique<PresentPages>((static_cast<uint64_t>(st.st_size) + page - 1) / page);
  } catch (const std::bad_alloc&) {
    ::munmap(at, static_cast<size_t>(st.st_size));
    return;
  }
  map_ = static_cast<const uint8_t*>(at);
  map_size_ = static_cast<uint64_t>(st.st_size);
}

void FileDescriptor::unmap() {
  if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), map_size_);
  map_ = nullptr;
  map_size_ = 0;
  present_.reset();
}

PageLedger& PageLedger::process() {
  static PageLedger ledger([] {
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    return pages > 0 ? static_cast<uint64_t>(pages) / 4 : uint64_t(1) << 18;
  }());
  return ledger;
}

void PageLedger::noted(uint64_t pages) {
  if (pages == 0) return;
  if (noted_.fetch_add(pages, std::memory_order_relaxed) + pages > budget_) {
    // Two threads past the budget at once may both start a generation: harmless.
    noted_.store(0, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
}

PresentPages::PresentPages(uint64_t pages, PageLedger& ledger)
    : ledger_(ledger),
      leaf_count_((pages + kLeafPages - 1) / kLeafPages),
      leaves_(std::make_unique<std::atomic<std::atomic<uint64_t>*>[]>(leaf_count_)),
      generation_(ledger.generation()) {
  for (uint64_t i = 0; i < leaf_count_; ++i) leaves_[i].store(nullptr, std::memory_order_relaxed);
}

PresentPages::~PresentPages() {
  for (uint64_t i = 0; i < leaf_count_; ++i) delete[] leaves_[i].load(std::memory_order_acquire);
}

namespace {

// The bits of pages [page, page + count) in their word, count <= 64 - page % 64.
uint64_t page_bits(uint64_t page, uint64_t count) {
  return (count == 64 ? ~uint64_t(0) : (uint64_t(1) << count) - 1) << (page % 64);
}

}  // namespace

bool PresentPages::all(uint64_t first, uint64_t end) const {
  if (generation_.load(std::memory_order_acquire) != ledger_.generation()) return first == end;
  for (uint64_t page = first; page < end;) {
    const std::atomic<uint64_t>* leaf = leaves_[page / kLeafPages].load(std::memory_order_acquire);
    if (leaf == nullptr) return false;
    const uint64_t count = std::min<uint64_t>(64 - page % 64, end - page);
    const uint64_t want = page_bits(page, count);
    // Relaxed: a bit says only that a populate call returned, and publishes no data.
    if ((leaf[page % kLeafPages / 64].load(std::memory_order_relaxed) & want) != want) {
      return false;
    }
    page += count;
  }
  return true;
}

void PresentPages::catch_up(uint64_t generation) {
  std::lock_guard<std::mutex> lock(clearing_);
  if (generation_.load(std::memory_order_acquire) == generation) return;
  // A bit another thread sets meanwhile is of a page it has just made present: true in
  // the new generation too.
  for (uint64_t i = 0; i < leaf_count_; ++i) {
    std::atomic<uint64_t>* leaf = leaves_[i].load(std::memory_order_acquire);
    if (leaf == nullptr) continue;
    for (uint64_t w = 0; w < kLeafWords; ++w) leaf[w].store(0, std::memory_order_relaxed);
  }
  generation_.store(generation, std::memory_order_release);
}

void PresentPages::mark(uint64_t first, uint64_t end) {
  const uint64_t generation = ledger_.generation();
  if (generation_.load(std::memory_order_acquire) != generation) catch_up(generation);
  uint64_t noted = 0;
  for (uint64_t page = first; page < end;) {
    const uint64_t count = std::min<uint64_t>(64 - page % 64, end - page);
    std::atomic<std::atomic<uint64_t>*>& slot = leaves_[page / kLeafPages];
    std::atomic<uint64_t>* leaf = slot.load(std::memory_order_acquire);
    if (leaf == nullptr) {
      auto* made = new (std::nothrow) std::atomic<uint64_t>[kLeafWords]();
      if (made == nullptr) {  // left unmarked: populated again next time
        page += count;
        continue;
      }
      // Another thread's leaf, made meanwhile, wins: `leaf` is then that one.
      if (slot.compare_exchange_strong(leaf, made, std::memory_order_acq_rel)) {
        leaf = made;
      } else {
        delete[] made;
      }
    }
    const uint64_t bits = page_bits(page, count);
    const uint64_t before = leaf[page % kLeafPages / 64].fetch_or(bits, std::memory_order_relaxed);
    noted += static_cast<uint64_t>(__builtin_popcountll(bits & ~before));
    page += count;
  }
  ledger_.noted(noted);
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

namespace {

FileIdentity identity_from(const struct stat& st) {
  return FileIdentity{static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_size),
                      static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

}  // namespace

FileIdentity identity_of(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    throw ReadError(path, 0, err, std::string("cannot stat: ") + std::strerror(err));
  }
  return identity_from(st);
}

namespace {

[[noreturn]] void throw_read_failure(const std::string& path, uint64_t offset, uint64_t length,
                                     uint64_t at, int err) {
  throw ReadError(path, at, err,
                  "read of " + std::to_string(length) + " bytes at offset " +
                      std::to_string(offset) + " failed: " + std::strerror(err));
}

[[noreturn]] void throw_short_read(const std::string& path, uint64_t offset, uint64_t length,
                                   uint64_t at) {
  throw FormatError(path, at,
                    "short read: wanted " + std::to_string(length) + " bytes at offset " +
                        std::to_string(offset) + " but the file ends at " + std::to_string(at) +
                        " (was it truncated or replaced after it was indexed?)");
}

}  // namespace

void pread_exact(int fd, const std::string& path, void* dest, uint64_t length, uint64_t offset) {
  struct iovec iov = {dest, length};
  preadv_exact(fd, path, &iov, 1, offset);
}

const uint8_t* mapped_bytes(const FileDescriptor& fd, uint64_t offset, uint64_t length,
                            uint64_t* seen_size) {
  if (fd.mapped() == nullptr || offset > fd.mapped_size() || length > fd.mapped_size() - offset) {
    return nullptr;
  }
  if (length == 0) return fd.mapped() + offset;
  uint64_t size = seen_size != nullptr ? *seen_size : kSizeUnseen;
  if (size == kSizeUnseen) {
    struct stat st;
    size = ::fstat(fd.get(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
    if (seen_size != nullptr && size != 0) *seen_size = size;
  }
  // A file cut shorter since it was mapped reads as zeros to the end of the page that
  // holds its new end, and faults past that: only a range still in the file is taken.
  if (offset + length > size) return nullptr;
  const uint64_t page = page_bytes();
  // The mapping starts on a page, so its page numbers are the file's.
  const uint64_t first = offset / page, end = (offset + length + page - 1) / page;
  PresentPages& present = *fd.present();
  if (present.all(first, end)) return fd.mapped() + offset;
  // Fails (ENOMEM, EINTR, EFAULT: a read error, or the file cut shorter meanwhile)
  // without a signal.
  if (::madvise(const_cast<uint8_t*>(fd.mapped()) + first * page, (end - first) * page,
                MADV_POPULATE_READ) != 0) {
    return nullptr;
  }
  present.mark(first, end);
  return fd.mapped() + offset;
}

const uint8_t* bytes_at(const FileDescriptor& fd, const std::string& path, uint64_t offset,
                        uint64_t length, ByteVector& scratch, uint64_t* seen_size) {
  if (const uint8_t* mapped = mapped_bytes(fd, offset, length, seen_size)) return mapped;
  scratch.resize(length);
  pread_exact(fd.get(), path, scratch.data(), length, offset);
  return scratch.data();
}

void populate_for_write(void* data, size_t size) {
  const uintptr_t page = static_cast<uintptr_t>(page_bytes());
  static std::atomic<bool> works{true};
  const auto first = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
  const auto end = (reinterpret_cast<uintptr_t>(data) + size) & ~(page - 1);
  if (end <= first + 8 * page || !works.load(std::memory_order_relaxed)) return;
  if (::madvise(reinterpret_cast<void*>(first), end - first, MADV_POPULATE_WRITE) != 0 &&
      errno == EINVAL) {
    works.store(false, std::memory_order_relaxed);  // a kernel before 5.14
  }
}

void preadv_exact(int fd, const std::string& path, struct iovec* iov, int count, uint64_t offset) {
  uint64_t length = 0;
  for (int i = 0; i < count; ++i) length += iov[i].iov_len;
  uint64_t done = 0;
  while (count > 0) {
    if (iov->iov_len == 0) {
      ++iov;
      --count;
      continue;
    }
    // Linux caps one read at about 2 GiB and IOV_MAX buffers: ask for less and loop.
    int n = std::min(count, 1024);
    ssize_t got = n == 1 ? ::pread(fd, iov->iov_base, std::min<size_t>(iov->iov_len, 1u << 30),
                                   static_cast<off_t>(offset + done))
                         : ::preadv(fd, iov, n, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw_read_failure(path, offset, length, offset + done, errno);
    }
    if (got == 0) throw_short_read(path, offset, length, offset + done);
    done += static_cast<uint64_t>(got);
    for (auto left = static_cast<size_t>(got); left > 0;) {  // consume what was read
      size_t take = std::min(left, iov->iov_len);
      iov->iov_base = static_cast<char*>(iov->iov_base) + take;
      iov->iov_len -= take;
      left -= take;
      if (iov->iov_len == 0) {
        ++iov;
        --count;
      }
    }
  }
}

void stat_files(const std::vector<std::string>& paths, size_t num_threads,
                std::vector<FileIdentity>& identities, std::vector<int>& errors) {
  identities.assign(paths.size(), FileIdentity{});
  errors.assign(paths.size(), 0);
  parallel_for(paths.size(), num_threads, [&](size_t i) {
    struct stat st;
    if (::stat(paths[i].c_str(), &st) != 0) {
      errors[i] = errno;
    } else if (S_ISDIR(st.st_mode)) {
      errors[i] = EISDIR;
    } else {
      identities[i] = identity_from(st);
    }
  });
}

}  // namespace stoker::io
