#include "stoker/io/array_rows.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "stoker/errors.hpp"
#include "stoker/io/chunk_codec.hpp"
#include "stoker/io/posix_file.hpp"
#include "stoker/io/strided_copy.hpp"

namespace stoker::io {

namespace {

// A decoded chunk is held whole by the thread decoding it: bounded so that a
// wrong or hostile layout cannot ask for more memory than a chunk may sensibly be.
constexpr uint64_t kMaxChunkBytes = uint64_t(1) << 31;
// A thread's chunk buffers are given back when a chunk needed more than this.
constexpr size_t kChunkScratchKeep = 64 * 1024 * 1024;

std::string coordinates(const std::vector<uint64_t>& at) {
  std::string out = "(";
  for (size_t d = 0; d < at.size(); ++d) out += (d ? ", " : "") + std::to_string(at[d]);
  return out + (at.size() == 1 ? ",)" : ")");
}

StridedBox box_of(const ArrayLayout& a, const std::vector<uint64_t>& grid_at,
                  const std::vector<uint64_t>& chunk_strides) {
  const size_t rank = a.shape.size();
  std::vector<uint64_t> row_strides(rank, a.itemsize);
  for (size_t d = rank - 1; d > 1; --d) row_strides[d - 1] = row_strides[d] * a.shape[d];
  StridedBox box{{}, a.itemsize, 0, 0};
  for (size_t d = 1; d < rank; ++d) {
    uint64_t start = grid_at[d] * a.chunk_shape[d];
    uint64_t extent = std::min(a.chunk_shape[d], a.shape[d] - start);
    box.dst_start += start * row_strides[d];
    box.outer.push_back({extent, chunk_strides[d], row_strides[d]});
  }
  simplify(box);
  return box;
}

// The part of box `b` that the chunk at `grid_at` holds (the plan lists only
// chunks a box touches, so it holds some). An edge chunk is stored whole: the
// box, inside the array, never reaches its padding.
StridedBox box_part(const ArrayLayout& a, const ArrayBox& b, const std::vector<uint64_t>& grid_at,
                    const std::vector<uint64_t>& chunk_strides) {
  StridedBox box{{}, a.itemsize, 0, 0};
  for (size_t d = 0; d < a.shape.size(); ++d) {
    uint64_t chunk_start = grid_at[d] * a.chunk_shape[d];
    uint64_t lo = std::max(b.start[d], chunk_start);
    uint64_t hi = std::min(b.start[d] + b.extent[d], chunk_start + a.chunk_shape[d]);
    box.src_start += (lo - chunk_start) * chunk_strides[d];
    box.dst_start += (lo - b.start[d]) * b.dest_strides[d];
    box.outer.push_back({hi - lo, chunk_strides[d], b.dest_strides[d]});
  }
  simplify(box);
  return box;
}

}  // namespace

uint64_t next_layout_id() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

ChunkCache::Bytes ChunkCache::find(uint64_t layout, uint64_t chunk, ChunkRegion* region) {
  std::lock_guard<std::mutex> lock(mutex_);
  return find_locked(Key{layout, chunk}, region);
}

ChunkCache::Bytes ChunkCache::find_or_claim(uint64_t layout, uint64_t chunk, Claim& claim,
                                            ChunkRegion* region) {
  std::unique_lock<std::mutex> lock(mutex_);
  const Key key{layout, chunk};
  // (each task claims one chunk and holds no other while it waits: no cycle to wait on)
  released_.wait(lock, [&] { return !claimed_.count(key); });
  if (Bytes found = find_locked(key, region)) return found;
  claimed_.insert(key);
  claim.cache_ = this;
  claim.layout_ = layout;
  claim.chunk_ = chunk;
  return nullptr;
}

ChunkCache::Bytes ChunkCache::find_unclaimed(uint64_t layout, uint64_t chunk, ChunkRegion* region) {
  std::unique_lock<std::mutex> lock(mutex_);
  const Key key{layout, chunk};
  released_.wait(lock, [&] { return !claimed_.count(key); });
  return find_locked(key, region);
}

ChunkCache::Claim::~Claim() {
  if (cache_ == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(cache_->mutex_);
    cache_->claimed_.erase(Key{layout_, chunk_});
  }
  cache_->released_.notify_all();
}

ChunkCache::Bytes ChunkCache::find_locked(const Key& key, ChunkRegion* region) {
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    // Too small for what is read again, and what it would have had to keep to serve that
    // fits its limit.
    if (dropped_.count(key) && capacity_ < limit_ && bytes_ + dropped_bytes_ <= limit_) {
      capacity_ = std::min(limit_, std::max<size_t>(capacity_ * 2, 1));
      forget_dropped();
    }
    return nullptr;
  }
  lru_.splice(lru_.begin(), lru_, it->second.position);
  if (region) *region = it->second.region;
  return it->second.bytes;
}

void ChunkCache::put(uint64_t layout, uint64_t chunk, Bytes bytes, const ChunkRegion& region,
                     bool replace) {
  if (bytes->size() > limit_ / 4) return;  // one chunk never pushes out most of the rest
  std::lock_guard<std::mutex> lock(mutex_);
  Key key{layout, chunk};
  if (entries_.count(key)) {
    if (!replace) return;  // decoded meanwhile by another batch: the same bytes
    erase_locked(key);
  }
  bytes_ += bytes->size();
  lru_.push_front(key);
  entries_.emplace(key, Entry{std::move(bytes), lru_.begin(), region});
  while (bytes_ > capacity_ && lru_.size() > 1) {
    const Key gone = lru_.back();
    auto it = entries_.find(gone);
    const size_t gone_bytes = it->second.bytes->size();
    bytes_ -= gone_bytes;
    entries_.erase(it);
    lru_.pop_back();
    if (capacity_ < limit_ && dropped_.insert(gone).second) {
      dropped_bytes_ += gone_bytes;
      dropped_order_.push_back(gone);
      if (dropped_order_.size() > kDroppedKept) {
        dropped_.erase(dropped_order_.front());
        dropped_order_.pop_front();
      }
      if (dropped_bytes_ > 2 * limit_) forget_dropped();
    }
  }
}

ChunkCache::MarksLoan::MarksLoan(ChunkCache& cache, uint64_t layout, uint64_t chunk)
    : cache_(cache), layout_(layout), chunk_(chunk) {
  std::lock_guard<std::mutex> lock(cache_.mutex_);
  auto it = cache_.marks_.find(Key{layout, chunk});
  if (it == cache_.marks_.end()) {
    if (cache_.mark_bytes_ >= kMarkBytes) return;
    it = cache_.marks_.emplace(Key{layout, chunk}, MarkedTile{}).first;
  } else if (it->second.lent) {
    return;
  }
  it->second.lent = true;
  tile_ = &it->second;
}

ChunkCache::MarksLoan::~MarksLoan() {
  if (tile_ == nullptr) return;
  std::lock_guard<std::mutex> lock(cache_.mutex_);
  if (tile_->marks.marks.empty()) {  // (not a tile marks are made for)
    cache_.mark_bytes_ -= tile_->counted;
    cache_.marks_.erase(Key{layout_, chunk_});
    return;
  }
  tile_->lent = false;
  // (with the map's node: small tiles' marks are not much larger)
  const size_t bytes = tile_->marks.bytes() + sizeof(Key) + sizeof(MarkedTile) + 32;
  cache_.mark_bytes_ += bytes - tile_->counted;
  tile_->counted = bytes;
}

std::shared_ptr<ByteVector> ChunkCache::buffer(size_t size) {
  std::unique_ptr<ByteVector> spare;
  {
    std::lock_guard<std::mutex> lock(spares_->mutex);
    auto& list = spares_->buffers;
    for (size_t i = list.size(); i-- > 0;) {
      if (list[i]->size() == size) {
        spare = std::move(list[i]);
        list[i] = std::move(list.back());
        list.pop_back();
        spares_->bytes -= size;
        break;
      }
    }
  }
  if (!spare) {
    // While the cache fills, its memory is fresh from the kernel: the pages are made
    // present in one call rather than faulted in one by one.
    spare = std::make_unique<ByteVector>(size);
    populate_for_write(spare->data(), size);
  }
  std::weak_ptr<Spares> home = spares_;
  return std::shared_ptr<ByteVector>(spare.release(), [home](ByteVector* given_back) {
    if (auto spares = home.lock()) {
      std::lock_guard<std::mutex> lock(spares->mutex);
      if (spares->bytes + given_back->size() <= kSpareBytes) {
        try {
          spares->buffers.emplace_back(given_back);
          spares->bytes += given_back->size();
          return;
        } catch (const std::bad_alloc&) {  // (no room to list it: freed instead)
        }
      }
    }
    delete given_back;
  });
}

void ChunkCache::erase(uint64_t layout, uint64_t chunk) {
  std::lock_guard<std::mutex> lock(mutex_);
  erase_locked(Key{layout, chunk});
}

void ChunkCache::erase_locked(const Key& key) {
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  bytes_ -= it->second.bytes->size();
  lru_.erase(it->second.position);
  entries_.erase(it);
}

void ChunkCache::foresee(uint64_t layout, const std::vector<std::pair<uint64_t, Foresight>>& chunks,
                         bool fresh) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fresh) {
    for (auto it = foresight_.begin(); it != foresight_.end();) {
      it = it->first.layout == layout ? foresight_.erase(it) : std::next(it);
    }
  }
  for (const auto& [chunk, ahead] : chunks) {
    Foresight& f = foresight_[Key{layout, chunk}];
    f.tasks_left += ahead.tasks_left;
    f.region = covering(f.region, ahead.region);
    f.keep = f.keep || ahead.keep;
  }
}

bool ChunkCache::take_foresight(uint64_t layout, uint64_t chunk, Foresight& seen) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = foresight_.find(Key{layout, chunk});
  if (it == foresight_.end()) return false;
  seen = it->second;
  if (seen.tasks_left > 0) --seen.tasks_left;
  if (seen.tasks_left == 0) {
    foresight_.erase(it);
  } else {
    it->second.tasks_left = seen.tasks_left;
  }
  return true;
}

void ChunkCache::forget_dropped() {
  dropped_.clear();
  dropped_order_.clear();
  dropped_bytes_ = 0;
}

void ArrayLayout::check() const {
  auto bad = [this](const std::string& what) { return Error(name + ": " + what); };
  const size_t rank = shape.size();
  if (rank == 0 || chunk_shape.size() != rank) {
    throw bad("an array source needs a shape of rank 1 or more, and a chunk shape of the same");
  }
  if (itemsize == 0 || fill.size() != itemsize) throw bad("fill must be one element");
  uint64_t elements = 1;
  for (size_t d = 0; d < rank; ++d) {
    if (chunk_shape[d] == 0) throw bad("a chunk shape may not hold 0");
    if (elements > kMaxChunkBytes / chunk_shape[d]) throw bad("chunks too large");
    elements *= chunk_shape[d];
  }
  if (elements > kMaxChunkBytes / itemsize) {
    throw bad("chunks of " + std::to_string(elements) + " elements are too large (at most " +
              std::to_string(kMaxChunkBytes) + " bytes)");
  }
  if (!order.empty()) {
    std::vector<bool> seen(rank, false);
    if (order.size() != rank) throw bad("order must name every axis once");
    for (uint32_t axis : order) {
      if (axis >= rank || seen[axis]) throw bad("order must name every axis once");
      seen[axis] = true;
    }
  }
  if (steps.size() > 32) throw bad("more than 32 filters");
  for (size_t k = 0; k < steps.size(); ++k) {
    const ChunkStep& step = steps[k];
    if (step.filter == ChunkFilter::kJpeg) {
      if (itemsize != 1)
        throw bad("JPEG chunks hold 8-bit samples, not " + std::to_string(itemsize) + "-byte ones");
      if (step.param != kJpegYCbCr && step.param != kJpegRgb) {
        throw bad("a JPEG step's colour space is 0 (YCbCr) or 1 (RGB), not " +
                  std::to_string(step.param));
      }
      if (!order.empty()) throw bad("JPEG chunks are in C order");
    } else if (step.filter == ChunkFilter::kHorizontalPredictor) {
      uint32_t bytes = step.param;
      if (bytes != itemsize || (bytes != 1 && bytes != 2 && bytes != 4 && bytes != 8)) {
        throw bad("the horizontal predictor's element size is " + std::to_string(bytes) +
                  " bytes, but elements of this array are " + std::to_string(itemsize));
      }
      if (!order.empty()) throw bad("chunks with the horizontal predictor are in C order");
      // Its differences are of values, which a big-endian file stores swapped: they are
      // swapped back before the sums, and no earlier step may see swapped bytes.
      if (byteswap && itemsize > 1 && k != 0) {
        throw bad("the horizontal predictor of a big-endian array must be the first step");
      }
    } else if (static_cast<uint8_t>(step.filter) >
               static_cast<uint8_t>(ChunkFilter::kHorizontalPredictor)) {
      throw bad("unknown filter " + std::to_string(int(step.filter)));
    }
  }
  if (clipped_edge && !order.empty()) throw bad("a clipped edge needs chunks in C order");
  if (!jpeg_tables.empty() && std::none_of(steps.begin(), steps.end(), [](const ChunkStep& s) {
        return s.filter == ChunkFilter::kJpeg;
      })) {
    throw bad("JPEG tables without a JPEG step");
  }
  uint64_t n = num_chunks();
  if (chunk_file.size() != n || chunk_offset.size() != n || chunk_size.size() != n ||
      chunk_mask.size() != n) {
    throw bad("expected " + std::to_string(n) + " chunks in each chunk column");
  }
  for (uint64_t c = 0; c < n; ++c) {
    if (chunk_offset[c] != kMissingChunk && chunk_file[c] >= paths.size()) {
      throw bad("chunk " + std::to_string(c) + " names a file not in paths");
    }
  }
}

namespace {

const ArrayLayout& array_of(const FileTable& files, const ReadRequest& r) {
  if (r.array >= files.arrays.size() || !files.arrays[r.array]) {
    throw Error("read request names array " + std::to_string(r.array) + " but the table has " +
                std::to_string(files.arrays.size()));
  }
  return *files.arrays[r.array];
}

// a * b, or false where it overflows.
bool multiply(uint64_t a, uint64_t b, uint64_t& out) {
  if (a != 0 && b > UINT64_MAX / a) return false;
  out = a * b;
  return true;
}

}  // namespace

void validate_array_row(const FileTable& files, const ReadRequest& r) {
  const ArrayLayout& a = array_of(files, r);
  if (r.offset >= a.shape[0]) {
    throw Error(a.name + ": row " + std::to_string(r.offset) + " of an array of " +
                std::to_string(a.shape[0]));
  }
  if (r.out_length != a.row_bytes() || r.length != 0) {
    throw Error(a.name + ": a row is " + std::to_string(a.row_bytes()) + " bytes, not " +
                std::to_string(r.out_length));
  }
}

uint64_t validate_array_box(const FileTable& files, const ReadRequest& r, uint64_t dest_size) {
  const ArrayLayout& a = array_of(files, r);
  if (!r.box) throw Error(a.name + ": an ARRAY_BOX request without its box");
  if (r.decoder) throw Error(a.name + ": an ARRAY_BOX request takes no decoder");
  const ArrayBox& b = *r.box;
  const size_t rank = a.shape.size();
  if (b.start.size() != rank || b.extent.size() != rank || b.dest_strides.size() != rank) {
    throw Error(a.name + ": a box with " + std::to_string(b.start.size()) + " starts, " +
                std::to_string(b.extent.size()) + " extents and " +
                std::to_string(b.dest_strides.size()) + " strides, of an array of rank " +
                std::to_string(rank));
  }
  for (size_t d = 0; d < rank; ++d) {
    if (b.extent[d] > a.shape[d] || b.start[d] > a.shape[d] - b.extent[d]) {
      throw Error(a.name + ": the box from " + coordinates(b.start) + " of extent " +
                  coordinates(b.extent) + " is not inside the array's shape " +
                  coordinates(a.shape));
    }
  }
  // Nothing to read, nothing written.
  if (std::find(b.extent.begin(), b.extent.end(), 0) != b.extent.end()) return 0;
  uint64_t chunks = 1;
  uint64_t last = 0;  // the last element's byte offset past dest_offset
  for (size_t d = 0; d < rank; ++d) {
    uint64_t first = b.start[d] / a.chunk_shape[d];
    uint64_t touched = (b.start[d] + b.extent[d] - 1) / a.chunk_shape[d] - first + 1;
    if (!multiply(chunks, touched, chunks)) chunks = UINT64_MAX;
    uint64_t step = 0;
    if (!multiply(b.extent[d] - 1, b.dest_strides[d], step) || last + step < last) {
      throw Error(a.name + ": the box's destination strides overflow");
    }
    last += step;
  }
  if (r.dest_offset > dest_size || last > dest_size - r.dest_offset ||
      a.itemsize > dest_size - r.dest_offset - last) {
    throw Error(a.name + ": a box at buffer offset " + std::to_string(r.dest_offset) +
                " whose last element ends " + std::to_string(last + a.itemsize) +
                " bytes further does not fit a buffer of " + std::to_string(dest_size));
  }
  return chunks;
}

namespace {

// Calls `f(chunk)` for every chunk box `b` touches, in C order, with `at` its place in
// the grid (none for an empty box).
template <class F>
void each_chunk_of(const ArrayLayout& a, const ArrayBox& b, std::vector<uint64_t>& at, F&& f) {
  const size_t rank = a.shape.size();
  if (std::find(b.extent.begin(), b.extent.end(), 0) != b.extent.end()) return;
  std::vector<uint64_t> lo(rank), hi(rank);
  for (size_t d = 0; d < rank; ++d) {
    lo[d] = b.start[d] / a.chunk_shape[d];
    hi[d] = (b.start[d] + b.extent[d] - 1) / a.chunk_shape[d];
  }
  at = lo;
  for (;;) {
    uint64_t chunk = 0;
    for (size_t d = 0; d < rank; ++d) chunk = chunk * a.grid(d) + at[d];
    f(chunk);
    size_t d = rank;
    for (; d > 0; --d) {
      if (at[d - 1] < hi[d - 1]) {
        ++at[d - 1];
        break;
      }
      at[d - 1] = lo[d - 1];
    }
    if (d == 0) break;
  }
}

// Tiles of JPEG (a layout of one JPEG step, chunks of [rows, columns, samples] in their
// last three axes), which can be decoded in part.
bool jpeg_tiles(const ArrayLayout& a) {
  return a.steps.size() == 1 && a.steps[0].filter == ChunkFilter::kJpeg && a.shape.size() >= 3;
}

// The rows and columns of the JPEG tile at `grid_at` that box `b` covers, in the tile's
// own coordinates.
ChunkRegion part_in_tile(const ArrayLayout& a, const ArrayBox& b,
                         const std::vector<uint64_t>& grid_at) {
  const size_t rank = a.shape.size();
  uint32_t lo[2], hi[2];
  const size_t axes[2] = {rank - 3, rank - 2};
  for (int i = 0; i < 2; ++i) {
    const size_t d = axes[i];
    const uint64_t origin = grid_at[d] * a.chunk_shape[d];
    lo[i] = uint32_t(std::max(b.start[d], origin) - origin);
    hi[i] = uint32_t(std::min(b.start[d] + b.extent[d], origin + a.chunk_shape[d]) - origin);
  }
  return {lo[0], hi[0], lo[1], hi[1]};
}

// What decoding `part` of a JPEG tile costs, in whole-tile decodes: the entropy decoding
// runs from the tile's top to the part's last row whatever the columns, the rest
// (inverse DCT, upsampling, colour) only over the part. Measured on 256^2 4:2:0 tiles of
// a slide (benchmarks/volumes.py), entropy decoding is about 37% of a whole decode.
double decode_cost(const ArrayLayout& a, const ChunkRegion& part) {
  constexpr double kEntropyShare = 0.37;
  const size_t rank = a.shape.size();
  const double rows = double(a.chunk_shape[rank - 3]), columns = double(a.chunk_shape[rank - 2]);
  const double area = double(part.row1 - part.row0) * double(part.col1 - part.col0);
  return kEntropyShare * part.row1 / rows + (1 - kEntropyShare) * area / (rows * columns);
}

// Keeping a tile's decoded part for later tasks, in whole-tile decodes: its buffer (a new
// one's pages made present), and that memory's share of a cache that holds fewer other
// tiles.
constexpr double kKeepCost = 0.05;

}  // namespace

void foresee_array_boxes(const FileTable& files, const std::vector<ReadRequest>& boxes,
                         const std::vector<int64_t>& batches, ChunkCache& cache, bool fresh) {
  struct Ahead {
    ChunkCache::Foresight foresight;
    int64_t last_batch = -1;
    double apart = 0;  // the cost of decoding each task's part on its own
  };
  std::unordered_map<uint32_t, std::unordered_map<uint64_t, Ahead>> by_array;
  std::vector<uint64_t> at;
  for (size_t i = 0; i < boxes.size(); ++i) {
    const ReadRequest& r = boxes[i];
    const ArrayLayout& a = *files.arrays[r.array];
    if (r.codec != Codec::kArrayBox || !jpeg_tiles(a)) continue;
    auto& chunks = by_array[r.array];
    each_chunk_of(a, *r.box, at, [&](uint64_t chunk) {
      if (a.chunk_offset[chunk] == kMissingChunk) return;  // the fill value: nothing decoded
      Ahead& ahead = chunks[chunk];
      const ChunkRegion part = part_in_tile(a, *r.box, at);
      if (ahead.last_batch != batches[i]) {  // a batch reads a tile in one task
        ahead.last_batch = batches[i];
        ++ahead.foresight.tasks_left;
      }
      // (boxes of one batch share a task: counted apart here, a bound on that cost)
      ahead.apart += decode_cost(a, part);
      ahead.foresight.region = covering(ahead.foresight.region, part);
    });
  }
  std::vector<std::pair<uint64_t, ChunkCache::Foresight>> listed;
  for (auto& [array, chunks] : by_array) {
    const ArrayLayout& a = *files.arrays[array];
    listed.clear();
    for (auto& [chunk, ahead] : chunks) {
      ChunkCache::Foresight& f = ahead.foresight;
      f.keep = f.tasks_left > 1 && a.chunk_bytes() <= cache.limit() / 4 &&
               decode_cost(a, f.region) + kKeepCost < ahead.apart;
      listed.emplace_back(chunk, f);
    }
    cache.foresee(a.id, listed, fresh);
  }
  if (fresh) {  // the table's other tiled arrays too: none of their boxes is ahead
    for (uint32_t array = 0; array < files.arrays.size(); ++array) {
      if (!by_array.count(array) && jpeg_tiles(*files.arrays[array])) {
        cache.foresee(files.arrays[array]->id, {}, true);
      }
    }
  }
}

ArrayPlan plan_arrays(const FileTable& files, const std::vector<ReadRequest>& requests) {
  struct Piece {
    uint32_t array;
    uint64_t chunk;
    uint32_t request;
  };
  std::vector<Piece> pieces;
  std::vector<uint64_t> at;
  for (uint32_t i = 0; i < requests.size(); ++i) {
    const ReadRequest& r = requests[i];
    if (r.codec == Codec::kArrayRow) {
      const ArrayLayout& a = *files.arrays[r.array];
      uint64_t per_row = a.chunks_per_row();
      uint64_t first = (r.offset / a.chunk_shape[0]) * per_row;
      for (uint64_t t = 0; t < per_row; ++t) pieces.push_back({r.array, first + t, i});
    } else if (r.codec == Codec::kArrayBox) {
      each_chunk_of(*files.arrays[r.array], *r.box, at, [&](uint64_t chunk) {
        pieces.push_back({r.array, chunk, i});
      });
    }
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& x, const Piece& y) {
    return x.array != y.array   ? x.array < y.array
           : x.chunk != y.chunk ? x.chunk < y.chunk
                                : x.request < y.request;
  });
  ArrayPlan plan;
  plan.requests.reserve(pieces.size());
  for (const Piece& p : pieces) {
    if (plan.tasks.empty() || plan.tasks.back().array != p.array ||
        plan.tasks.back().chunk != p.chunk) {
      plan.tasks.push_back({p.array, p.chunk, static_cast<uint32_t>(plan.requests.size()), 0});
    }
    plan.requests.push_back(p.request);
    ++plan.tasks.back().count;
  }
  return plan;
}

namespace {

// The part of the JPEG tile of `task` that its boxes copy out.
ChunkRegion task_part(const ArrayLayout& a, const std::vector<ReadRequest>& requests,
                      const ArrayPlan& plan, const ArrayTask& task,
                      const std::vector<uint64_t>& grid_at) {
  ChunkRegion part{UINT32_MAX, 0, UINT32_MAX, 0};
  for (uint32_t k = task.first; k < task.first + task.count; ++k) {
    part = covering(part, part_in_tile(a, *requests[plan.requests[k]].box, grid_at));
  }
  return part;
}

}  // namespace

uint64_t execute_array_task(const FileTable& files, const std::vector<ReadRequest>& requests,
                            const ArrayPlan& plan, const ArrayTask& task, uint8_t* dest,
                            FileCache& cache, ChunkCache& decoded) {
  const ArrayLayout& a = *files.arrays[task.array];
  const size_t rank = a.shape.size();
  std::vector<uint64_t> grid_at(rank);
  uint64_t rest = task.chunk;
  for (size_t d = rank; d-- > 0;) {
    grid_at[d] = rest % a.grid(d);
    rest /= a.grid(d);
  }
  // Byte strides of the decoded chunk, along each logical axis.
  std::vector<uint64_t> chunk_strides(rank);
  uint64_t stride = a.itemsize;
  for (size_t p = rank; p-- > 0;) {
    size_t axis = a.order.empty() ? p : a.order[p];
    chunk_strides[axis] = stride;
    stride *= a.chunk_shape[axis];
  }

  bool rows = false, boxes = false;
  for (uint32_t k = task.first; k < task.first + task.count; ++k) {
    (requests[plan.requests[k]].codec == Codec::kArrayBox ? boxes : rows) = true;
  }
  StridedBox box = rows ? box_of(a, grid_at, chunk_strides) : StridedBox{};
  const uint64_t first_row = grid_at[0] * a.chunk_shape[0];
  const uint64_t slab = chunk_strides[0];  // one row's part of the chunk, when axis 0 is outermost
  // Copies each request's part of the decoded `chunk` (nullptr: the fill value).
  auto serve = [&](const uint8_t* chunk) {
    for (uint32_t k = task.first; k < task.first + task.count; ++k) {
      const ReadRequest& r = requests[plan.requests[k]];
      if (r.codec == Codec::kArrayBox) {
        StridedBox part = box_part(a, *r.box, grid_at, chunk_strides);
        copy_strided(part, chunk ? chunk + part.src_start : nullptr,
                     dest + r.dest_offset + part.dst_start, a.fill);
      } else {
        copy_strided(box, chunk ? chunk + (r.offset - first_row) * slab : nullptr,
                     dest + r.dest_offset + box.dst_start, a.fill);
      }
    }
  };
  const uint64_t offset = a.chunk_offset[task.chunk];
  if (offset == kMissingChunk) {  // never written: the fill value
    serve(nullptr);
    return 0;
  }
  const std::string& path = a.paths[a.chunk_file[task.chunk]];
  const uint64_t size = a.chunk_size[task.chunk];
  const uint32_t mask = a.chunk_mask[task.chunk];
  std::shared_ptr<const FileDescriptor> fd;
  auto open = [&] {
    if (!fd) fd = cache.get(path);
  };
  thread_local std::vector<uint8_t> raw, scratch_a, scratch_b;
  thread_local ByteVector reach_scratch;
  struct Shrink {  // when decoding throws too
    ~Shrink() {
      for (auto* buffer : {&raw, &scratch_a, &scratch_b}) {
        give_back_if_larger(*buffer, kChunkScratchKeep);
      }
      give_back_if_larger(reach_scratch, kChunkScratchKeep);
    }
  } shrink;

  bool filtered = a.byteswap;
  for (size_t k = 0; k < a.steps.size(); ++k) filtered |= !(k < 32 && (mask >> k) & 1);
  // A box takes the whole chunk, decoded once and kept for the next batch's boxes: patches
  // of a volume overlap from batch to batch far more than rows of a shuffled epoch do.
  if (!boxes && !filtered && size == a.chunk_bytes() && (a.order.empty() || a.order[0] == 0)) {
    // Stored as it is used: read only the rows' parts of the chunk, not all of it.
    open();
    if (raw.size() < slab) raw.resize(slab);
    for (uint32_t k = task.first; k < task.first + task.count; ++k) {
      const ReadRequest& r = requests[plan.requests[k]];
      uint64_t at = offset + (r.offset - first_row) * slab;
      uint8_t* into = dest + r.dest_offset + box.dst_start;
      if (box.outer.empty() && box.block == slab) {
        pread_exact(fd->get(), path, into, slab, at);
      } else {
        pread_exact(fd->get(), path, raw.data(), slab, at);
        copy_strided(box, raw.data(), into, a.fill);
      }
    }
    return slab * task.count;
  }
  if (boxes && !rows && !filtered && size == a.chunk_bytes()) {
    // Stored as it is used (an uncompressed tile or chunk): a box's part of it is a few
    // strided runs, and only the bytes from its first element to its last are read, from
    // the file's mapping where it has one. A random patch of a slide spans half the rows
    // of each of its four tiles, on average: half the bytes of reading the tiles whole.
    // Boxes that together reach further than the chunk holds read it whole, once, below.
    thread_local std::vector<std::pair<StridedBox, uint64_t>> parts;  // and each one's reach
    parts.clear();
    uint64_t reaches = 0;
    for (uint32_t k = task.first; k < task.first + task.count; ++k) {
      StridedBox part = box_part(a, *requests[plan.requests[k]].box, grid_at, chunk_strides);
      const uint64_t reach = source_reach(part);
      parts.emplace_back(std::move(part), reach);
      reaches += reach;
    }
    if (reaches < size) {
      open();
      uint64_t seen_size = kSizeUnseen;
      for (uint32_t k = task.first; k < task.first + task.count; ++k) {
        const auto& [part, reach] = parts[k - task.first];
        if (reach == 0) continue;
        const uint8_t* from =
            bytes_at(*fd, path, offset + part.src_start, reach, reach_scratch, &seen_size);
        copy_strided(part, from, dest + requests[plan.requests[k]].dest_offset + part.dst_start,
                     a.fill);
      }
      return reaches;
    }
  }
  uint64_t read = 0;
  // What the boxes of a task on a JPEG tile copy out of it: only that part need be decoded.
  const bool tile = !rows && filtered && jpeg_tiles(a);
  const ChunkRegion wanted = tile ? task_part(a, requests, plan, task, grid_at) : ChunkRegion{};
  const bool small_part =
      tile && 2 * uint64_t(wanted.row1 - wanted.row0) * (wanted.col1 - wanted.col0) <=
                  a.chunk_shape[rank - 3] * a.chunk_shape[rank - 2];
  ChunkRegion region;             // what a decode here decodes (default: all of it)
  uint64_t keep_as = task.chunk;  // and the key it is kept under
  bool keep = filtered;
  bool replace = false;
  // A chunk stored as it is used is not kept: the page cache holds its bytes already, and
  // reading them again costs one copy, as keeping them would. A chunk that will be kept is
  // claimed: a task on another thread (the rows of one box spread over several, or the
  // next batch's boxes) that wants it meanwhile waits for its bytes instead of reading it
  // too. A tile decoded in part for one task alone is not kept, so nobody waits for it.
  ChunkCache::Claim claim;
  ChunkCache::Bytes cached;
  ChunkCache::Foresight seen;
  if (tile && decoded.take_foresight(a.id, task.chunk, seen)) {
    // Foreseen (see ChunkCache): decoded once for the tasks ahead, only the part they
    // take, and kept until the last of them; or, where that would cost more, each task's
    // part alone.
    cached = decoded.find(a.id, task.chunk);  // kept whole from before
    ChunkRegion held;
    const uint64_t part_key = task.chunk | ChunkCache::kPartOfChunk;
    if (!cached && seen.keep && seen.tasks_left > 0) {
      cached = decoded.find_or_claim(a.id, part_key, claim, &held);
      region = covering(seen.region, wanted);
      if (cached && !held.holds(wanted)) {  // kept for other boxes (an earlier window's)
        cached = nullptr;
        region = covering(region, held);
        replace = true;
      }
      keep_as = part_key;
    } else if (!cached) {
      // (a task keeping its part for this one, on another thread, is waited for)
      cached = decoded.find_unclaimed(a.id, part_key, &held);
      if (cached && !held.holds(wanted)) cached = nullptr;
      // The last task on it lets it go (its bytes live on in `cached`).
      if (cached && seen.tasks_left == 0) decoded.erase(a.id, part_key);
      if (!cached && !small_part) {
        cached = decoded.find_or_claim(a.id, task.chunk, claim);
      } else {
        region = wanted;
        keep = false;
      }
    }
  } else if (small_part) {
    // A JPEG tile not kept from before, of which the boxes need a small part: only that
    // part is decoded, and the tile is not kept (a random patch of a slide covers a
    // quarter of each of its four tiles, on average; most tiles are never drawn again).
    cached = decoded.find(a.id, task.chunk);
    region = wanted;
    keep = false;
  } else if (filtered) {
    cached = decoded.find_or_claim(a.id, task.chunk, claim);
  }
  const uint8_t* chunk = cached ? cached->data() : nullptr;
  if (chunk == nullptr) {
    std::string where = coordinates(grid_at);
    if (size > kMaxChunkBytes) {
      throw FormatError(path, offset,
                        a.name + ", chunk " + where + ": a stored size of " + std::to_string(size) +
                            " bytes is more than a chunk may be");
    }
    if (raw.size() < size) raw.resize(size);
    open();
    pread_exact(fd->get(), path, raw.data(), size, offset);
    read = size;
    // A clipped edge's chunk is only the part inside the array, and only that is
    // ever copied out: C order puts it first.
    const uint64_t bytes = a.decoded_bytes(task.chunk);
    keep = keep && bytes <= decoded.limit() / 4;
    std::shared_ptr<ByteVector> kept = keep ? decoded.buffer(bytes) : nullptr;
    // A JPEG tile's marks: the reader's, or, where it keeps none for the tile (another
    // decode holds them, or they are over budget), this decode's own, so that every
    // decode of a tile steps over the same MCUs and fails alike when the tile is cut short.
    std::optional<ChunkCache::MarksLoan> loan;
    thread_local image::detail::EntropyMarks unkept;
    image::detail::EntropyMarks* marks = nullptr;
    if (jpeg_tiles(a)) {
      marks = loan.emplace(decoded, a.id, task.chunk).get();
      if (marks == nullptr) {
        unkept.marks.clear();
        marks = &unkept;
      }
    }
    chunk = decode_chunk(a, mask, raw.data(), size, bytes, scratch_a, scratch_b, path, offset,
                         where, region, kept ? kept->data() : nullptr, marks);
    if (kept) {
      if (chunk != kept->data() && bytes) std::memcpy(kept->data(), chunk, bytes);
      decoded.put(a.id, keep_as, kept, region, replace);
      cached = std::move(kept);  // held while it is served: the cache may let go of it
    }
  }
  serve(chunk);
  return read;
}

}  // namespace stoker::io
