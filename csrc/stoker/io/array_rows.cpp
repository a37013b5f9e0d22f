#include "stoker/io/array_rows.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#include "stoker/errors.hpp"
#include "stoker/io/chunk_codec.hpp"

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

struct Axis {
  uint64_t extent, src_stride, dst_stride;  // strides in bytes
};

// The part of a row a chunk holds, as nested loops over `outer` (outermost
// first) around contiguous blocks of `block` bytes on both sides.
struct Box {
  std::vector<Axis> outer;
  uint64_t block;
  uint64_t dst_start;  // where the box starts in the row
};

Box box_of(const ArrayLayout& a, const std::vector<uint64_t>& grid_at,
           const std::vector<uint64_t>& chunk_strides) {
  const size_t rank = a.shape.size();
  std::vector<uint64_t> row_strides(rank, a.itemsize);
  for (size_t d = rank - 1; d > 1; --d) row_strides[d - 1] = row_strides[d] * a.shape[d];
  Box box{{}, a.itemsize, 0};
  for (size_t d = 1; d < rank; ++d) {
    uint64_t start = grid_at[d] * a.chunk_shape[d];
    uint64_t extent = std::min(a.chunk_shape[d], a.shape[d] - start);
    box.dst_start += start * row_strides[d];
    box.outer.push_back({extent, chunk_strides[d], row_strides[d]});
  }
  // Inner axes contiguous on both sides become part of the block.
  while (!box.outer.empty() && box.outer.back().src_stride == box.block &&
         box.outer.back().dst_stride == box.block) {
    box.block *= box.outer.back().extent;
    box.outer.pop_back();
  }
  return box;
}

// Copies the box from `src` (nullptr: the fill value) into `dst`.
void copy_box(const Box& box, const uint8_t* src, uint8_t* dst, const ArrayLayout& a) {
  auto put = [&](const uint8_t* from, uint8_t* to) {
    if (from != nullptr) {
      std::memcpy(to, from, box.block);
    } else if (a.itemsize == 1) {
      std::memset(to, a.fill[0], box.block);
    } else {
      for (uint64_t at = 0; at < box.block; at += a.itemsize) {
        std::memcpy(to + at, a.fill.data(), a.itemsize);
      }
    }
  };
  const size_t depth = box.outer.size();
  if (depth == 0) {
    put(src, dst);
    return;
  }
  for (const Axis& axis : box.outer) {
    if (axis.extent == 0) return;
  }
  std::vector<uint64_t> index(depth, 0);
  for (;;) {
    uint64_t s = 0, d = 0;
    for (size_t k = 0; k < depth; ++k) {
      s += index[k] * box.outer[k].src_stride;
      d += index[k] * box.outer[k].dst_stride;
    }
    put(src ? src + s : nullptr, dst + d);
    size_t k = depth;
    while (k > 0 && ++index[k - 1] == box.outer[k - 1].extent) index[--k] = 0;
    if (k == 0) return;
  }
}

}  // namespace

uint64_t next_layout_id() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

ChunkCache::Bytes ChunkCache::find(uint64_t layout, uint64_t chunk) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(Key{layout, chunk});
  if (it == entries_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second.position);
  return it->second.bytes;
}

void ChunkCache::put(uint64_t layout, uint64_t chunk, Bytes bytes) {
  if (bytes->size() > capacity_ / 4) return;  // one chunk never pushes out most of the rest
  std::lock_guard<std::mutex> lock(mutex_);
  Key key{layout, chunk};
  if (entries_.count(key)) return;  // decoded meanwhile by another batch: the same bytes
  bytes_ += bytes->size();
  lru_.push_front(key);
  entries_.emplace(key, Entry{std::move(bytes), lru_.begin()});
  while (bytes_ > capacity_ && !lru_.empty()) {
    auto it = entries_.find(lru_.back());
    bytes_ -= it->second.bytes->size();
    entries_.erase(it);
    lru_.pop_back();
  }
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

void validate_array_row(const FileTable& files, const ReadRequest& r) {
  if (r.array >= files.arrays.size() || !files.arrays[r.array]) {
    throw Error("read request names array " + std::to_string(r.array) + " but the table has " +
                std::to_string(files.arrays.size()));
  }
  const ArrayLayout& a = *files.arrays[r.array];
  if (r.offset >= a.shape[0]) {
    throw Error(a.name + ": row " + std::to_string(r.offset) + " of an array of " +
                std::to_string(a.shape[0]));
  }
  if (r.out_length != a.row_bytes() || r.length != 0) {
    throw Error(a.name + ": a row is " + std::to_string(a.row_bytes()) + " bytes, not " +
                std::to_string(r.out_length));
  }
}

ArrayPlan plan_array_rows(const FileTable& files, const std::vector<ReadRequest>& requests) {
  struct Piece {
    uint32_t array;
    uint64_t chunk;
    uint32_t request;
  };
  std::vector<Piece> pieces;
  for (uint32_t i = 0; i < requests.size(); ++i) {
    const ReadRequest& r = requests[i];
    if (r.codec != Codec::kArrayRow) continue;
    const ArrayLayout& a = *files.arrays[r.array];
    uint64_t per_row = a.chunks_per_row();
    uint64_t first = (r.offset / a.chunk_shape[0]) * per_row;
    for (uint64_t t = 0; t < per_row; ++t) pieces.push_back({r.array, first + t, i});
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& x, const Piece& y) {
    return x.array != y.array   ? x.array < y.array
           : x.chunk != y.chunk ? x.chunk < y.chunk
                                : x.request < y.request;
  });
  ArrayPlan plan;
  plan.rows.reserve(pieces.size());
  for (const Piece& p : pieces) {
    if (plan.tasks.empty() || plan.tasks.back().array != p.array ||
        plan.tasks.back().chunk != p.chunk) {
      plan.tasks.push_back({p.array, p.chunk, static_cast<uint32_t>(plan.rows.size()), 0});
    }
    plan.rows.push_back(p.request);
    ++plan.tasks.back().count;
  }
  return plan;
}

void execute_array_task(const FileTable& files, const std::vector<ReadRequest>& requests,
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

  Box box = box_of(a, grid_at, chunk_strides);
  const uint64_t first_row = grid_at[0] * a.chunk_shape[0];
  const uint64_t offset = a.chunk_offset[task.chunk];
  if (offset == kMissingChunk) {  // never written: the fill value
    for (uint32_t k = task.first; k < task.first + task.count; ++k) {
      const ReadRequest& r = requests[plan.rows[k]];
      copy_box(box, nullptr, dest + r.dest_offset + box.dst_start, a);
    }
    return;
  }
  const std::string& path = a.paths[a.chunk_file[task.chunk]];
  const uint64_t size = a.chunk_size[task.chunk];
  const uint32_t mask = a.chunk_mask[task.chunk];
  std::shared_ptr<const FileDescriptor> fd;
  auto open = [&] {
    if (!fd) fd = cache.get(path);
  };
  thread_local std::vector<uint8_t> raw, scratch_a, scratch_b;
  struct Shrink {  // when decoding throws too
    ~Shrink() {
      for (auto* buffer : {&raw, &scratch_a, &scratch_b}) {
        if (buffer->capacity() > kChunkScratchKeep) std::vector<uint8_t>().swap(*buffer);
      }
    }
  } shrink;

  bool filtered = a.byteswap;
  for (size_t k = 0; k < a.steps.size(); ++k) filtered |= !(k < 32 && (mask >> k) & 1);
  const uint64_t slab = chunk_strides[0];  // one row's part of the chunk, when axis 0 is outermost
  if (!filtered && size == a.chunk_bytes() && (a.order.empty() || a.order[0] == 0)) {
    // Stored as it is used: read only the rows' parts of the chunk, not all of it.
    open();
    if (raw.size() < slab) raw.resize(slab);
    for (uint32_t k = task.first; k < task.first + task.count; ++k) {
      const ReadRequest& r = requests[plan.rows[k]];
      uint64_t at = offset + (r.offset - first_row) * slab;
      uint8_t* into = dest + r.dest_offset + box.dst_start;
      if (box.outer.empty() && box.block == slab) {
        pread_exact(fd->get(), path, into, slab, at);
      } else {
        pread_exact(fd->get(), path, raw.data(), slab, at);
        copy_box(box, raw.data(), into, a);
      }
    }
    return;
  }
  ChunkCache::Bytes cached = decoded.find(a.id, task.chunk);
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
    chunk = decode_chunk(a, mask, raw.data(), size, scratch_a, scratch_b, path, offset, where);
    if (a.chunk_bytes() <= decoded.capacity() / 4) {
      decoded.put(a.id, task.chunk,
                  std::make_shared<const std::vector<uint8_t>>(chunk, chunk + a.chunk_bytes()));
    }
  }
  for (uint32_t k = task.first; k < task.first + task.count; ++k) {
    const ReadRequest& r = requests[plan.rows[k]];
    copy_box(box, chunk + (r.offset - first_row) * slab, dest + r.dest_offset + box.dst_start, a);
  }
}

}  // namespace stoker::io
