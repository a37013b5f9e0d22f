// Rows (Codec::kArrayRow) and boxes (Codec::kArrayBox, a patch of a volume or a
// slide) of array sources in a batch: grouped by the chunks they lie in, so that
// each chunk a batch touches is read and decoded once, however many of the
// batch's rows and boxes share it, and each is then copied out of it (gathered
// from several chunks where chunks cut across a row or a box).
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "stoker/image/codec.hpp"
#include "stoker/io/byte_vector.hpp"
#include "stoker/io/chunk_codec.hpp"
#include "stoker/io/file_cache.hpp"
#include "stoker/io/shard_reader.hpp"

namespace stoker::io {

struct ArrayTask {
  uint32_t array;  // into FileTable::arrays
  uint64_t chunk;  // in C order over its grid
  uint32_t first;  // into ArrayPlan::requests
  uint32_t count;
};

struct ArrayPlan {
  std::vector<ArrayTask> tasks;
  std::vector<uint32_t> requests;  // the rows and boxes each task serves, task by task
};

// Decoded chunks kept across batches, least recently used dropped first: a
// shuffled epoch draws a chunk's rows over several batches (see the sampler's
// groups), and each should not decode it again. Per process (a forked child
// starts its own); entries are never changed, so readers share them unlocked.
//
// It holds up to `limit` bytes, but starts at kStartBytes (an eighth of a
// smaller limit) and doubles each time a chunk it dropped is asked for again, as
// long as everything it dropped since it last grew would fit the limit beside what
// it holds. Memory touched for the first time costs more than the copy into it
// (page faults, zeroing; on a virtual machine that gave idle memory back, far
// more), so a cache that grew to the limit for an epoch whose chunks are each read
// in one window would spend most of a first epoch on fresh pages, where a cache of
// the window's size reuses the buffers it drops. And when the chunks read again
// are more than the limit (a second shuffled epoch of a source larger than it),
// growing buys little: an LRU cache of a fraction f of a shuffled pass finds about
// f^2/2 of the next pass's chunks. What it dropped is forgotten once it passes
// twice the limit, so that a long pass that read nothing again (an evaluation
// over a large source) does not keep a later loader's cache small for good.
//
// Foresight: a loader that knows the boxes of the batches ahead (a patch sampler's
// positions are drawn from the seed) says which JPEG tiles they touch, how many tasks
// will want each, and the part of it they copy out. A tile several tasks want is then
// decoded once, only that part, and kept under its part key until its last task takes
// it, where that costs less than decoding each task's part (foresee_array_boxes says
// how it weighs them). Any other tile is decoded as without foresight: whole and kept,
// or, where a task needs no more than half of it, only that part, for that task alone.
class ChunkCache {
 public:
  using Bytes = std::shared_ptr<const ByteVector>;
  static constexpr size_t kStartBytes = 32 * 1024 * 1024;
  // Ored into a chunk's number: the key of a tile kept in part (its entry's region says
  // which part), never found by a lookup of the whole tile.
  static constexpr uint64_t kPartOfChunk = uint64_t(1) << 63;
  struct Foresight {
    uint32_t tasks_left = 0;
    ChunkRegion region{UINT32_MAX, 0, UINT32_MAX, 0};  // empty: what tasks ahead copy out
    bool keep = false;  // decode `region` once and keep it (else each task its own part)
  };
  explicit ChunkCache(size_t limit) : limit_(limit), capacity_(std::min(limit / 8, kStartBytes)) {}
  // `region`, when given, is set to the part of the chunk the bytes found hold.
  Bytes find(uint64_t layout, uint64_t chunk, ChunkRegion* region = nullptr);

  // A chunk one thread is decoding: the others that want it meanwhile wait for its
  // bytes instead of reading it too (batches in flight at once share row groups and
  // chunks). Released when it ends, whether the decode put its bytes or threw.
  class Claim {
   public:
    Claim() = default;
    Claim(const Claim&) = delete;
    Claim& operator=(const Claim&) = delete;
    ~Claim();

   private:
    friend class ChunkCache;
    ChunkCache* cache_ = nullptr;
    uint64_t layout_ = 0, chunk_ = 0;
  };
  // find(), except that on a miss it waits while another thread holds the chunk's
  // claim, and where the chunk is still missing, claims it in `claim` for the caller.
  // find(), once no other thread holds the chunk's claim.
  Bytes find_unclaimed(uint64_t layout, uint64_t chunk, ChunkRegion* region = nullptr);
  Bytes find_or_claim(uint64_t layout, uint64_t chunk, Claim& claim, ChunkRegion* region = nullptr);
  // Keeps `bytes` (of which `region` holds the decoded values) unless the chunk is kept
  // already; `replace`: in its place.
  void put(uint64_t layout, uint64_t chunk, Bytes bytes, const ChunkRegion& region = {},
           bool replace = false);
  // Lets go of a chunk now (readers holding its bytes keep them).
  void erase(uint64_t layout, uint64_t chunk);
  // A buffer of `size` bytes to decode a chunk into before it is put: one that a chunk let
  // go of gave back, where there is one of that size (its pages present: no faults, no
  // zeroing), else a new one with its pages made present.
  std::shared_ptr<ByteVector> buffer(size_t size);
  // Adds the tasks ahead on chunks of `layout` (a new epoch: `fresh` forgets those
  // foreseen before).
  void foresee(uint64_t layout, const std::vector<std::pair<uint64_t, Foresight>>& chunks,
               bool fresh);
  // Counts one task on `chunk` down: false when none was foreseen; else `seen` says how
  // many tasks are left after this one and what they all copy out.
  bool take_foresight(uint64_t layout, uint64_t chunk, Foresight& seen);

 private:
  struct MarkedTile;

 public:
  // A JPEG tile's entropy marks (image::detail::EntropyMarks), kept apart from the
  // decoded bytes and across epochs, lent to one decode of the tile at a time (to use and
  // add to) and given back once it ends, thrown or not. nullptr where another decode of
  // the tile holds them, or where the tile has none and kMarkBytes are spent on others.
  class MarksLoan {
   public:
    MarksLoan(ChunkCache& cache, uint64_t layout, uint64_t chunk);
    MarksLoan(const MarksLoan&) = delete;
    MarksLoan& operator=(const MarksLoan&) = delete;
    ~MarksLoan();
    image::detail::EntropyMarks* get() const { return tile_ ? &tile_->marks : nullptr; }

   private:
    ChunkCache& cache_;
    uint64_t layout_, chunk_;
    MarkedTile* tile_ = nullptr;
  };
  static constexpr size_t kMarkBytes = 64 * 1024 * 1024;
  // The most it may hold: a chunk of more than a quarter of it is not kept.
  size_t limit() const { return limit_; }
  // What it holds at most now (see the class's words).
  size_t capacity() {
    std::lock_guard<std::mutex> lock(mutex_);
    return capacity_;
  }

 private:
  struct Key {
    uint64_t layout, chunk;
    bool operator==(const Key& o) const { return layout == o.layout && chunk == o.chunk; }
  };
  struct Hash {
    size_t operator()(const Key& k) const { return k.layout * 0x9E3779B97F4A7C15ull ^ k.chunk; }
  };
  struct Entry {
    Bytes bytes;
    std::list<Key>::iterator position;
    ChunkRegion region;
  };
  std::unordered_map<Key, Foresight, Hash> foresight_;
  struct MarkedTile {
    image::detail::EntropyMarks marks;
    size_t counted = 0;  // of its bytes, in mark_bytes_
    bool lent = false;
  };
  std::unordered_map<Key, MarkedTile, Hash> marks_;  // (a node's address never changes)
  size_t mark_bytes_ = 0;
  // Buffers of chunks let go of, for buffer() to hand out again (a chunk's tasks may
  // still hold its bytes when the cache lets go of it: each buffer comes back once its
  // last holder drops it, even after the cache is gone).
  struct Spares {
    std::mutex mutex;
    std::vector<std::unique_ptr<ByteVector>> buffers;
    size_t bytes = 0;
  };
  static constexpr size_t kSpareBytes = 32 * 1024 * 1024;
  std::shared_ptr<Spares> spares_ = std::make_shared<Spares>();
  // Chunks dropped since the cache last grew (or forgot them), the latest kDroppedKept.
  static constexpr size_t kDroppedKept = 1 << 16;
  const size_t limit_;
  std::mutex mutex_;
  size_t capacity_;
  size_t bytes_ = 0;
  std::list<Key> lru_;  // front: most recently used
  std::unordered_map<Key, Entry, Hash> entries_;
  std::unordered_set<Key, Hash> dropped_;
  std::deque<Key> dropped_order_;
  size_t dropped_bytes_ = 0;  // of the chunks put in dropped_ (the forgotten ones too)
  void forget_dropped();
  std::unordered_set<Key, Hash> claimed_;
  std::condition_variable released_;
  Bytes find_locked(const Key& key, ChunkRegion* region);
  void erase_locked(const Key& key);
};

// Throws Error unless `r` (a kArrayRow request) names a row of an array of `files`.
void validate_array_row(const FileTable& files, const ReadRequest& r);

// Throws Error unless `r` (a kArrayBox request) names a box inside an array of
// `files` whose every element lands inside a buffer of `dest_size` bytes. Returns
// how many chunks the box touches.
uint64_t validate_array_box(const FileTable& files, const ReadRequest& r, uint64_t dest_size);

// Tells `cache` which tiles of JPEG-tiled arrays the boxes `boxes` (kArrayBox requests,
// validated) touch, box i in the batch numbered batches[i] (one task per batch and
// tile: the boxes of a batch come one after another), and which part of each they copy
// out; the boxes of other arrays are passed over. `fresh`: the foresight kept so far for
// the table's tiled arrays is forgotten first.
void foresee_array_boxes(const FileTable& files, const std::vector<ReadRequest>& boxes,
                         const std::vector<int64_t>& batches, ChunkCache& cache, bool fresh);

// The batch's array requests (rows and boxes), one task per chunk they touch.
ArrayPlan plan_arrays(const FileTable& files, const std::vector<ReadRequest>& requests);

// Reads and decodes the task's chunk (or takes the fill value, for a chunk
// never written) and copies its part of each of the task's rows and boxes into
// `dest`. Returns the bytes it read from the file (none when the cache had it).
uint64_t execute_array_task(const FileTable& files, const std::vector<ReadRequest>& requests,
                            const ArrayPlan& plan, const ArrayTask& task, uint8_t* dest,
                            FileCache& cache, ChunkCache& decoded);

}  // namespace stoker::io
