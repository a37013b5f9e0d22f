// ShardReader: reads a whole batch of byte ranges, from any number of files,
// into one caller-visible buffer using a pool of threads. Each batch is
// planned once (sorted, neighbouring ranges merged into one pread) and then
// split into a few tasks, so the per-sample cost is a few integer operations.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "stoker/io/aligned_buffer.hpp"
#include "stoker/io/array_layout.hpp"
#include "stoker/io/byte_vector.hpp"
#include "stoker/io/column_layout.hpp"
#include "stoker/io/decoder.hpp"
#include "stoker/io/file_cache.hpp"
#include "stoker/io/pinned_ring.hpp"
#include "stoker/io/thread_pool.hpp"

namespace stoker::io {

// The paths of a FileTable, shared by the tables made one from another: a dataset of a
// hundred thousand table files makes a new one whenever a file's column layouts join it,
// and copying its paths each time cost more than the batches between.
class PathList {
 public:
  PathList() : list_(std::make_shared<const std::vector<std::string>>()) {}
  PathList(std::vector<std::string> paths)  // NOLINT(google-explicit-constructor)
      : list_(std::make_shared<const std::vector<std::string>>(std::move(paths))) {}
  PathList(std::initializer_list<std::string> paths)  // NOLINT(google-explicit-constructor)
      : PathList(std::vector<std::string>(paths)) {}
  const std::string& operator[](size_t i) const { return (*list_)[i]; }
  size_t size() const { return list_->size(); }
  std::vector<std::string>::const_iterator begin() const { return list_->begin(); }
  std::vector<std::string>::const_iterator end() const { return list_->end(); }
  const std::vector<std::string>& all() const { return *list_; }

 private:
  std::shared_ptr<const std::vector<std::string>> list_;
};

// The files a dataset's requests refer to by index. Built once per dataset and
// shared with every batch, so a request is three integers, not a path.
struct FileTable {
  PathList paths;
  std::vector<FileIdentity> identities;                      // as indexed; empty or one per path
  std::vector<std::shared_ptr<const ArrayLayout>> arrays;    // of array sources' rows
  std::vector<std::shared_ptr<const ColumnLayout>> columns;  // of table sources' values
};

struct ReadRequest {
  uint32_t file = 0;         // index into the FileTable
  uint64_t offset = 0;       // where the bytes start in the file
  uint64_t length = 0;       // bytes on disk
  uint64_t dest_offset = 0;  // where the decoded bytes go in the batch buffer
  uint64_t out_length = 0;   // decoded size (== length for stored bytes)
  // A deflated member that is then decoded: the size of its inflated bytes.
  uint64_t inflated_length = 0;
  Codec codec = Codec::kStored;  // the reader's own, or one a decoder registered
  bool check_crc = false;        // compare the member's bytes' CRC-32 with `crc32`
  uint32_t crc32 = 0;
  // The decoder, for a code whose decoder is made per field (CodecEntry::per_field);
  // for other decoded codes the reader fills in the registered one.
  std::shared_ptr<const FieldDecoder> decoder;
  uint64_t seed = 0;   // handed to the decoder (an image's random crop)
  uint32_t array = 0;  // kArrayRow, kArrayBox: into FileTable::arrays; kColumnValue: columns
  // kArrayBox: the box to read; its elements land from dest_offset on, at its strides.
  std::shared_ptr<const ArrayBox> box;
  // A Bytes value: where it lies in a decoded unit (a table's decompressed pages), it may
  // be handed out there (BorrowedValue) instead of copied into the batch. A table value
  // whose size is not known yet (out_length kUnsizedValue) is always handed out so, from
  // its unit or from a copy the task makes: the batch has no room laid out for it.
  bool borrow = false;
};

// The out_length of a borrowed table value whose size its read finds out.
constexpr uint64_t kUnsizedValue = ~uint64_t(0);

// A value left where a decoded unit holds it, for request `request`: its bytes are
// data[0, size), kept alive by `owner`. A batch of a compressed Parquet column's images
// then costs one copy of their bytes (decompressing them), not two.
struct BorrowedValue {
  uint32_t request = 0;
  const uint8_t* data = nullptr;
  uint64_t size = 0;
  std::shared_ptr<const ByteVector> owner;
  bool shared = true;  // owner is a unit the cache may serve again, not a copy of the batch's
};

class ChunkCache;  // decoded chunks of array sources (array_rows.hpp)
struct ReadPlan;   // a batch's requests, sorted and grouped into runs (shard_reader.cpp)
// A reader's batches in flight that still have chunks nobody has claimed, oldest first.
// A thread waiting for its own batch, every chunk of which is claimed, reads one of
// theirs while another thread finishes its last: with few cores and chunks that take
// long to decode (a slide's JPEG tiles), sleeping there leaves a core idle for a tile's
// decode at the end of every batch. (A template only so that tests/cpp/stress.cpp can
// check it with batches of its own; the reader's is Backlog<PendingRead>.)
template <typename Batch>
class Backlog {
 public:
  void add(const std::shared_ptr<Batch>& batch) {
    std::vector<std::shared_ptr<Batch>> held;  // released after the lock
    std::lock_guard<std::mutex> lock(mutex_);
    // Pruned here too: a reader whose waits always find their batch done never asks.
    prune(nullptr, held);
    batches_.push_back(batch);
  }

  // The oldest batch other than `except` with a chunk left to claim; nullptr if none.
  std::shared_ptr<Batch> oldest_unclaimed(const Batch* except) {
    std::vector<std::shared_ptr<Batch>> held;
    std::lock_guard<std::mutex> lock(mutex_);
    return prune(except, held);
  }

  size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return batches_.size();
  }

 private:
  // Drops the batches gone or fully claimed; returns the oldest kept other than `except`.
  // Under mutex_; the batches it looked at go to `held`, for the caller to release after
  // (an owner may let go meanwhile: a batch is never destroyed under the lock).
  std::shared_ptr<Batch> prune(const Batch* except, std::vector<std::shared_ptr<Batch>>& held) {
    std::shared_ptr<Batch> found;
    auto kept = batches_.begin();
    for (auto at = batches_.begin(); at != batches_.end(); ++at) {
      std::shared_ptr<Batch> batch = at->lock();
      if (!batch) continue;
      held.push_back(batch);
      if (!batch->unclaimed()) continue;  // fully claimed batches never get work back
      if (!found && batch.get() != except) found = batch;
      if (kept != at) *kept = std::move(*at);  // (moved onto itself, a weak_ptr ends up empty)
      ++kept;
    }
    batches_.erase(kept, batches_.end());
    return found;
  }

  std::mutex mutex_;
  std::vector<std::weak_ptr<Batch>> batches_;
};

// One batch in flight. Its work is cut into chunks that pool threads claim
// one at a time; a thread that waits claims chunks too, so waiting never means
// sleeping through work the waiter could do itself (a wake-up costs more than
// reading a small batch). Waiting rethrows the first error any piece hit; the
// buffer is only handed out when every piece succeeded.
class PendingRead {
 public:
  PendingRead(pid_t owner, std::shared_ptr<const ReadPlan> plan, std::shared_ptr<FileCache> files,
              std::shared_ptr<ChunkCache> chunks, std::shared_ptr<AlignedBuffer> buffer,
              std::shared_ptr<Backlog<PendingRead>> backlog);

  // Helps read (this batch, then the backlog's others) and waits, for up to about
  // `timeout_ms` (negative: forever). True when the batch is complete; throws the batch's
  // error if it failed.
  bool wait(int64_t timeout_ms);
  bool done() const { return remaining_.load(std::memory_order_acquire) == 0; }
  // Chunks not yet started are skipped; the batch then fails as cancelled.
  void cancel();
  // Thread time spent reading and decoding this batch so far, summed over threads.
  double busy_seconds() const { return busy_ns_.load(std::memory_order_relaxed) * 1e-9; }
  // The requests (by index) whose member did not decode and were filled with
  // zeros instead (FieldDecoder::blank_on_error), in no particular order.
  std::vector<uint32_t> blanked() const;
  // The values handed out where they lie (ReadRequest::borrow), in no particular order;
  // complete once the batch is.
  std::vector<BorrowedValue> borrowed() const;
  // The bytes of the borrowed values the batch's buffer has no room for (kUnsizedValue).
  uint64_t unsized_bytes() const { return unsized_bytes_.load(std::memory_order_relaxed); }
  // Bytes read from files for this batch so far: whole runs, gaps merged into them
  // included, and array chunks as stored; chunks the ChunkCache served count nothing,
  // but for Parquet values it keeps only the place of (taken from the file's mapping:
  // those values' bytes count).
  uint64_t bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }
  // The buffer the batch was read into, when the reader allocated it.
  const std::shared_ptr<AlignedBuffer>& buffer() const { return buffer_; }

  // Claims and reads chunks until none are left unclaimed, `deadline` has
  // passed or `*stop` is set (both checked between chunks).
  void work(
      std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max(),
      const std::atomic<bool>* stop = nullptr);
  // The units a batch's work is cut into (array and column tasks, then runs of pieces).
  size_t chunk_count() const;
  bool unclaimed() const { return next_chunk_.load(std::memory_order_relaxed) < chunk_count(); }

 private:
  // Claims one chunk and reads it; false when none was left to claim.
  bool work_one();
  void finish_chunk();
  void fail(std::exception_ptr error);

  pid_t owner_;
  std::shared_ptr<const ReadPlan> plan_;
  std::shared_ptr<FileCache> files_;
  std::shared_ptr<ChunkCache> chunks_;
  std::shared_ptr<AlignedBuffer> buffer_;
  std::shared_ptr<Backlog<PendingRead>> backlog_;
  std::atomic<size_t> next_chunk_{0};
  std::atomic<size_t> remaining_;
  std::atomic<bool> failed_{false};
  std::atomic<int64_t> busy_ns_{0};
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> unsized_bytes_{0};
  mutable std::mutex mutex_;
  std::condition_variable finished_;
  std::exception_ptr error_;
  std::vector<uint32_t> blanked_;        // under mutex_
  std::vector<BorrowedValue> borrowed_;  // under mutex_
};

class ShardReader {
 public:
  // num_threads 0: one fewer than ThreadPool::default_size() (the thread that
  // waits for a batch reads too), at least one. max_open_files bounds the
  // descriptors kept open between batches.
  explicit ShardReader(size_t num_threads = 0, size_t max_open_files = 256);
  ~ShardReader();

  // Reads `requests` into `dest` (which must stay valid until the returned
  // read is done). Must not run concurrently with fork().
  std::shared_ptr<PendingRead> submit(std::shared_ptr<const FileTable> files,
                                      std::vector<ReadRequest> requests, uint8_t* dest,
                                      uint64_t dest_size);
  // As above, into a page-aligned buffer of `dest_size` bytes: a recycled one
  // when a batch buffer of about that size was freed recently.
  std::shared_ptr<PendingRead> submit(std::shared_ptr<const FileTable> files,
                                      std::vector<ReadRequest> requests, uint64_t dest_size);
  // A page-aligned buffer of `size` bytes from the ring the reader's own batches come
  // from, for a caller that fills one batch with several reads (the patch loader).
  std::shared_ptr<AlignedBuffer> batch_buffer(uint64_t size) { return state().ring->acquire(size); }

  size_t num_threads() const { return num_threads_; }
  size_t max_open_files() const { return max_open_files_; }
  size_t open_files();
  void forget(const std::string& path);
  // Bytes of decoded array chunks kept across batches (0: none kept). Setting it is not
  // thread-safe against submit() (Python calls both holding the GIL).
  size_t chunk_cache_bytes() const { return chunk_cache_bytes_; }
  void set_chunk_cache_bytes(size_t bytes);
  // Tells the decoded-chunk cache which JPEG tiles the boxes of the batches ahead will
  // touch (see foresee_array_boxes): `boxes` are kArrayBox requests, box i read by batch
  // batches[i]. Throws Error for a box outside its array.
  void foresee(const FileTable& files, const std::vector<ReadRequest>& boxes,
               const std::vector<int64_t>& batches, bool fresh);

 private:
  std::shared_ptr<PendingRead> submit_into(std::shared_ptr<const FileTable> files,
                                           std::vector<ReadRequest> requests, uint8_t* dest,
                                           uint64_t dest_size,
                                           std::shared_ptr<AlignedBuffer> buffer);
  // Everything with threads or locks in it. A forked child gets a new one:
  // the parent's threads do not exist there and may have held its locks.
  struct ProcessState {
    ProcessState(size_t num_threads, size_t max_open_files, size_t chunk_cache_bytes);
    std::shared_ptr<FileCache> files;  // batches in flight share it
    std::shared_ptr<ChunkCache> chunks;
    std::shared_ptr<PinnedRing> ring;
    std::shared_ptr<Backlog<PendingRead>> backlog;
    ThreadPool pool;
  };
  ProcessState& state();

  size_t num_threads_;
  size_t max_open_files_;
  size_t chunk_cache_bytes_;
  pid_t pid_;
  std::unique_ptr<ProcessState> state_;
};

// The ceiling the reader is measured against: the same reads as bare preads on
// `num_threads` threads, each into its own buffer, with no batching at all.
// Returns the seconds the reads took (files are opened before timing starts).
double bench_pread(const FileTable& files, const std::vector<ReadRequest>& requests,
                   size_t num_threads);

}  // namespace stoker::io
