#include "stoker/io/shard_reader.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "stoker/errors.hpp"
#include "stoker/io/array_rows.hpp"
#include "stoker/io/column_rows.hpp"
#include "stoker/io/inflate.hpp"

namespace stoker::io {

namespace {

// Two ranges of one file closer than this are read with one pread: below a
// few pages, reading the gap costs less than a second system call.
constexpr uint64_t kMaxGap = 8 * 1024;
// ...but a merged read stays small enough to sit in a thread's scratch buffer.
constexpr uint64_t kMaxRun = 256 * 1024;
// Work per chunk: small enough that a batch spreads over every thread (and
// the waiter) and that a waiter checks for Ctrl-C often, big enough that
// claiming it is noise.
constexpr uint64_t kMinChunkBytes = 32 * 1024;
constexpr uint64_t kMaxChunkBytes = 4 * 1024 * 1024;
// Ring slots kept for reuse: enough for a deep prefetch of large batches.
constexpr size_t kIdleSlots = 16;
constexpr size_t kIdleSlotBytes = 256 * 1024 * 1024;
// A thread's scratch buffer is given back when a read needed more than this.
constexpr size_t kScratchKeep = 8 * 1024 * 1024;
// The chunks a batch's boxes may touch in all: the plan holds one entry (16
// bytes) per box and chunk, and a box of many tiny chunks is a wrong layout.
constexpr uint64_t kMaxBoxChunks = uint64_t(1) << 24;
// Decoded array chunks kept across batches, per process.
constexpr size_t kChunkCacheBytes = 256 * 1024 * 1024;
// Tiles a call to foresee may count (its map takes about 64 bytes a tile).
constexpr uint64_t kMaxForeseenChunks = uint64_t(1) << 24;

// A run: pieces that are read from one span of one file with one pread.
struct Run {
  uint32_t file;
  uint64_t start;
  uint64_t end;
  uint32_t first;  // into the plan's order[]
  uint32_t count;
  bool slow;  // one of its pieces is slow to decode (at most one is)
};

bool is_slow(const ReadRequest& r) { return r.decoder && r.decoder->slow(); }

}  // namespace

struct ReadPlan {
  std::shared_ptr<const FileTable> files;
  std::vector<ReadRequest> requests;
  std::vector<uint32_t> order;  // requests sorted by (file, offset)
  std::vector<Run> runs;
  std::vector<std::pair<size_t, size_t>> chunks;  // [first, last) runs, a unit of work
  ArrayPlan arrays;    // rows and boxes of array sources: each of its tasks is a unit of work too
  ColumnPlan columns;  // values of table sources: so is each of its tasks
  uint8_t* dest = nullptr;
};

namespace {

void plan_runs(ReadPlan& plan) {
  const auto& req = plan.requests;
  plan.order.reserve(req.size());
  for (uint32_t i = 0; i < req.size(); ++i) {
    if (req[i].codec != Codec::kArrayRow && req[i].codec != Codec::kArrayBox &&
        req[i].codec != Codec::kColumnValue) {
      plan.order.push_back(i);
    }
  }
  std::sort(plan.order.begin(), plan.order.end(), [&](uint32_t a, uint32_t b) {
    return req[a].file != req[b].file ? req[a].file < req[b].file : req[a].offset < req[b].offset;
  });
  for (uint32_t k = 0; k < plan.order.size(); ++k) {
    const ReadRequest& r = req[plan.order[k]];
    uint64_t end = r.offset + r.length;
    if (!plan.runs.empty()) {
      Run& run = plan.runs.back();
      uint64_t new_end = std::max(run.end, end);
      // An image takes about a millisecond to decode, a thousand times its read: one
      // slow piece per run, so that a batch of small images still spreads over every thread.
      bool second_slow = run.slow && is_slow(r);
      if (run.file == r.file && r.offset <= run.end + kMaxGap && new_end - run.start <= kMaxRun &&
          !second_slow) {
        run.end = new_end;
        ++run.count;
        run.slow = run.slow || is_slow(r);
        continue;
      }
    }
    plan.runs.push_back(Run{r.file, r.offset, end, k, 1, is_slow(r)});
  }
}

// Scatter buffers for a run whose pieces are in file order without overlaps:
// stored pieces straight into their place, encoded ones (deflated bytes,
// integer text) into `scratch` to be decoded after the read, each gap into
// `discard`. So a run of images and their labels is one preadv that copies
// nothing twice. False when pieces overlap: the run is then read whole.
bool scatter_list(const ReadPlan& plan, const Run& run, uint8_t* discard, ByteVector& scratch,
                  std::vector<struct iovec>& iov) {
  uint64_t at = run.start, encoded = 0;
  for (uint32_t k = run.first; k < run.first + run.count; ++k) {
    const ReadRequest& r = plan.requests[plan.order[k]];
    if (r.offset < at) return false;
    if (r.codec != Codec::kStored) encoded += r.length;
    at = r.offset + r.length;
  }
  if (scratch.size() < encoded) scratch.resize(encoded);
  iov.clear();
  at = run.start;
  uint64_t used = 0;
  for (uint32_t k = run.first; k < run.first + run.count; ++k) {
    const ReadRequest& r = plan.requests[plan.order[k]];
    if (r.offset > at) iov.push_back({discard, static_cast<size_t>(r.offset - at)});
    uint8_t* into = plan.dest + r.dest_offset;
    if (r.codec != Codec::kStored) {
      into = scratch.data() + used;
      used += r.length;
    }
    iov.push_back({into, static_cast<size_t>(r.length)});
    at = r.offset + r.length;
  }
  return true;
}

void verify_crc(const ReadRequest& r, const uint8_t* decoded, uint64_t length,
                const std::string& path) {
  if (!r.check_crc) return;
  uint32_t got = crc32_of(decoded, length);
  if (got != r.crc32) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "CRC-32 mismatch: expected %08x, got %08x", r.crc32, got);
    throw FormatError(path, r.offset, buf);
  }
}

void decode_piece(const ReadRequest& r, const uint8_t* src, uint8_t* dest,
                  const std::string& path) {
  const bool deflated = find_codec(r.codec)->deflated;  // validated: it is registered
  if (!r.decoder) {
    if (deflated) {
      inflate_exact(src, r.length, dest, r.out_length, path, r.offset);
    } else {
      std::memcpy(dest, src, r.length);
    }
    verify_crc(r, dest, r.out_length, path);
    return;
  }
  if (!deflated) {
    verify_crc(r, src, r.length, path);
    r.decoder->decode(src, r.length, r.seed, dest, path, r.offset);
    return;
  }
  thread_local ByteVector inflated;
  struct Shrink {  // when decoding throws too
    ~Shrink() { give_back_if_larger(inflated, kScratchKeep); }
  } shrink;
  inflated.resize(r.inflated_length);
  inflate_exact(src, r.length, inflated.data(), r.inflated_length, path, r.offset);
  verify_crc(r, inflated.data(), r.inflated_length, path);
  r.decoder->decode(inflated.data(), r.inflated_length, r.seed, dest, path, r.offset);
}

// Decodes request `index`; a member that does not decode, where its decoder says
// so, becomes zeros and is noted in `blanked` instead of failing the batch.
void decode_or_blank(const ReadPlan& plan, uint32_t index, const uint8_t* src,
                     const std::string& path, std::vector<uint32_t>& blanked) {
  const ReadRequest& r = plan.requests[index];
  uint8_t* dest = plan.dest + r.dest_offset;
  if (!r.decoder || !r.decoder->blank_on_error()) {
    decode_piece(r, src, dest, path);
    return;
  }
  try {
    decode_piece(r, src, dest, path);
  } catch (const FormatError&) {
    std::memset(dest, 0, r.out_length);
    blanked.push_back(index);
  }
}

// The descriptor a chunk's previous run used, kept while the next runs read the
// same file: runs are sorted by file, so most lookups in the cache are saved.
struct OpenFile {
  uint32_t file = UINT32_MAX;
  std::shared_ptr<const FileDescriptor> fd;
  uint64_t size = kSizeUnseen;  // the file's size as this chunk's first bytes_at saw it
};

// Returns the bytes it read.
uint64_t execute_run(const ReadPlan& plan, const Run& run, FileCache& cache, ByteVector& scratch,
                     OpenFile& open, std::vector<uint32_t>& blanked) {
  const FileTable& table = *plan.files;
  const std::string& path = table.paths[run.file];
  if (open.file != run.file) {
    open.fd =
        cache.get(path, table.identities.empty() ? FileIdentity{} : table.identities[run.file]);
    open.file = run.file;
    open.size = kSizeUnseen;
  }
  const auto& fd = open.fd;
  const uint64_t span = run.end - run.start;
  bool decoded = false;
  uint64_t piece_bytes = 0;
  for (uint32_t k = run.first; k < run.first + run.count; ++k) {
    const ReadRequest& r = plan.requests[plan.order[k]];
    decoded |= r.codec != Codec::kStored;
    piece_bytes += r.length;
  }
  // A mapped file's run is taken where it lies in the page cache: its pieces decoded
  // (images, a patch's boxes cut from a span) or copied into place from there, and its
  // gaps never copied. memcpy copies faster than the kernel: a shuffled 2nd epoch of an
  // Arrow file's image bytes went from 281k to 433k samples/s. A run of stored pieces
  // whose gaps are more than its pieces (rows of a patch of a large volume) is not: its
  // gaps' pages, made present, would count in the process's RSS.
  const uint8_t* base = nullptr;
  if (decoded || 2 * piece_bytes >= span) base = mapped_bytes(*fd, run.start, span, &open.size);
  if (base == nullptr) {
    // Otherwise (and for an unmapped file, or a range the mapping cannot give) one preadv
    // scatters the run: stored pieces straight into place, encoded ones into scratch.
    // Gap bytes land here and are never read; one per thread, as threads write it at once.
    thread_local uint8_t discard[kMaxGap];
    thread_local std::vector<struct iovec> iov;
    if (scatter_list(plan, run, discard, scratch, iov)) {
      preadv_exact(fd->get(), path, iov.data(), static_cast<int>(iov.size()), run.start);
      uint64_t used = 0;
      for (uint32_t k = run.first; k < run.first + run.count; ++k) {
        const ReadRequest& r = plan.requests[plan.order[k]];
        if (r.codec == Codec::kStored) {
          verify_crc(r, plan.dest + r.dest_offset, r.length, path);
        } else {
          decode_or_blank(plan, plan.order[k], scratch.data() + used, path, blanked);
          used += r.length;
        }
      }
      if (scratch.size() > kScratchKeep) ByteVector().swap(scratch);
      return span;
    }
    // Pieces that overlap: the run whole, read into scratch (pread says why the mapping
    // could not give it).
    base = bytes_at(*fd, path, run.start, span, scratch, &open.size);
  }
  // decode_or_blank copies a stored piece into place and decodes the rest.
  for (uint32_t k = run.first; k < run.first + run.count; ++k) {
    const ReadRequest& r = plan.requests[plan.order[k]];
    decode_or_blank(plan, plan.order[k], base + (r.offset - run.start), path, blanked);
  }
  give_back_if_larger(scratch, kScratchKeep);
  return span;
}

void validate(const FileTable& files, const std::vector<ReadRequest>& requests,
              uint64_t dest_size) {
  uint64_t box_chunks = 0;
  for (const ReadRequest& r : requests) {
    if (r.codec == Codec::kArrayBox) {  // of no file of the table: of its array's
      uint64_t chunks = validate_array_box(files, r, dest_size);
      box_chunks = chunks > kMaxBoxChunks - box_chunks ? kMaxBoxChunks + 1 : box_chunks + chunks;
      if (box_chunks > kMaxBoxChunks) {
        throw Error(files.arrays[r.array]->name + ": the batch's boxes touch more than " +
                    std::to_string(kMaxBoxChunks) + " chunks");
      }
      continue;
    }
    if (r.box) throw Error("only an ARRAY_BOX read request has a box");
    if (r.codec == Codec::kColumnValue) {  // of its column's file, with its own decoder
      validate_column_value(files, r, dest_size);
      continue;
    }
    if (r.file >= files.paths.size()) {
      throw Error("read request names file " + std::to_string(r.file) + " but the table has " +
                  std::to_string(files.paths.size()));
    }
    const std::string& path = files.paths[r.file];
    const CodecEntry* entry = find_codec(r.codec);
    if (entry == nullptr) {
      throw Error(path, r.offset, "unknown codec " + std::to_string(int(r.codec)));
    }
    if (r.codec == Codec::kArrayRow) {
      validate_array_row(files, r);
    } else if (r.codec == Codec::kStored && r.out_length != r.length) {
      throw Error(path, r.offset,
                  "stored piece has length " + std::to_string(r.length) + " but output length " +
                      std::to_string(r.out_length));
    }
    if (r.decoder && !entry->per_field) {
      throw Error(path, r.offset, std::string("a ") + entry->name + " piece takes no decoder");
    }
    if (entry->per_field && !r.decoder) {
      throw Error(path, r.offset, std::string("a ") + entry->name + " piece needs its decoder");
    }
    const FieldDecoder* decoder = r.decoder ? r.decoder.get() : entry->decoder.get();
    if (decoder != nullptr && r.out_length != decoder->output_bytes()) {
      throw Error(path, r.offset,
                  std::string("a ") + entry->name + " piece decodes to " +
                      std::to_string(decoder->output_bytes()) + " bytes, not " +
                      std::to_string(r.out_length));
    }
    if (decoder != nullptr && entry->deflated && r.inflated_length > decoder->max_input_bytes()) {
      throw FormatError(path, r.offset,
                        "a member that inflates to " + std::to_string(r.inflated_length) +
                            " bytes, more than the " + std::to_string(decoder->max_input_bytes()) +
                            " " + decoder->input_name() + " may be");
    }
    if (r.dest_offset > dest_size || r.out_length > dest_size - r.dest_offset) {
      throw Error(path, r.offset,
                  "piece of " + std::to_string(r.out_length) + " bytes at buffer offset " +
                      std::to_string(r.dest_offset) + " does not fit a buffer of " +
                      std::to_string(dest_size));
    }
    if (r.offset + r.length < r.offset) throw Error(path, r.offset, "range overflows");
  }
}

void plan_chunks(ReadPlan& plan, size_t num_threads) {
  uint64_t total = 0;
  for (const Run& run : plan.runs) total += run.end - run.start;
  uint64_t target =
      std::clamp<uint64_t>(total / (4 * (num_threads + 1)) + 1, kMinChunkBytes, kMaxChunkBytes);
  size_t first = 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < plan.runs.size(); ++i) {
    bytes += plan.runs[i].end - plan.runs[i].start;
    // A run with a slow piece is a chunk of its own, so that no thread is left waiting
    // on another's long chunk at the end of a batch.
    if (bytes >= target || plan.runs[i].slow) {
      plan.chunks.emplace_back(first, i + 1);
      first = i + 1;
      bytes = 0;
    }
  }
  if (first < plan.runs.size()) plan.chunks.emplace_back(first, plan.runs.size());
}

}  // namespace

PendingRead::PendingRead(pid_t owner, std::shared_ptr<const ReadPlan> plan,
                         std::shared_ptr<FileCache> files, std::shared_ptr<ChunkCache> chunks,
                         std::shared_ptr<AlignedBuffer> buffer,
                         std::shared_ptr<Backlog<PendingRead>> backlog)
    : owner_(owner),
      plan_(std::move(plan)),
      files_(std::move(files)),
      chunks_(std::move(chunks)),
      buffer_(std::move(buffer)),
      backlog_(std::move(backlog)),
      remaining_(chunk_count()) {}

size_t PendingRead::chunk_count() const {
  return plan_->arrays.tasks.size() + plan_->columns.tasks.size() + plan_->chunks.size();
}

void PendingRead::work(std::chrono::steady_clock::time_point deadline,
                       const std::atomic<bool>* stop) {
  while (unclaimed() && std::chrono::steady_clock::now() < deadline &&
         !(stop && stop->load(std::memory_order_relaxed))) {
    if (!work_one()) break;
  }
}

bool PendingRead::work_one() {
  thread_local ByteVector scratch;
  // Array and column tasks come first: each decodes a chunk, the longest units a batch has.
  const size_t arrays = plan_->arrays.tasks.size();
  const size_t tasks = arrays + plan_->columns.tasks.size();
  size_t c = next_chunk_.fetch_add(1);
  if (c >= chunk_count()) return false;
  if (!failed_.load(std::memory_order_relaxed)) {
    auto started = std::chrono::steady_clock::now();
    thread_local std::vector<uint32_t> blanked;
    thread_local std::vector<BorrowedValue> borrowed;
    blanked.clear();
    borrowed.clear();
    uint64_t read = 0;
    try {
      if (c < arrays) {
        read = execute_array_task(*plan_->files, plan_->requests, plan_->arrays,
                                  plan_->arrays.tasks[c], plan_->dest, *files_, *chunks_);
      } else if (c < tasks) {
        read = execute_column_task(*plan_->files, plan_->requests, plan_->columns,
                                   plan_->columns.tasks[c - arrays], plan_->dest, *files_, *chunks_,
                                   blanked, borrowed);
      } else {
        auto [first, last] = plan_->chunks[c - tasks];
        OpenFile open;
        for (size_t i = first; i < last; ++i) {
          read += execute_run(*plan_, plan_->runs[i], *files_, scratch, open, blanked);
        }
      }
      if (!blanked.empty() || !borrowed.empty()) {
        uint64_t unsized = 0;
        for (const BorrowedValue& b : borrowed) {
          if (plan_->requests[b.request].out_length == kUnsizedValue) unsized += b.size;
        }
        unsized_bytes_.fetch_add(unsized, std::memory_order_relaxed);
        std::lock_guard<std::mutex> lock(mutex_);
        blanked_.insert(blanked_.end(), blanked.begin(), blanked.end());
        borrowed_.insert(borrowed_.end(), std::make_move_iterator(borrowed.begin()),
                         std::make_move_iterator(borrowed.end()));
      }
    } catch (...) {
      // Nothing may leave: the thread may be another batch's waiter, and this batch's
      // chunk must still be counted finished for its own.
      fail(std::current_exception());
    }
    borrowed.clear();  // a thread's list must not keep units alive between batches
    bytes_read_.fetch_add(read, std::memory_order_relaxed);
    busy_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now() - started)
                           .count(),
                       std::memory_order_relaxed);
  }
  finish_chunk();
  return true;
}

void PendingRead::fail(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!error_) error_ = std::move(error);
  failed_.store(true, std::memory_order_relaxed);
}

std::vector<uint32_t> PendingRead::blanked() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return blanked_;
}

std::vector<BorrowedValue> PendingRead::borrowed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return borrowed_;
}

void PendingRead::cancel() {
  // A batch from before a fork: its lock may be held by a thread not here.
  if (getpid() != owner_) return;
  if (!done()) fail(std::make_exception_ptr(Error("the batch was cancelled before it was read")));
}

void PendingRead::finish_chunk() {
  // Under the lock, so a waiter cannot miss the wake-up between its check
  // and its sleep.
  std::lock_guard<std::mutex> lock(mutex_);
  if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) finished_.notify_all();
}

bool PendingRead::wait(int64_t timeout_ms) {
  if (getpid() != owner_) {
    throw Error(
        "this batch was submitted by the parent process before a fork; its reads are not "
        "running here. Submit it again in this process.");
  }
  using Clock = std::chrono::steady_clock;
  Clock::time_point deadline = timeout_ms < 0
                                   ? Clock::time_point::max()
                                   : Clock::now() + std::chrono::milliseconds(timeout_ms);
  // A slice of helping is bounded too, so a waiter that must check for
  // Ctrl-C between slices gets to.
  work(deadline);
  // Another batch's chunk at a time, so that this one is handed out at most a chunk late.
  while (!done() && Clock::now() < deadline) {
    std::shared_ptr<PendingRead> other = backlog_ ? backlog_->oldest_unclaimed(this) : nullptr;
    if (!other) break;
    other->work_one();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  auto complete = [this] { return remaining_.load(std::memory_order_acquire) == 0; };
  if (timeout_ms < 0) {
    finished_.wait(lock, complete);
  } else if (!finished_.wait_until(lock, deadline, complete)) {
    return false;
  }
  if (error_) std::rethrow_exception(error_);
  return true;
}

ShardReader::ProcessState::ProcessState(size_t num_threads, size_t max_open_files,
                                        size_t chunk_cache_bytes)
    : files(std::make_shared<FileCache>(max_open_files)),
      chunks(std::make_shared<ChunkCache>(chunk_cache_bytes)),
      ring(std::make_shared<PinnedRing>(kIdleSlots, kIdleSlotBytes)),
      backlog(std::make_shared<Backlog<PendingRead>>()),
      pool(num_threads) {}

// The thread that waits for a batch reads too: one pool thread fewer than the
// cores keeps the waiter from competing with the pool for a core.
ShardReader::ShardReader(size_t num_threads, size_t max_open_files)
    : num_threads_(num_threads == 0 ? std::max<size_t>(1, ThreadPool::default_size() - 1)
                                    : num_threads),
      max_open_files_(max_open_files == 0 ? 1 : max_open_files),
      chunk_cache_bytes_(kChunkCacheBytes),
      pid_(getpid()),
      state_(std::make_unique<ProcessState>(num_threads_, max_open_files_, chunk_cache_bytes_)) {}

ShardReader::~ShardReader() {
  // In a forked child, joining the parent's threads would hang and its locks
  // may be held: the parent's state is leaked (see state()).
  if (getpid() != pid_) (void)state_.release();
}

ShardReader::ProcessState& ShardReader::state() {
  pid_t now = getpid();
  if (now != pid_) {
    (void)state_.release();  // a few descriptors and idle buffers: bounded
    state_ = std::make_unique<ProcessState>(num_threads_, max_open_files_, chunk_cache_bytes_);
    pid_ = now;
  }
  return *state_;
}

size_t ShardReader::open_files() { return state().files->size(); }

void ShardReader::forget(const std::string& path) { state().files->forget(path); }

void ShardReader::set_chunk_cache_bytes(size_t bytes) {
  chunk_cache_bytes_ = bytes;
  state().chunks = std::make_shared<ChunkCache>(bytes);  // batches in flight keep the old one
}

void ShardReader::foresee(const FileTable& files, const std::vector<ReadRequest>& boxes,
                          const std::vector<int64_t>& batches, bool fresh) {
  if (batches.size() != boxes.size()) throw Error("foresee needs one batch number per box");
  uint64_t chunks = 0;
  for (const ReadRequest& r : boxes) {
    if (r.codec != Codec::kArrayBox) throw Error("foresee takes ARRAY_BOX requests");
    chunks += std::min<uint64_t>(validate_array_box(files, r, UINT64_MAX), kMaxForeseenChunks);
    if (chunks > kMaxForeseenChunks) {
      throw Error("foresee: the boxes touch more than " + std::to_string(kMaxForeseenChunks) +
                  " chunks; foresee fewer batches at a time");
    }
  }
  foresee_array_boxes(files, boxes, batches, *state().chunks, fresh);
}

std::shared_ptr<PendingRead> ShardReader::submit(std::shared_ptr<const FileTable> files,
                                                 std::vector<ReadRequest> requests, uint8_t* dest,
                                                 uint64_t dest_size) {
  return submit_into(std::move(files), std::move(requests), dest, dest_size, nullptr);
}

std::shared_ptr<PendingRead> ShardReader::submit(std::shared_ptr<const FileTable> files,
                                                 std::vector<ReadRequest> requests,
                                                 uint64_t dest_size) {
  auto buffer = state().ring->acquire(dest_size);
  uint8_t* dest = buffer->data();
  return submit_into(std::move(files), std::move(requests), dest, dest_size, std::move(buffer));
}

std::shared_ptr<PendingRead> ShardReader::submit_into(std::shared_ptr<const FileTable> files,
                                                      std::vector<ReadRequest> requests,
                                                      uint8_t* dest, uint64_t dest_size,
                                                      std::shared_ptr<AlignedBuffer> buffer) {
  validate(*files, requests, dest_size);
  for (ReadRequest& r : requests) {
    if (!r.decoder) r.decoder = find_codec(r.codec)->decoder;
  }
  ProcessState& process = state();
  auto plan = std::make_shared<ReadPlan>();
  plan->files = std::move(files);
  plan->requests = std::move(requests);
  plan->dest = dest;
  plan_runs(*plan);
  plan_chunks(*plan, num_threads_);
  plan->arrays = plan_arrays(*plan->files, plan->requests);
  plan->columns = plan_columns(*plan->files, plan->requests);

  auto pending = std::make_shared<PendingRead>(pid_, std::move(plan), process.files, process.chunks,
                                               std::move(buffer), process.backlog);
  process.backlog->add(pending);
  const size_t helpers = std::min(pending->chunk_count(), num_threads_);
  // A batch outlives its pool if it must: whoever waits on it finishes it.
  const std::atomic<bool>* stop = &process.pool.stopping();
  for (size_t i = 0; i < helpers; ++i) {
    process.pool.submit(
        [pending, stop] { pending->work(std::chrono::steady_clock::time_point::max(), stop); });
  }
  return pending;
}

double bench_pread(const FileTable& files, const std::vector<ReadRequest>& requests,
                   size_t num_threads) {
  validate(files, requests, UINT64_MAX);
  if (num_threads == 0) num_threads = ThreadPool::default_size();
  std::vector<FileDescriptor> fds;
  fds.reserve(files.paths.size());
  for (const auto& path : files.paths) fds.push_back(open_for_read(path));
  uint64_t biggest = 0;
  for (const auto& r : requests) biggest = std::max(biggest, r.length);

  std::vector<std::exception_ptr> errors(num_threads);
  auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (size_t t = 0; t < num_threads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<uint8_t> buffer(biggest);
      try {
        for (size_t i = t; i < requests.size(); i += num_threads) {
          const ReadRequest& r = requests[i];
          pread_exact(fds[r.file].get(), files.paths[r.file], buffer.data(), r.length, r.offset);
        }
      } catch (...) {
        errors[t] = std::current_exception();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  for (auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
  return elapsed.count();
}

}  // namespace stoker::io
