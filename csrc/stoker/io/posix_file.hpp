// Thin RAII and helpers over POSIX file descriptors, shared by the reader and
// the index parsers so that every read reports errors the same way.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "stoker/io/byte_vector.hpp"

namespace stoker::io {

// How many pages this process's mappings may note as present (PresentPages) before every
// note is dropped: a page made present stays so only while the page cache keeps it, so
// notes are trusted only for about a quarter of memory's worth of pages made present
// since they were dropped. A page noted present but taken back since is faulted in again
// with no populate call, and a read error there would be a SIGBUS, not a ReadError.
class PageLedger {
 public:
  explicit PageLedger(uint64_t budget_pages) : budget_(budget_pages) {}
  static PageLedger& process();  // a quarter of the machine's memory
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  // Counts `pages` newly noted; past the budget, starts a new generation (drops every note).
  void noted(uint64_t pages);

 private:
  const uint64_t budget_;
  std::atomic<uint64_t> noted_{0};
  std::atomic<uint64_t> generation_{0};
};

// Which pages of a file's mapping have been made present (MADV_POPULATE_READ) in its
// ledger's current generation: a bit a page, in leaves of 4 KiB made when a page of their
// 128 MiB of the file is first marked. Safe to mark and ask from many threads at once.
class PresentPages {
 public:
  explicit PresentPages(uint64_t pages, PageLedger& ledger = PageLedger::process());
  ~PresentPages();
  PresentPages(const PresentPages&) = delete;
  PresentPages& operator=(const PresentPages&) = delete;
  // Whether every page of [first, end) is marked.
  bool all(uint64_t first, uint64_t end) const;
  // Best effort: a leaf that cannot be allocated leaves its pages unmarked.
  void mark(uint64_t first, uint64_t end);

 private:
  static constexpr uint64_t kLeafWords = 512;
  static constexpr uint64_t kLeafPages = kLeafWords * 64;
  void catch_up(uint64_t generation);
  PageLedger& ledger_;
  uint64_t leaf_count_;
  std::unique_ptr<std::atomic<std::atomic<uint64_t>*>[]> leaves_;
  std::atomic<uint64_t> generation_;  // of the ledger, when the bits were last cleared
  std::mutex clearing_;
};

class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  FileDescriptor(FileDescriptor&& other) noexcept
      : fd_(other.fd_),
        map_(other.map_),
        map_size_(other.map_size_),
        present_(std::move(other.present_)) {
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
  // The mapping's pages that mapped_bytes has made present (null: not mapped).
  PresentPages* present() const { return present_.get(); }

 private:
  void unmap();
  int fd_ = -1;
  const uint8_t* map_ = nullptr;
  uint64_t map_size_ = 0;
  std::unique_ptr<PresentPages> present_;
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

// A file's size as a caller's last call saw it, so that its many calls on one file in one
// task stat it once (kSizeUnseen: not yet). A batch of patches of a volume is hundreds of
// spans, and a stat for each was a tenth of their reading. The size is then as old as the
// task (a chunk of a batch's runs on one thread, milliseconds): a file cut shorter
// meanwhile may give zeros or a SIGBUS, as one cut between a stat and a read always could.
constexpr uint64_t kSizeUnseen = UINT64_MAX;

// The `length` bytes at `offset` in the file's mapping, once the file is seen to still hold
// them (one fstat, or the size `*seen_size` holds; an fstat's size is left there) and their
// pages are present; null when the file is not mapped, is shorter now, or its pages could
// not be made present (the caller then reads with pread, which says why). Pages are made
// present by one MADV_POPULATE_READ, whose failure on a disk's read error becomes pread's
// ReadError, and only if the mapping has not noted them present (see PageLedger): walking
// present pages again, a call per span, was 40% of a volume's patch reading and a fifth of
// a shuffled Parquet epoch's CPU.
const uint8_t* mapped_bytes(const FileDescriptor& fd, uint64_t offset, uint64_t length,
                            uint64_t* seen_size = nullptr);

// The `length` bytes at `offset`, for a decoder that only reads them: mapped_bytes, or else
// read into `scratch` as pread_exact reads (same errors: a file cut shorter since it was
// opened is a short read, never a SIGBUS in the decoder). Valid while `fd` and `scratch`
// are.
const uint8_t* bytes_at(const FileDescriptor& fd, const std::string& path, uint64_t offset,
                        uint64_t length, ByteVector& scratch, uint64_t* seen_size = nullptr);

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
