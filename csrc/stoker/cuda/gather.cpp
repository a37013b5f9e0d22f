#include "stoker/cuda/gather.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "stoker/errors.hpp"

namespace stoker::cuda {

namespace {

// A span is read in pieces of this, so that one long span is shared by threads.
constexpr uint64_t kReadPiece = uint64_t{4} << 20;
// CU_DEVICE_ATTRIBUTE_MAX_PITCH of every current GPU; a 2-D copy with a wider
// pitch would be refused, so such runs are copied one by one instead.
constexpr uint64_t kMaxPitch = (uint64_t{1} << 31) - 1;
constexpr CUresult kInvalidValue = 1;

// A run, or a part of one longer than the scratch.
struct Piece {
  uint32_t file;
  uint64_t offset;
  uint64_t length;
  uint64_t dest;
};

// Offsets into the scratch (src) and the destination (dst); one row when height is 1.
struct Copy {
  uint64_t src, dst, width, height, src_pitch, dst_pitch;
};

// A stretch of a file read into the scratch at `at`.
struct Region {
  uint32_t file;
  uint64_t start, end, at;
};

// A run's bytes in the scratch, and where they go.
struct Row {
  uint64_t src, dst, length;
};

struct Round {
  std::vector<Region> regions;
  std::vector<Row> rows;
  std::vector<Copy> copies;
};

// Turns rows to copy, taken in order, into fewer copies: rows that continue
// each other in both memories into one longer row, rows of one width at
// constant strides in both into one 2-D copy.
class Grouper {
 public:
  explicit Grouper(std::vector<Copy>* out) : out_(out) {}

  void add(uint64_t src, uint64_t dst, uint64_t length) {
    if (open_) {
      Copy& g = group_;
      if (g.height == 1 && src == g.src + g.width && dst == g.dst + g.width) {
        g.width += length;
        return;
      }
      if (g.height == 1 && length == g.width && src >= g.src + length && dst >= g.dst + length &&
          src - g.src <= kMaxPitch && dst - g.dst <= kMaxPitch) {
        g.src_pitch = src - g.src;
        g.dst_pitch = dst - g.dst;
        g.height = 2;
        return;
      }
      if (g.height >= 2 && length == g.width && src == last_src() + g.src_pitch &&
          dst == last_dst() + g.dst_pitch) {
        ++g.height;
        return;
      }
      out_->push_back(g);
    }
    group_ = Copy{src, dst, length, 1, 0, 0};
    open_ = true;
  }

  void flush() {
    if (open_) out_->push_back(group_);
    open_ = false;
  }

  // Where in the scratch a row of `length` bound for `dst` would have to be to
  // extend the open copy; nothing when no place would.
  std::optional<uint64_t> continuation(uint64_t dst, uint64_t length) const {
    if (!open_) return std::nullopt;
    const Copy& g = group_;
    if (g.height == 1 && dst == g.dst + g.width) return g.src + g.width;
    if (g.height >= 2 && length == g.width && dst == last_dst() + g.dst_pitch) {
      return last_src() + g.src_pitch;
    }
    return std::nullopt;
  }

 private:
  uint64_t last_src() const { return group_.src + (group_.height - 1) * group_.src_pitch; }
  uint64_t last_dst() const { return group_.dst + (group_.height - 1) * group_.dst_pitch; }

  std::vector<Copy>* out_;
  Copy group_{};
  bool open_ = false;
};

uint64_t align_down(uint64_t x, uint64_t a) { return x / a * a; }
uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// The copies of a round: its rows in destination order, in which the rows of
// a patch follow each other even where patches of one file overlap in it (in
// file order their rows interleave).
void group_rows(Round& round) {
  std::stable_sort(round.rows.begin(), round.rows.end(),
                   [](const Row& a, const Row& b) { return a.dst < b.dst; });
  Grouper grouper(&round.copies);
  for (const Row& r : round.rows) grouper.add(r.src, r.dst, r.length);
  grouper.flush();
  round.rows = {};
}

// Fills the scratch span by span in file order; a span that does not fit
// starts a new round. Each span goes where it continues the copy the last one
// left open (as far as file order tells) if that place is free, else at the
// next aligned place, else right after the last span.
std::vector<Round> plan(const std::vector<Piece>& pieces, const std::vector<uint64_t>& file_sizes,
                        uint64_t scratch_address, uint64_t scratch_bytes,
                        const GatherOptions& options) {
  const uint64_t align = std::max<uint64_t>(options.align, 1);
  const uint64_t gap = options.merge_gap;
  std::vector<Round> rounds(1);
  std::vector<Copy> closed;  // what the file-order grouping closes: only its open copy matters
  Grouper grouper(&closed);
  uint64_t cursor = 0;     // where the last region's read ends in the scratch
  uint64_t exact_end = 0;  // where its last run ends (its read can be cut back to it)
  uint64_t exact_file_end = 0;
  size_t i = 0;
  while (i < pieces.size()) {
    const Piece& first = pieces[i];
    uint64_t start = first.offset;
    uint64_t reach = first.offset + first.length;
    size_t j = i + 1;
    for (; j < pieces.size(); ++j) {
      const Piece& p = pieces[j];
      uint64_t end = std::max(reach, p.offset + p.length);
      bool near = p.offset < reach || p.offset - reach < gap;
      if (p.file != first.file || !near || end - start > scratch_bytes) break;
      reach = end;
    }
    const uint64_t exact = reach - start;
    Round* round = &rounds.back();
    std::optional<Region> placed;
    if (!round->regions.empty()) {
      std::optional<uint64_t> at = grouper.continuation(first.dest, first.length);
      if (at && *at >= exact_end && *at <= scratch_bytes && exact <= scratch_bytes - *at) {
        if (*at < cursor) round->regions.back().end = exact_file_end;  // its padding would clash
        placed = Region{first.file, start, reach, *at};
      }
    }
    for (int attempt = 0; !placed && attempt < 2; ++attempt) {
      if (attempt == 1) {  // the scratch is full: a new round starts at its beginning
        group_rows(*round);
        rounds.emplace_back();
        round = &rounds.back();
        grouper.flush();
        closed.clear();
        cursor = 0;
      }
      if (align > 1) {
        uint64_t from = align_down(start, align);
        uint64_t to = std::max(reach, std::min(align_up(reach, align), file_sizes[first.file]));
        uint64_t at = align_up(scratch_address + cursor, align) - scratch_address;
        if (at <= scratch_bytes && to - from <= scratch_bytes - at) {
          placed = Region{first.file, from, to, at};
          break;
        }
      }
      if (exact <= scratch_bytes - cursor) placed = Region{first.file, start, reach, cursor};
    }
    // A span never exceeds the scratch, so an empty one always takes it.
    const Region& region = *placed;
    round->regions.push_back(region);
    for (size_t k = i; k < j; ++k) {
      uint64_t src = region.at + (pieces[k].offset - region.start);
      grouper.add(src, pieces[k].dest, pieces[k].length);
      round->rows.push_back(Row{src, pieces[k].dest, pieces[k].length});
    }
    closed.clear();
    cursor = region.at + (region.end - region.start);
    exact_end = region.at + (reach - region.start);
    exact_file_end = reach;
    i = j;
  }
  group_rows(rounds.back());
  return rounds;
}

void validate(const std::vector<std::shared_ptr<CuFile>>& files, int device, CUdeviceptr dest,
              uint64_t dest_bytes, CUdeviceptr scratch, uint64_t scratch_bytes,
              const GatherRuns& runs) {
  constexpr uint64_t kMaxOffset = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  bool any = false;
  for (size_t i = 0; i < runs.count; ++i) {
    uint64_t length = runs.lengths[i];
    if (length == 0) continue;
    uint32_t id = runs.file_ids[i];
    if (id >= files.size()) {
      throw Error("run " + std::to_string(i) + " names file " + std::to_string(id) + " of " +
                  std::to_string(files.size()));
    }
    const std::shared_ptr<CuFile>& file = files[id];
    if (!file)
      throw Error("run " + std::to_string(i) + ": file " + std::to_string(id) + " is not open");
    if (file->device() != device) {
      throw Error(file->path(), runs.offsets[i],
                  "opened for device " + std::to_string(file->device()) + ", read for device " +
                      std::to_string(device));
    }
    if (runs.offsets[i] > kMaxOffset || length > kMaxOffset - runs.offsets[i]) {
      throw Error(file->path(), runs.offsets[i],
                  "run " + std::to_string(i) + " of " + std::to_string(length) +
                      " bytes lies past any file's end");
    }
    uint64_t at = runs.dest_offsets[i];
    if (length > dest_bytes || at > dest_bytes - length) {
      throw Error(file->path(), runs.offsets[i],
                  "run " + std::to_string(i) + " of " + std::to_string(length) +
                      " bytes is bound for destination bytes [" + std::to_string(at) + ", " +
                      std::to_string(at + length) + "), outside its " + std::to_string(dest_bytes));
    }
    any = true;
  }
  if (any && dest == 0) throw Error("gather_to_device: no destination memory");
  if (any && (scratch == 0 || scratch_bytes == 0)) {
    throw Error("gather_to_device: no scratch memory");
  }
}

// The reads of one round, `threads` at a time; the first error is rethrown
// once every thread has stopped.
void read_round(const std::vector<std::shared_ptr<CuFile>>& files,
                const std::vector<Region>& regions, CUdeviceptr scratch, size_t threads,
                GatherStats& stats) {
  struct Read {
    uint32_t file;
    uint64_t offset, size, at;
  };
  std::vector<Read> reads;
  for (const Region& r : regions) {
    for (uint64_t from = r.start; from < r.end; from += kReadPiece) {
      uint64_t size = std::min(kReadPiece, r.end - from);
      reads.push_back(Read{r.file, from, size, r.at + (from - r.start)});
      stats.bytes_read += size;
    }
  }
  stats.reads += reads.size();
  stats.spans += regions.size();
  if (threads == 0) threads = std::clamp(std::thread::hardware_concurrency(), 1U, 8U);
  threads = std::min(threads, reads.size());
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::exception_ptr error;
  auto work = [&] {
    try {
      for (size_t i = next++; i < reads.size() && !failed; i = next++) {
        const Read& r = reads[i];
        files[r.file]->read(scratch + r.at, r.size, static_cast<off_t>(r.offset), 1, r.size);
      }
    } catch (...) {
      failed = true;
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& thread : pool) thread.join();
  if (error) std::rethrow_exception(error);
}

void queue_copy(const DriverApi& api, const Copy& c, CUdeviceptr dest, CUdeviceptr scratch,
                CUstream stream, GatherStats& stats) {
  if (c.height > 1) {
    Memcpy2D m{};
    m.srcMemoryType = kMemoryTypeDevice;
    m.srcDevice = scratch + c.src;
    m.srcPitch = c.src_pitch;
    m.dstMemoryType = kMemoryTypeDevice;
    m.dstDevice = dest + c.dst;
    m.dstPitch = c.dst_pitch;
    m.WidthInBytes = c.width;
    m.Height = c.height;
    CUresult result = api.Memcpy2DAsync(&m, stream);
    if (result == kSuccess) {
      ++stats.copies_2d;
      return;
    }
    // A driver that refuses these pitches gets the rows one by one.
    if (result != kInvalidValue) check(result, "cuMemcpy2DAsync");
  }
  for (uint64_t row = 0; row < c.height; ++row) {
    check(api.MemcpyDtoDAsync(dest + c.dst + row * c.dst_pitch, scratch + c.src + row * c.src_pitch,
                              c.width, stream),
          "cuMemcpyDtoDAsync");
    ++stats.copies;
  }
}

}  // namespace

GatherStats gather_to_device(const std::vector<std::shared_ptr<CuFile>>& files, int device,
                             CUdeviceptr dest, uint64_t dest_bytes, CUdeviceptr scratch,
                             uint64_t scratch_bytes, const GatherRuns& runs, CUstream stream,
                             const GatherOptions& options) {
  if (options.align > 1 && (options.align & (options.align - 1)) != 0) {
    throw Error("gather_to_device: align=" + std::to_string(options.align) +
                " is not a power of two");
  }
  validate(files, device, dest, dest_bytes, scratch, scratch_bytes, runs);
  std::vector<Piece> pieces;
  pieces.reserve(runs.count);
  for (size_t i = 0; i < runs.count; ++i) {
    for (uint64_t done = 0; done < runs.lengths[i]; done += scratch_bytes) {
      pieces.push_back(Piece{runs.file_ids[i], runs.offsets[i] + done,
                             std::min(scratch_bytes, runs.lengths[i] - done),
                             runs.dest_offsets[i] + done});
    }
  }
  std::stable_sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    return a.file != b.file ? a.file < b.file : a.offset < b.offset;
  });
  std::vector<uint64_t> sizes(files.size(), 0);
  for (size_t f = 0; f < files.size(); ++f) {
    if (files[f]) sizes[f] = files[f]->size();
  }
  std::vector<Round> rounds = plan(pieces, sizes, scratch, scratch_bytes, options);

  const DriverApi& api = driver();
  DeviceScope scope(device);
  GatherStats stats;
  bool pending = false;  // copies out of the scratch are queued and may not have run
  try {
    for (const Round& round : rounds) {
      if (round.regions.empty()) continue;
      if (pending) {
        check(api.StreamSynchronize(stream), "cuStreamSynchronize");
        pending = false;
      }
      ++stats.rounds;
      read_round(files, round.regions, scratch, options.threads, stats);
      for (const Copy& c : round.copies) {
        pending = true;
        queue_copy(api, c, dest, scratch, stream, stats);
      }
    }
    stats.done = std::make_shared<Event>(device, stream);
  } catch (...) {
    if (pending) api.StreamSynchronize(stream);  // nothing reads the scratch once this throws
    throw;
  }
  return stats;
}

}  // namespace stoker::cuda
