// A stress program for the reader's concurrency, built for ThreadSanitizer by
// scripts/sanitize.sh (tests/cpp is added with -DSTOKER_STRESS=ON).
//
//   stoker_stress [SECONDS [DIR]]
//
// SECONDS defaults to 10; the shards go to DIR (kept, rewritten each run) or to a
// fresh temporary folder that is removed at the end.
//
// It writes a few tar shards by hand (ustar headers with their checksums),
// indexes them with format::index_shards and checks the index, then for
// SECONDS runs at once:
//   - client threads that submit random batches (stored ranges, ASCII integers,
//     raw deflate with and without CRC checks) to one shared ShardReader and
//     some to a second one, into ring buffers or into their own buffers, and
//     wait (blocking, polling with timeouts, spinning on done()), cancel in
//     flight, drop handles unwaited, hand batches to another thread that
//     waits (or cancels) too, read through short-lived readers destroyed
//     before the wait, and submit batches that must fail (short read, a file
//     changed since it was indexed); every byte read is compared with the file;
//   - a thread that makes the readers forget descriptors while reads use them
//     (both readers keep 1 or 2 descriptors open, so eviction is constant);
//   - threads that read through one small FileCache directly, holding
//     descriptors across evictions;
//   - threads that acquire PinnedRing slots, fill them, pass them to each
//     other and release them on other threads, and drop private rings while
//     their slots are still out, checking a slot is never handed out twice;
//   - the pinned ring without CUDA: a test HostPinner records the page-locked
//     ranges (an overlapping pin, an unpin of an address not pinned or of one
//     a copy still reads, more slots or bytes locked than the ring's bounds:
//     failures) and a copier thread stands in for the copy stream (FIFO,
//     0-2 ms a copy; each copy checks the slot still holds the bytes written
//     before it was queued, then completes the slot's fence). 4 clients share
//     one pinned ring of 3 slots and 64 KiB: random sizes (0 too, and sizes
//     that make the ring let smaller idle slots go), a unique pattern per
//     fill, one or two copies (a pair of fences) or none, slots dropped with
//     copies pending, sometimes by a dropper thread, acquires with short
//     deadlines (null accepted), injected pin failures, and requests for more
//     than the ring may lock (a stoker::Error, also for sizes near SIZE_MAX);
//     a thread makes private pinned rings and destroys them with slots out and
//     copies pending (the ring and the slots' deleters must wait for the
//     copies, then unpin). At the end every pin has its unpin.
// A thread still running 120 s after the stop (a waiter never woken) fails
// the run. Exit status 0 when every check passed; a summary goes to stdout.
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "stoker/errors.hpp"
#include "stoker/format/shard_index.hpp"
#include "stoker/io/array_layout.hpp"
#include "stoker/io/array_rows.hpp"
#include "stoker/io/file_cache.hpp"
#include "stoker/io/pinned_ring.hpp"
#include "stoker/io/posix_file.hpp"
#include "stoker/io/shard_reader.hpp"
#include "stoker/text/ascii_int.hpp"

namespace {

using namespace stoker;
using Clock = std::chrono::steady_clock;
using Rng = std::mt19937_64;

// ---------------------------------------------------------------- reporting

std::atomic<bool> g_stop{false};
std::atomic<uint64_t> g_failures{0};
std::mutex g_print;

void failure(const std::string& what) {
  if (g_failures.fetch_add(1) < 20) {
    std::lock_guard<std::mutex> lock(g_print);
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

#define CHECK(cond, what)                                                                  \
  do {                                                                                     \
    if (!(cond))                                                                           \
      failure(std::string(__FILE__ ":") + std::to_string(__LINE__) + ": " + #cond + ": " + \
              (what));                                                                     \
  } while (0)

struct Counters {
  std::atomic<uint64_t> batches{0}, bytes{0}, pieces{0};
  std::atomic<uint64_t> cancels{0}, late_cancels{0}, dropped{0}, expected_errors{0};
  std::atomic<uint64_t> handoffs{0}, ephemeral{0}, polls{0}, spins{0};
  std::atomic<uint64_t> forgets{0}, cache_reads{0}, ring_slots{0}, ring_passes{0}, dead_rings{0};
  std::atomic<uint64_t> pinned_slots{0}, pinned_copies{0}, pinned_pairs{0}, pinned_timeouts{0};
  std::atomic<uint64_t> pinned_late_us{0}, pinned_handoffs{0}, pinned_refusals{0}, pin_failures{0};
  std::atomic<uint64_t> private_rings{0}, orphans{0}, pins{0}, unpins{0}, pinned_mismatches{0};
  std::atomic<uint64_t> array_batches{0}, array_rows{0};
} g;

uint64_t pick(Rng& rng, uint64_t lo, uint64_t hi) {  // inclusive
  return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
}

// ---------------------------------------------------------------- shards

struct Sample {
  std::string key;
  uint64_t bin_offset = 0, bin_length = 0;
  uint64_t cls_offset = 0, cls_length = 0;
  int64_t cls_value = 0;
  uint64_t z_offset = 0, z_length = 0;  // raw deflate on disk
  std::vector<uint8_t> z_plain;         // what it inflates to
  uint32_t z_crc = 0;
};

struct Shard {
  std::string path;
  std::vector<uint8_t> bytes;  // the whole file, to check reads against
  std::vector<Sample> samples;
};

void octal(uint8_t* field, size_t width, uint64_t value) {
  // width - 1 zero-padded octal digits, then a NUL.
  for (size_t i = width - 1; i-- > 0; value >>= 3)
    field[i] = static_cast<uint8_t>('0' + (value & 7));
  field[width - 1] = 0;
}

// Appends one ustar member; returns the offset of its data.
uint64_t append_member(std::vector<uint8_t>& out, const std::string& name, const uint8_t* data,
                       size_t size) {
  uint8_t h[512] = {};
  std::memcpy(h, name.data(), std::min<size_t>(name.size(), 99));
  octal(h + 100, 8, 0644);           // mode
  octal(h + 108, 8, 0);              // uid
  octal(h + 116, 8, 0);              // gid
  octal(h + 124, 12, size);          // size
  octal(h + 136, 12, 1700000000);    // mtime
  h[156] = '0';                      // a regular file
  std::memcpy(h + 257, "ustar", 6);  // magic with its NUL
  std::memcpy(h + 263, "00", 2);     // version
  std::memcpy(h + 265, "stoker", 6);
  std::memcpy(h + 297, "stoker", 6);
  std::memset(h + 148, ' ', 8);  // the checksum sums its own field as spaces
  unsigned sum = 0;
  for (uint8_t b : h) sum += b;
  std::snprintf(reinterpret_cast<char*>(h + 148), 8, "%06o", sum);  // 6 digits, NUL; h[155] ' '
  out.insert(out.end(), h, h + 512);
  uint64_t at = out.size();
  out.insert(out.end(), data, data + size);
  out.resize((out.size() + 511) / 512 * 512, 0);
  return at;
}

std::vector<uint8_t> raw_deflate(const std::vector<uint8_t>& plain, int level) {
  z_stream zs{};
  if (deflateInit2(&zs, level, Z_DEFLATED, -15, 8, Z_DEFAULT_STRATEGY) != Z_OK) std::abort();
  std::vector<uint8_t> out(deflateBound(&zs, plain.size()) + 16);
  zs.next_in = const_cast<uint8_t*>(plain.data());
  zs.avail_in = static_cast<uInt>(plain.size());
  zs.next_out = out.data();
  zs.avail_out = static_cast<uInt>(out.size());
  if (deflate(&zs, Z_FINISH) != Z_STREAM_END) std::abort();
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

Shard make_shard(const std::string& path, size_t index, size_t count) {
  Rng rng(7919 * (index + 1));
  Shard shard;
  shard.path = path;
  static const char* kWords[] = {"stoker ", "keeps ", "GPUs ", "fed ", "tar ", "zip ", "npy "};
  for (size_t i = 0; i < count; ++i) {
    Sample s;
    char key[32];
    std::snprintf(key, sizeof key, "s%02zu_%06zu", index, i);
    s.key = key;

    // Mostly small members; a few bigger than one merged read (256 KiB).
    size_t n = pick(rng, 0, 9) == 0 ? pick(rng, 100000, 400000) : pick(rng, 1, 20000);
    std::vector<uint8_t> bin(n);
    for (auto& b : bin) b = static_cast<uint8_t>(rng());
    s.bin_length = n;
    s.bin_offset = append_member(shard.bytes, s.key + ".bin", bin.data(), bin.size());

    s.cls_value = static_cast<int64_t>(pick(rng, 0, 2000000000000000ull)) - 1000000000000000ll;
    std::string text = std::to_string(s.cls_value);
    switch (pick(rng, 0, 2)) {
      case 0:
        text = " " + text + "\n";
        break;
      case 1:
        if (s.cls_value >= 0) text = "+" + text;
        break;
      default:
        break;
    }
    s.cls_length = text.size();
    s.cls_offset = append_member(shard.bytes, s.key + ".cls",
                                 reinterpret_cast<const uint8_t*>(text.data()), text.size());

    size_t plain = pick(rng, 1, 30000);
    while (s.z_plain.size() < plain) {
      if (pick(rng, 0, 3) == 0) {
        s.z_plain.push_back(static_cast<uint8_t>(rng()));
      } else {
        const char* w = kWords[pick(rng, 0, 6)];
        s.z_plain.insert(s.z_plain.end(), w, w + std::strlen(w));
      }
    }
    s.z_plain.resize(plain);
    s.z_crc = static_cast<uint32_t>(crc32(0, s.z_plain.data(), static_cast<uInt>(plain)));
    std::vector<uint8_t> z = raw_deflate(s.z_plain, static_cast<int>(pick(rng, 1, 9)));
    s.z_length = z.size();
    s.z_offset = append_member(shard.bytes, s.key + ".z", z.data(), z.size());
    shard.samples.push_back(std::move(s));
  }
  shard.bytes.resize(shard.bytes.size() + 1024, 0);  // the end-of-archive blocks

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(shard.bytes.data()),
            static_cast<std::streamsize>(shard.bytes.size()));
  out.close();
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(2);
  }
  return shard;
}

void check_index(const Shard& shard, const format::ShardIndex& ix) {
  const std::string& p = shard.path;
  CHECK(ix.format == "tar", p);
  CHECK(ix.file_size == shard.bytes.size(), p);
  CHECK(ix.identity.size == shard.bytes.size(), p);
  CHECK(ix.keys.size() == shard.samples.size(), p);
  CHECK(ix.sample_start.size() == ix.keys.size() + 1, p);
  if (ix.keys.size() != shard.samples.size() || ix.sample_start.size() != ix.keys.size() + 1)
    return;
  for (size_t j = 0; j < ix.keys.size(); ++j) {
    const Sample& s = shard.samples[j];
    CHECK(ix.keys[j] == s.key, p + " sample " + std::to_string(j));
    CHECK(ix.sample_start[j + 1] - ix.sample_start[j] == 3, s.key);
    for (uint32_t m = ix.sample_start[j]; m < ix.sample_start[j + 1]; ++m) {
      const std::string& field = ix.field_names.at(ix.member_field[m]);
      uint64_t offset = field == "bin" ? s.bin_offset : field == "cls" ? s.cls_offset : s.z_offset;
      uint64_t length = field == "bin" ? s.bin_length : field == "cls" ? s.cls_length : s.z_length;
      CHECK(field == "bin" || field == "cls" || field == "z", s.key + " field " + field);
      CHECK(ix.member_offset[m] == offset, s.key + "." + field);
      CHECK(ix.member_length[m] == length, s.key + "." + field);
      CHECK(ix.member_codec[m] == static_cast<uint8_t>(io::Codec::kStored), s.key + "." + field);
    }
  }
}

// ---------------------------------------------------------------- batches

enum class Kind { kBytes, kInt };

struct Piece {
  Kind kind = Kind::kBytes;
  const uint8_t* expect = nullptr;  // kBytes: the decoded bytes
  int64_t value = 0;                // kInt
};

enum class Expect { kOk, kShortRead, kChanged };

struct Batch {
  std::shared_ptr<const io::FileTable> table;
  std::vector<io::ReadRequest> requests;
  std::vector<Piece> pieces;  // one per request
  uint64_t dest_size = 0;
  uint64_t payload = 0;
  Expect expect = Expect::kOk;
};

struct Outcome {
  bool ok = false;
  std::string what;  // the error, prefixed by its kind
};

Outcome wait_for(io::PendingRead& pending) {
  Outcome o;
  try {
    o.ok = pending.wait(-1);
    if (!o.ok) o.what = "wait(-1) returned false";
  } catch (const FormatError& e) {
    o.what = std::string("FormatError: ") + e.what();
  } catch (const ReadError& e) {
    o.what = std::string("ReadError: ") + e.what();
  } catch (const Error& e) {
    o.what = std::string("Error: ") + e.what();
  } catch (const std::exception& e) {
    o.what = std::string("unexpected exception: ") + e.what();
  }
  return o;
}

bool is_cancelled(const Outcome& o) {
  return !o.ok && o.what.rfind("Error: ", 0) == 0 && o.what.find("cancelled") != std::string::npos;
}

struct World {
  std::vector<Shard> shards;
  std::vector<std::string> paths;
  std::shared_ptr<const io::FileTable> checked;    // identities as indexed
  std::shared_ptr<const io::FileTable> unchecked;  // paths only
  std::shared_ptr<const io::FileTable> stale;      // identities that no longer match
  std::unique_ptr<io::ShardReader> first, second;

  struct Handoff {
    Batch batch;
    std::shared_ptr<io::PendingRead> pending;
    std::unique_ptr<std::vector<uint8_t>> own;  // the destination, for a dest-pointer read
    bool cancel = false;
    Outcome helper;
    std::atomic<bool> helper_done{false};
  };
  std::mutex handoff_mutex;
  std::condition_variable handoff_cv;
  std::deque<std::shared_ptr<Handoff>> handoffs;
  std::atomic<bool> helper_stop{false};

  struct Grave {  // a dest-pointer batch dropped unwaited: its buffer outlives the readers
    std::weak_ptr<io::PendingRead> pending;
    std::unique_ptr<std::vector<uint8_t>> own;
  };
  std::mutex graves_mutex;
  std::vector<Grave> graves;

  std::shared_ptr<io::PinnedRing> ring = std::make_shared<io::PinnedRing>(4, 1 << 20);
  struct Slot {
    std::shared_ptr<io::AlignedBuffer> buffer;
    uint8_t tag = 0;
    size_t size = 0;
  };
  std::mutex exchange_mutex;
  std::vector<Slot> exchange;
  std::mutex live_mutex;
  std::unordered_set<const void*> live;  // data of every slot handed out and not yet released

  io::FileCache cache{2};
};

Batch make_batch(Rng& rng, const World& w, bool big) {
  Batch b;
  b.table = pick(rng, 0, 1) ? w.checked : w.unchecked;
  size_t n = big ? pick(rng, 100, 300) : pick(rng, 1, 48);
  size_t home = pick(rng, 0, w.shards.size() - 1);
  // Runs of neighbouring samples merge into one read; some pieces overlap or
  // repeat, which sends a run down the scratch path.
  size_t cursor = pick(rng, 0, w.shards[home].samples.size() - 1);
  uint64_t at = 0;
  for (size_t i = 0; i < n; ++i) {
    size_t s = pick(rng, 0, 3) == 0 ? pick(rng, 0, w.shards.size() - 1) : home;
    const Shard& shard = w.shards[s];
    size_t j = s == home && pick(rng, 0, 2) ? (cursor++ % shard.samples.size())
                                            : pick(rng, 0, shard.samples.size() - 1);
    const Sample& sample = shard.samples[j];
    io::ReadRequest r;
    r.file = static_cast<uint32_t>(s);
    Piece p;
    uint64_t kind = big ? 0 : pick(rng, 0, 99);
    if (kind < 60) {  // a member's bytes, whole or a part
      uint64_t a = 0, len = sample.bin_length;
      if (!big && pick(rng, 0, 9) < 7) {
        a = pick(rng, 0, sample.bin_length - 1);
        len = pick(rng, 1, sample.bin_length - a);
      }
      r.offset = sample.bin_offset + a;
      r.length = r.out_length = len;
      p.expect = shard.bytes.data() + r.offset;
      if (pick(rng, 0, 19) == 0) {  // a stored piece may be CRC-checked too
        r.check_crc = true;
        r.crc32 = static_cast<uint32_t>(crc32(0, p.expect, static_cast<uInt>(len)));
      }
    } else if (kind < 70) {  // any range of the file, headers included
      r.offset = pick(rng, 0, shard.bytes.size() - 1);
      r.length = r.out_length =
          pick(rng, 1, std::min<uint64_t>(16384, shard.bytes.size() - r.offset));
      p.expect = shard.bytes.data() + r.offset;
    } else if (kind < 85) {  // WebDataset's .cls: ASCII integer text
      r.offset = sample.cls_offset;
      r.length = sample.cls_length;
      r.out_length = sizeof(int64_t);
      r.codec = text::kAsciiInt;
      p.kind = Kind::kInt;
      p.value = sample.cls_value;
    } else {  // raw deflate, as in a zip
      r.offset = sample.z_offset;
      r.length = sample.z_length;
      r.out_length = sample.z_plain.size();
      r.codec = io::Codec::kDeflate;
      if (pick(rng, 0, 1)) {
        r.check_crc = true;
        r.crc32 = sample.z_crc;
      }
      p.expect = sample.z_plain.data();
    }
    at = (at + 7) / 8 * 8 + (pick(rng, 0, 3) == 0 ? pick(rng, 0, 100) : 0);
    r.dest_offset = at;
    at += r.out_length;
    b.payload += r.out_length;
    b.requests.push_back(r);
    b.pieces.push_back(p);
  }
  // Submission order is not file order: the reader sorts.
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  Batch shuffled = b;
  for (size_t i = 0; i < n; ++i) {
    shuffled.requests[i] = b.requests[order[i]];
    shuffled.pieces[i] = b.pieces[order[i]];
  }
  shuffled.dest_size = at + (pick(rng, 0, 1) ? pick(rng, 0, 4096) : 0);
  return shuffled;
}

// Appends a piece that ends past the end of its file, or reads through a
// table whose identities no longer match: the batch must fail, naming it.
void spoil(Rng& rng, const World& w, Batch& b) {
  if (pick(rng, 0, 1)) {
    b.expect = Expect::kChanged;
    b.table = w.stale;
    return;
  }
  b.expect = Expect::kShortRead;
  size_t s = pick(rng, 0, w.shards.size() - 1);
  io::ReadRequest r;
  r.file = static_cast<uint32_t>(s);
  r.offset = w.shards[s].bytes.size() - pick(rng, 1, 100);
  r.length = r.out_length = 200;
  r.dest_offset = b.dest_size;
  b.dest_size += r.out_length;
  b.requests.push_back(r);
  b.pieces.push_back(Piece{});
}

// Compares what a batch read with the files; `canary`: bytes outside every
// piece must still hold 0xA5 (a read into the caller's own buffer).
void verify(const Batch& b, const uint8_t* data, bool canary, const char* how) {
  bool good = true;
  for (size_t i = 0; i < b.requests.size(); ++i) {
    const io::ReadRequest& r = b.requests[i];
    const Piece& p = b.pieces[i];
    if (p.kind == Kind::kInt) {
      int64_t got;
      std::memcpy(&got, data + r.dest_offset, sizeof got);
      if (got != p.value) {
        failure(std::string(how) + ": file " + std::to_string(r.file) + " offset " +
                std::to_string(r.offset) + ": integer " + std::to_string(got) + ", expected " +
                std::to_string(p.value));
        good = false;
      }
    } else if (std::memcmp(data + r.dest_offset, p.expect, r.out_length) != 0) {
      failure(std::string(how) + ": file " + std::to_string(r.file) + " offset " +
              std::to_string(r.offset) + " length " + std::to_string(r.length) + " codec " +
              std::to_string(int(r.codec)) + ": bytes differ from the file");
      good = false;
    }
  }
  if (canary) {
    std::vector<std::pair<uint64_t, uint64_t>> spans;
    for (const auto& r : b.requests)
      spans.emplace_back(r.dest_offset, r.dest_offset + r.out_length);
    std::sort(spans.begin(), spans.end());
    uint64_t at = 0;
    spans.emplace_back(b.dest_size, b.dest_size);
    for (const auto& [start, end] : spans) {
      for (uint64_t k = at; k < start; ++k) {
        if (data[k] != 0xA5) {
          failure(std::string(how) + ": byte " + std::to_string(k) +
                  " outside every piece was written");
          good = false;
          break;
        }
      }
      at = std::max(at, end);
    }
  }
  if (good) {
    g.batches.fetch_add(1, std::memory_order_relaxed);
    g.pieces.fetch_add(b.requests.size(), std::memory_order_relaxed);
    g.bytes.fetch_add(b.payload, std::memory_order_relaxed);
  }
}

void check_failure(const Batch& b, const Outcome& o, const char* how) {
  const char* want = b.expect == Expect::kShortRead ? "short read" : "changed after it was indexed";
  if (o.ok || o.what.rfind("FormatError: ", 0) != 0 || o.what.find(want) == std::string::npos) {
    failure(std::string(how) + ": expected a FormatError with '" + want + "', got " +
            (o.ok ? std::string("success") : o.what));
  } else {
    g.expected_errors.fetch_add(1, std::memory_order_relaxed);
  }
}

struct Submitted {
  std::shared_ptr<io::PendingRead> pending;
  std::unique_ptr<std::vector<uint8_t>> own;  // for a dest-pointer read
  const uint8_t* data = nullptr;
};

Submitted submit(io::ShardReader& reader, const Batch& b, bool into_own) {
  Submitted s;
  if (into_own) {
    s.own = std::make_unique<std::vector<uint8_t>>(b.dest_size + 1, 0xA5);
    s.pending = reader.submit(b.table, b.requests, s.own->data(), b.dest_size);
    s.data = s.own->data();
  } else {
    s.pending = reader.submit(b.table, b.requests, b.dest_size);
    const auto& buffer = s.pending->buffer();
    CHECK(buffer && buffer->size() == b.dest_size, "ring buffer of the wrong size");
    CHECK(reinterpret_cast<uintptr_t>(buffer->data()) % io::AlignedBuffer::kAlignment == 0,
          "ring buffer not page-aligned");
    s.data = buffer->data();
  }
  return s;
}

// ---------------------------------------------------------------- threads

void client(int id, World& w) {
  Rng rng(1000 + id);
  std::vector<World::Grave> graves;  // freed once the readers are gone (main)
  uint64_t grave_bytes = 0;
  while (!g_stop.load(std::memory_order_relaxed)) {
    io::ShardReader& reader = pick(rng, 0, 3) == 0 ? *w.second : *w.first;
    bool own = pick(rng, 0, 1);
    uint64_t op = pick(rng, 0, 99);
    if (op < 30) {  // submit and wait
      Batch b = make_batch(rng, w, false);
      Submitted s = submit(reader, b, own);
      Outcome o = wait_for(*s.pending);
      if (!o.ok)
        failure("wait: " + o.what);
      else
        verify(b, s.data, own, "wait");
    } else if (op < 37) {  // poll with short timeouts, or spin on done() with nobody helping
      Batch b = make_batch(rng, w, false);
      Submitted s = submit(reader, b, own);
      bool spin = pick(rng, 0, 1);
      try {
        if (spin) {
          while (!s.pending->done()) std::this_thread::yield();
          g.spins.fetch_add(1, std::memory_order_relaxed);
          CHECK(s.pending->wait(0), "wait(0) after done() must be true");
        } else {
          int64_t timeout = 0;  // the first look does not help: the pool is still at it
          while (!s.pending->wait(timeout)) {
            g.polls.fetch_add(1, std::memory_order_relaxed);
            timeout = static_cast<int64_t>(pick(rng, 0, 2));
          }
        }
        verify(b, s.data, own, spin ? "spin" : "poll");
      } catch (const std::exception& e) {
        failure(std::string("poll/spin: ") + e.what());
        (void)wait_for(*s.pending);
      }
    } else if (op < 52) {  // cancel a big batch in flight
      Batch b = make_batch(rng, w, true);
      Submitted s = submit(reader, b, own);
      uint64_t delay = pick(rng, 0, 3);
      if (delay) std::this_thread::sleep_for(std::chrono::microseconds(pick(rng, 0, 200 * delay)));
      s.pending->cancel();
      if (pick(rng, 0, 3) == 0) s.pending->cancel();  // twice is harmless
      Outcome o = wait_for(*s.pending);
      CHECK(s.pending->done(), "done() after wait");
      if (o.ok) {
        g.late_cancels.fetch_add(1, std::memory_order_relaxed);
        verify(b, s.data, own, "late cancel");
      } else if (is_cancelled(o)) {
        g.cancels.fetch_add(1, std::memory_order_relaxed);
      } else {
        failure("cancel: " + o.what);
      }
    } else if (op < 62) {  // drop the handle without waiting
      Batch b = make_batch(rng, w, pick(rng, 0, 1));
      // Only done() or wait() says a dest-pointer read is over (an expired
      // weak_ptr is no synchronisation), so without a handle its buffer must
      // outlive the reader: keep a few MB of those, the rest go to the ring.
      own = own && grave_bytes + b.dest_size < (16u << 20);
      Submitted s = submit(reader, b, own);
      if (pick(rng, 0, 1)) s.pending->cancel();
      if (s.own) {
        grave_bytes += s.own->size();
        graves.push_back(World::Grave{s.pending, std::move(s.own)});
      }
      s.pending.reset();
      g.dropped.fetch_add(1, std::memory_order_relaxed);
    } else if (op < 72) {  // another thread waits (or cancels) too
      auto h = std::make_shared<World::Handoff>();
      h->batch = make_batch(rng, w, pick(rng, 0, 3) == 0);
      h->cancel = pick(rng, 0, 2) == 0;
      Submitted s = submit(reader, h->batch, own);
      h->pending = s.pending;
      h->own = std::move(s.own);
      {
        std::lock_guard<std::mutex> lock(w.handoff_mutex);
        w.handoffs.push_back(h);
      }
      w.handoff_cv.notify_one();
      if (pick(rng, 0, 1)) std::this_thread::yield();
      Outcome mine = wait_for(*h->pending);
      while (!h->helper_done.load(std::memory_order_acquire)) std::this_thread::yield();
      const Outcome& theirs = h->helper;
      if (h->cancel) {
        CHECK(mine.ok || is_cancelled(mine), mine.what);
        CHECK(theirs.ok || is_cancelled(theirs), theirs.what);
        if (mine.ok && theirs.ok) verify(h->batch, s.data, own, "handoff, cancel too late");
        if (!mine.ok || !theirs.ok) g.cancels.fetch_add(1, std::memory_order_relaxed);
      } else {
        CHECK(mine.ok, "handoff, this thread: " + mine.what);
        CHECK(theirs.ok, "handoff, the helper: " + theirs.what);
        if (mine.ok && theirs.ok) verify(h->batch, s.data, own, "handoff");
      }
      g.handoffs.fetch_add(1, std::memory_order_relaxed);
    } else if (op < 82) {  // a short-lived reader, often destroyed before the wait
      Batch b = make_batch(rng, w, pick(rng, 0, 3) == 0);
      auto ephemeral = std::make_unique<io::ShardReader>(pick(rng, 1, 3), pick(rng, 1, 2));
      Submitted s = submit(*ephemeral, b, own);
      if (pick(rng, 0, 3)) ephemeral.reset();  // the waiter finishes what the pool did not
      Outcome o = wait_for(*s.pending);
      if (!o.ok)
        failure("ephemeral reader: " + o.what);
      else
        verify(b, s.data, own, "ephemeral reader");
      ephemeral.reset();
      g.ephemeral.fetch_add(1, std::memory_order_relaxed);
    } else {  // a batch that must fail
      Batch b = make_batch(rng, w, false);
      spoil(rng, w, b);
      Submitted s = submit(reader, b, own);
      check_failure(b, wait_for(*s.pending), "spoiled batch");
    }
  }
  std::lock_guard<std::mutex> lock(w.graves_mutex);
  for (auto& grave : graves) w.graves.push_back(std::move(grave));
}

void helper(World& w) {
  Rng rng(77);
  for (;;) {
    std::shared_ptr<World::Handoff> h;
    {
      std::unique_lock<std::mutex> lock(w.handoff_mutex);
      w.handoff_cv.wait_for(lock, std::chrono::milliseconds(10),
                            [&] { return !w.handoffs.empty() || w.helper_stop.load(); });
      if (w.handoffs.empty()) {
        if (w.helper_stop.load()) return;
        continue;
      }
      h = w.handoffs.front();
      w.handoffs.pop_front();
    }
    if (h->cancel) {
      if (pick(rng, 0, 1))
        std::this_thread::sleep_for(std::chrono::microseconds(pick(rng, 0, 300)));
      h->pending->cancel();
    }
    h->helper = wait_for(*h->pending);
    h->helper_done.store(true, std::memory_order_release);
  }
}

void forgetter(World& w) {
  Rng rng(99);
  while (!g_stop.load(std::memory_order_relaxed)) {
    const std::string& path = w.paths[pick(rng, 0, w.paths.size() - 1)];
    (pick(rng, 0, 1) ? w.first : w.second)->forget(path);
    CHECK(w.first->open_files() <= w.first->max_open_files(), "too many open files");
    CHECK(w.second->open_files() <= w.second->max_open_files(), "too many open files");
    g.forgets.fetch_add(1, std::memory_order_relaxed);
    std::this_thread::sleep_for(std::chrono::microseconds(pick(rng, 20, 300)));
  }
}

void cache_worker(int id, World& w) {
  Rng rng(500 + id);
  std::vector<std::pair<size_t, std::shared_ptr<const io::FileDescriptor>>> held;
  while (!g_stop.load(std::memory_order_relaxed)) {
    size_t s = pick(rng, 0, w.shards.size() - 1);
    const Shard& shard = w.shards[s];
    try {
      auto fd =
          w.cache.get(shard.path, pick(rng, 0, 1) ? w.checked->identities[s] : io::FileIdentity{});
      held.emplace_back(s, fd);
      // Read through a descriptor that may have been evicted since.
      auto& [hs, hfd] = held[pick(rng, 0, held.size() - 1)];
      const Shard& hshard = w.shards[hs];
      uint8_t tmp[256];
      uint64_t offset = pick(rng, 0, hshard.bytes.size() - 1);
      uint64_t length = std::min<uint64_t>(sizeof tmp, hshard.bytes.size() - offset);
      io::pread_exact(hfd->get(), hshard.path, tmp, length, offset);
      CHECK(std::memcmp(tmp, hshard.bytes.data() + offset, length) == 0,
            "FileCache: bytes differ from " + hshard.path);
      CHECK(w.cache.size() <= w.cache.capacity(), "FileCache over capacity");
      if (held.size() > 3)
        held.erase(held.begin() + static_cast<long>(pick(rng, 0, held.size() - 1)));
      if (pick(rng, 0, 4) == 0) w.cache.forget(w.paths[pick(rng, 0, w.paths.size() - 1)]);
      g.cache_reads.fetch_add(1, std::memory_order_relaxed);
      std::this_thread::sleep_for(std::chrono::microseconds(pick(rng, 0, 100)));
    } catch (const std::exception& e) {
      failure(std::string("FileCache: ") + e.what());
    }
  }
}

// Samples a slot's bytes: one per 512 and both ends.
bool slot_intact(const World::Slot& slot) {
  const uint8_t* d = slot.buffer->data();
  for (size_t k = 0; k < slot.size; k += 512)
    if (d[k] != slot.tag) return false;
  return d[slot.size - 1] == slot.tag;
}

void release(World& w, World::Slot& slot, const char* how) {
  CHECK(slot_intact(slot), std::string(how) + ": a slot in use was overwritten");
  {
    std::lock_guard<std::mutex> lock(w.live_mutex);
    w.live.erase(slot.buffer->data());
  }
  slot.buffer.reset();  // back to its ring, on whichever thread lets it go
}

World::Slot take(World& w, io::PinnedRing& ring, Rng& rng, uint8_t tag) {
  size_t size;
  switch (pick(rng, 0, 3)) {
    case 0:
      size = pick(rng, 1, 100);
      break;
    case 1:
      size = 4096 * pick(rng, 1, 16);
      break;
    default:
      size = pick(rng, 1, 1 << 19);
      break;
  }
  World::Slot slot{ring.acquire(size), tag, size};
  const io::AlignedBuffer& b = *slot.buffer;
  CHECK(b.size() == size && b.capacity() >= size && b.capacity() % 4096 == 0, "slot size");
  CHECK(reinterpret_cast<uintptr_t>(b.data()) % 4096 == 0, "slot not page-aligned");
  {
    std::lock_guard<std::mutex> lock(w.live_mutex);
    CHECK(w.live.insert(b.data()).second, "a slot in use was handed out again");
  }
  std::memset(slot.buffer->data(), tag, size);
  g.ring_slots.fetch_add(1, std::memory_order_relaxed);
  return slot;
}

void ring_worker(int id, World& w) {
  Rng rng(300 + id);
  std::vector<World::Slot> held;
  uint8_t counter = 0;
  while (!g_stop.load(std::memory_order_relaxed)) {
    uint64_t op = pick(rng, 0, 99);
    if (op < 45) {
      held.push_back(take(w, *w.ring, rng, static_cast<uint8_t>(id * 64 + ++counter)));
    } else if (op < 70) {
      if (!held.empty()) {
        size_t k = pick(rng, 0, held.size() - 1);
        release(w, held[k], "release");
        held.erase(held.begin() + static_cast<long>(k));
      }
    } else if (op < 85) {  // pass a slot to whoever takes one from the exchange next
      if (!held.empty()) {
        std::lock_guard<std::mutex> lock(w.exchange_mutex);
        w.exchange.push_back(std::move(held.back()));
        held.pop_back();
        g.ring_passes.fetch_add(1, std::memory_order_relaxed);
      }
    } else if (op < 97) {  // take one some thread passed and release it here
      World::Slot slot;
      {
        std::lock_guard<std::mutex> lock(w.exchange_mutex);
        if (!w.exchange.empty()) {
          size_t k = pick(rng, 0, w.exchange.size() - 1);
          slot = std::move(w.exchange[k]);
          w.exchange.erase(w.exchange.begin() + static_cast<long>(k));
        }
      }
      if (slot.buffer) release(w, slot, "passed slot");
    } else {  // a private ring that dies while its slots are out
      auto ring = std::make_shared<io::PinnedRing>(2, 1 << 20);
      for (int k = 0; k < 3; ++k) {
        World::Slot slot = take(w, *ring, rng, static_cast<uint8_t>(id * 64 + ++counter));
        release(w, slot, "private ring");  // idle in the ring until it dies
      }
      World::Slot out = take(w, *ring, rng, static_cast<uint8_t>(id * 64 + ++counter));
      ring.reset();
      {
        std::lock_guard<std::mutex> lock(w.exchange_mutex);
        w.exchange.push_back(std::move(out));
      }
      g.dead_rings.fetch_add(1, std::memory_order_relaxed);
    }
    if (held.size() > 6) {
      release(w, held.front(), "release");
      held.erase(held.begin());
    }
  }
  for (auto& slot : held) release(w, slot, "release at the end");
}

// ---------------------------------------------------------------- pinned ring
// A pinned ring without CUDA: TestPinner records the page-locked ranges, and
// the fences are completed by a Copier thread that stands in for the copy
// stream (FIFO, 0-2 ms a copy, reading the slot's bytes as they are when the
// copy runs, not when it was queued).

constexpr size_t kPage = io::AlignedBuffer::kAlignment;
constexpr size_t kPinnedSlots = 3;
constexpr size_t kPinnedBytes = 16 * kPage;  // small: slots are evicted and remade

std::atomic<uint64_t> g_stamp{1};  // unique per fill of a pinned slot

void atomic_max(std::atomic<uint64_t>& at, uint64_t value) {
  uint64_t seen = at.load(std::memory_order_relaxed);
  while (seen < value && !at.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

// The bytes a slot is filled with: 8-byte words made from a stamp that is
// unique to the fill, so a slot refilled by anyone differs.
uint64_t pattern_word(uint64_t stamp, size_t word) {
  uint64_t x = stamp * 0x9E3779B97F4A7C15ull + word * 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 29);
}

void fill_pattern(uint8_t* data, size_t size, uint64_t stamp) {
  for (size_t w = 0; w * 8 < size; ++w) {
    uint64_t v = pattern_word(stamp, w);
    std::memcpy(data + w * 8, &v, std::min<size_t>(8, size - w * 8));
  }
}

// The first byte of [from, to) that is not the pattern of `stamp`; `to` if none.
size_t pattern_mismatch(const uint8_t* data, size_t from, size_t to, uint64_t stamp) {
  for (size_t i = from; i < to;) {
    size_t w = i / 8;
    uint64_t v = pattern_word(stamp, w);
    uint8_t want[8];
    std::memcpy(want, &v, 8);
    for (; i < to && i / 8 == w; ++i)
      if (data[i] != want[i % 8]) return i;
  }
  return to;
}

// Done when the copier has run its copy; wait() blocks on a condition variable.
class TestFence : public io::Fence {
 public:
  bool ready() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  void wait() override {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [this] { return done_; });
  }
  void complete() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    done_cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
};

// The copy stream: one FIFO worker. A copy holds the slot's address only, not
// a reference (a device copy does not keep the slot alive either); when it
// runs, the bytes must still be the ones written before it was queued.
class Copier {
 public:
  Copier() : thread_([this] { run(); }) {}
  ~Copier() { stop(); }

  std::shared_ptr<TestFence> copy(const io::AlignedBuffer& slot, size_t offset, size_t length,
                                  uint64_t stamp) {
    auto fence = std::make_shared<TestFence>();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(Job{slot.data(), offset, length, stamp, fence});
      ++reading_[slot.data()];
    }
    jobs_cv_.notify_one();
    return fence;
  }

  // Whether a queued or running copy still reads the slot at `data`.
  bool reading(const void* data) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return reading_.count(data) != 0;
  }

  // Runs every queued copy, then stops.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    jobs_cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct Job {
    const uint8_t* data;
    size_t offset, length;
    uint64_t stamp;
    std::shared_ptr<TestFence> fence;
  };

  void run() {
    Rng rng(4242);
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        jobs_cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      std::this_thread::sleep_for(std::chrono::microseconds(pick(rng, 0, 2000)));
      size_t end = job.offset + job.length;
      size_t bad = pattern_mismatch(job.data, job.offset, end, job.stamp);
      if (bad != end) {
        g.pinned_mismatches.fetch_add(1, std::memory_order_relaxed);
        failure("copier: byte " + std::to_string(bad) + " of a pinned slot changed between " +
                "queueing its copy of [" + std::to_string(job.offset) + ", " + std::to_string(end) +
                ") and running it (the slot was reused too early)");
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = reading_.find(job.data);
        if (--it->second == 0) reading_.erase(it);
      }
      job.fence->complete();
      g.pinned_copies.fetch_add(1, std::memory_order_relaxed);
    }
  }

  mutable std::mutex mutex_;
  std::condition_variable jobs_cv_;
  std::deque<Job> jobs_;
  std::unordered_map<const void*, int> reading_;  // slot data -> copies queued or running
  bool stop_ = false;
  std::thread thread_;  // last: starts once the rest is made
};

struct InjectedPinFailure : std::runtime_error {
  InjectedPinFailure() : std::runtime_error("injected page-locking failure") {}
};

// Records what is page-locked: a pin overlapping a pinned range, an unpin of
// an address not pinned, an unpin while a copy still reads the range, more
// ranges or bytes than the ring's bounds: each is a failure. Page-locking
// takes time (cuMemHostRegister, cuMemHostUnregister): a range counts as
// locked from the start of pin() to the end of unpin().
class TestPinner : public io::HostPinner {
 public:
  TestPinner(const Copier& copier, std::string name, size_t max_buffers, size_t max_bytes,
             uint64_t fail_one_in, uint64_t seed)
      : copier_(copier),
        name_(std::move(name)),
        max_buffers_(max_buffers),
        max_bytes_(max_bytes),
        fail_one_in_(fail_one_in),
        rng_(seed) {}

  uint8_t* allocate(size_t size) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (fail_one_in_ != 0 && pick(rng_, 1, fail_one_in_) == 1) throw InjectedPinFailure();
    }
    auto* data = static_cast<uint8_t*>(std::aligned_alloc(kPage, size));
    if (data == nullptr) throw std::bad_alloc();
    pin(data, size);
    return data;
  }

  void release(uint8_t* data, size_t) noexcept override {
    unpin(data);
    std::free(data);
  }

 private:
  void pin(void* data, size_t size) {
    uintptr_t at = reinterpret_cast<uintptr_t>(data);
    std::unique_lock<std::mutex> lock(mutex_);
    CHECK(at % kPage == 0 && size % kPage == 0 && size > 0,
          name_ + ": pin of " + std::to_string(size) + " bytes, not whole pages");
    auto next = ranges_.lower_bound(at);
    bool overlap =
        (next != ranges_.end() && next->first < at + size) ||
        (next != ranges_.begin() && std::prev(next)->first + std::prev(next)->second > at);
    if (overlap) {
      lock.unlock();
      failure(name_ + ": pin of " + std::to_string(size) + " bytes overlaps a pinned range");
      return;
    }
    ranges_.emplace(at, size);
    bytes_ += size;
    peak_ = std::max(peak_, bytes_);
    g.pins.fetch_add(1, std::memory_order_relaxed);
    CHECK(bytes_ <= max_bytes_, name_ + ": " + std::to_string(bytes_) +
                                    " bytes page-locked, more than the ring's max_bytes " +
                                    std::to_string(max_bytes_));
    CHECK(ranges_.size() <= max_buffers_, name_ + ": " + std::to_string(ranges_.size()) +
                                              " slots page-locked, more than the ring's " +
                                              std::to_string(max_buffers_));
    lock.unlock();
    driver_time();
  }

  void unpin(void* data) noexcept {
    CHECK(!copier_.reading(data), name_ + ": a slot unpinned while a copy still reads it");
    driver_time();
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = ranges_.find(reinterpret_cast<uintptr_t>(data));
    if (it == ranges_.end()) {
      failure(name_ + ": unpin of an address that is not pinned");
      return;
    }
    bytes_ -= it->second;
    ranges_.erase(it);
    g.unpins.fetch_add(1, std::memory_order_relaxed);
  }

 public:
  // Whether [data, data + size) lies in one pinned range.
  bool covers(const void* data, size_t size) const {
    uintptr_t at = reinterpret_cast<uintptr_t>(data);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = ranges_.upper_bound(at);
    if (it == ranges_.begin()) return false;
    --it;
    return it->first <= at && at + size <= it->first + it->second;
  }
  size_t ranges() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return ranges_.size();
  }
  size_t bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return bytes_;
  }
  size_t peak() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }
  const std::string& name() const { return name_; }

 private:
  static void driver_time() {
    thread_local Rng rng(std::hash<std::thread::id>()(std::this_thread::get_id()));
    if (pick(rng, 0, 1)) std::this_thread::sleep_for(std::chrono::microseconds(pick(rng, 0, 200)));
  }

  const Copier& copier_;
  const std::string name_;
  const size_t max_buffers_, max_bytes_;
  const uint64_t fail_one_in_;
  mutable std::mutex mutex_;
  Rng rng_;
  std::map<uintptr_t, size_t> ranges_;  // start -> length
  size_t bytes_ = 0, peak_ = 0;
};

struct PinnedSlot {
  std::shared_ptr<io::AlignedBuffer> buffer;
  uint64_t stamp = 0;
  size_t size = 0;
};

struct PinnedWorld {
  Copier copier;  // first: outlives every ring and slot
  std::shared_ptr<TestPinner> pinner = std::make_shared<TestPinner>(
      copier, "the shared pinned ring", kPinnedSlots, kPinnedBytes, 64, 31337);
  std::shared_ptr<io::PinnedRing> ring =
      std::make_shared<io::PinnedRing>(kPinnedSlots, kPinnedBytes, pinner);

  std::mutex live_mutex;
  std::unordered_set<const void*> live;  // pinned slots handed out and not yet dropped

  // Slots handed to the dropper thread, which drops them.
  std::mutex drop_mutex;
  std::condition_variable drop_cv;
  std::deque<PinnedSlot> drops;
  bool drop_stop = false;

  // Private rings' pinners that the dropper may still hold slots of: checked at the end.
  std::mutex pinners_mutex;
  std::vector<std::shared_ptr<TestPinner>> pinners;
};

// A slot from a pinned `ring` (made with `pinner`), checked and filled; a null
// buffer when `deadline` passed.
PinnedSlot pinned_take(PinnedWorld& pw, io::PinnedRing& ring, const TestPinner& pinner,
                       size_t max_buffers, size_t max_bytes, size_t size,
                       Clock::time_point deadline) {
  PinnedSlot slot{ring.acquire(size, deadline), 0, size};
  if (!slot.buffer) return slot;
  io::AlignedBuffer& b = *slot.buffer;
  const std::string& who = pinner.name();
  CHECK(b.size() == size && b.capacity() >= size && b.capacity() % kPage == 0 &&
            b.capacity() <= max_bytes,
        who + ": slot size " + std::to_string(b.size()) + "/" + std::to_string(b.capacity()) +
            " for " + std::to_string(size));
  CHECK(reinterpret_cast<uintptr_t>(b.data()) % kPage == 0, who + ": slot not page-aligned");
  CHECK(b.pinned(), who + ": slot not marked pinned");
  CHECK(b.fence == nullptr, who + ": a slot handed out with a fence");
  CHECK(!pw.copier.reading(b.data()), who + ": a slot handed out while a copy still reads it");
  CHECK(pinner.covers(b.data(), b.capacity()), who + ": a slot that is not page-locked");
  size_t slots = ring.slots(), bytes = ring.pinned_bytes();
  CHECK(slots <= max_buffers && slots >= 1,
        who + ": slots() says " + std::to_string(slots) + " slots");
  CHECK(bytes <= max_bytes && bytes >= b.capacity(),
        who + ": pinned_bytes() says " + std::to_string(bytes));
  {
    std::lock_guard<std::mutex> lock(pw.live_mutex);
    CHECK(pw.live.insert(b.data()).second, who + ": a pinned slot in use was handed out again");
  }
  slot.stamp = g_stamp.fetch_add(1, std::memory_order_relaxed);
  fill_pattern(b.data(), size, slot.stamp);
  g.pinned_slots.fetch_add(1, std::memory_order_relaxed);
  return slot;
}

// Queues device copies of the slot as cuda::CopyStream::copy_to_device does:
// none, one of all of it or of a piece, or two (a pair of fences); sometimes
// waits for them, as a synchronising user would.
void pinned_copy(PinnedWorld& pw, PinnedSlot& slot, Rng& rng) {
  io::AlignedBuffer& b = *slot.buffer;
  uint64_t how = pick(rng, 0, 9);
  if (how == 0) return;  // a slot nobody copied: no fence
  int copies = how == 9 ? 2 : 1;
  for (int k = 0; k < copies; ++k) {
    size_t offset = 0, length = slot.size;
    if (pick(rng, 0, 2) == 0) {
      offset = pick(rng, 0, slot.size);
      length = pick(rng, 0, slot.size - offset);
    }
    std::shared_ptr<io::Fence> fence = pw.copier.copy(b, offset, length, slot.stamp);
    if (b.fence && !b.fence->ready()) {
      b.fence = std::make_shared<io::FencePair>(b.fence, std::move(fence));
      g.pinned_pairs.fetch_add(1, std::memory_order_relaxed);
    } else {
      b.fence = std::move(fence);
    }
  }
  if (how == 1) b.fence->wait();
}

// Drops a slot (back to its ring, or freed when the ring is gone) after
// checking nobody else wrote to it.
void pinned_release(PinnedWorld& pw, PinnedSlot& slot, const std::string& how) {
  size_t bad = pattern_mismatch(slot.buffer->data(), 0, slot.size, slot.stamp);
  CHECK(bad == slot.size,
        how + ": byte " + std::to_string(bad) + " of a pinned slot in use was overwritten");
  {
    std::lock_guard<std::mutex> lock(pw.live_mutex);
    pw.live.erase(slot.buffer->data());
  }
  slot.buffer.reset();
}

void pinned_hand_over(PinnedWorld& pw, PinnedSlot slot) {
  {
    std::lock_guard<std::mutex> lock(pw.drop_mutex);
    pw.drops.push_back(std::move(slot));
  }
  pw.drop_cv.notify_one();
  g.pinned_handoffs.fetch_add(1, std::memory_order_relaxed);
}

// A request for more page-locked memory than the ring may hold: stoker::Error.
void pinned_refused(io::PinnedRing& ring, size_t max_bytes, size_t size) {
  std::string what = "pinned acquire(" + std::to_string(size) + ") from a ring of " +
                     std::to_string(max_bytes) + " bytes";
  try {
    auto slot = ring.acquire(size, Clock::now() + std::chrono::milliseconds(20));
    failure(what + (slot ? " handed out a slot" : " returned null") +
            " instead of throwing stoker::Error");
  } catch (const Error&) {
    g.pinned_refusals.fetch_add(1, std::memory_order_relaxed);
  } catch (const std::exception& e) {
    failure(what + " threw '" + e.what() + "' instead of a stoker::Error");
  }
}

size_t pinned_size(Rng& rng) {
  switch (pick(rng, 0, 9)) {
    case 0:
      return 0;
    case 1:
    case 2:
      return pick(rng, 1, kPage);
    case 3:
    case 4:
      return pick(rng, kPage + 1, 4 * kPage);
    case 5:
    case 6:
      return pick(rng, 1, 6 * kPage);
    case 7:
    case 8:  // two of these and a third slot do not fit: smaller idle slots go
      return pick(rng, 4 * kPage + 1, 10 * kPage);
    default:  // up to all of it
      return pick(rng, 10 * kPage + 1, kPinnedBytes);
  }
}

void pinned_client(int id, PinnedWorld& pw) {
  Rng rng(700 + id);
  const size_t kHuge[] = {kPinnedBytes + 1,     kPinnedBytes + kPage, 2 * kPinnedBytes,
                          SIZE_MAX / 2,         SIZE_MAX - kPage,     SIZE_MAX - kPage + 1,
                          SIZE_MAX - kPage + 2, SIZE_MAX - 1,         SIZE_MAX};
  while (!g_stop.load(std::memory_order_relaxed)) {
    uint64_t op = pick(rng, 0, 99);
    if (op < 3) {
      pinned_refused(*pw.ring, kPinnedBytes, kHuge[pick(rng, 0, std::size(kHuge) - 1)]);
      continue;
    }
    size_t size = pinned_size(rng);
    // Waiting for all of the ring could take long while the others keep slots.
    bool timed = op < 25 || size > 10 * kPage;
    auto deadline = timed ? Clock::now() + std::chrono::microseconds(pick(rng, 0, 3000))
                          : Clock::time_point::max();
    PinnedSlot slot;
    try {
      slot = pinned_take(pw, *pw.ring, *pw.pinner, kPinnedSlots, kPinnedBytes, size, deadline);
    } catch (const InjectedPinFailure&) {
      g.pin_failures.fetch_add(1, std::memory_order_relaxed);
      continue;
    } catch (const std::exception& e) {
      failure(std::string("pinned acquire: ") + e.what());
      continue;
    }
    if (!slot.buffer) {
      auto late = Clock::now() - deadline;
      CHECK(timed, "pinned acquire without a deadline returned null");
      g.pinned_timeouts.fetch_add(1, std::memory_order_relaxed);
      atomic_max(g.pinned_late_us,
                 std::max<int64_t>(
                     0, std::chrono::duration_cast<std::chrono::microseconds>(late).count()));
      continue;
    }
    pinned_copy(pw, slot, rng);
    if (pick(rng, 0, 3) == 0)
      std::this_thread::sleep_for(std::chrono::microseconds(pick(rng, 0, 300)));
    if (pick(rng, 0, 4) == 0)
      pinned_hand_over(pw, std::move(slot));
    else
      pinned_release(pw, slot, "pinned client");
  }
}

// Drops slots other threads handed over, sometimes after their ring died.
void pinned_dropper(PinnedWorld& pw) {
  Rng rng(950);
  for (;;) {
    PinnedSlot slot;
    {
      std::unique_lock<std::mutex> lock(pw.drop_mutex);
      pw.drop_cv.wait(lock, [&] { return pw.drop_stop || !pw.drops.empty(); });
      if (pw.drops.empty()) return;
      slot = std::move(pw.drops.front());
      pw.drops.pop_front();
    }
    if (pick(rng, 0, 1)) std::this_thread::sleep_for(std::chrono::microseconds(pick(rng, 0, 300)));
    pinned_release(pw, slot, "slot handed to another thread");
  }
}

// Private pinned rings that die while their slots are out (copies pending):
// the ring unpins its idle slots once their copies are done, and a slot
// dropped after its ring is unpinned (once its copy is done) and freed.
void pinned_private(PinnedWorld& pw) {
  Rng rng(900);
  while (!g_stop.load(std::memory_order_relaxed)) {
    size_t max_buffers = pick(rng, 1, 3);
    size_t pages = pick(rng, 1, 6);
    size_t max_bytes = pages * kPage + (pick(rng, 0, 1) ? pick(rng, 1, kPage - 1) : 0);
    auto pinner = std::make_shared<TestPinner>(pw.copier, "a private pinned ring", max_buffers,
                                               max_bytes, 0, rng());
    if (pick(rng, 0, 19) == 0) {
      try {
        io::PinnedRing none(0, max_bytes, pinner);
        failure("a pinned ring of 0 slots was made");
      } catch (const Error&) {
      }
    }
    auto ring = std::make_shared<io::PinnedRing>(max_buffers, max_bytes, pinner);
    std::vector<PinnedSlot> out;
    bool handed = false;
    for (size_t k = 0, n = pick(rng, 1, 6); k < n; ++k) {
      if (pick(rng, 0, 7) == 0) pinned_refused(*ring, max_bytes, pages * kPage + 1);
      size_t size = pick(rng, 0, 2) ? pick(rng, 0, kPage) : pick(rng, 0, pages * kPage);
      // This thread holds the slots that are out: only an empty hand waits for ever.
      auto deadline = out.empty() ? Clock::time_point::max()
                                  : Clock::now() + std::chrono::microseconds(pick(rng, 0, 2000));
      PinnedSlot slot;
      try {
        slot = pinned_take(pw, *ring, *pinner, max_buffers, max_bytes, size, deadline);
      } catch (const std::exception& e) {
        failure(std::string("private pinned acquire: ") + e.what());
        continue;
      }
      if (!slot.buffer) {
        CHECK(!out.empty(), "private pinned acquire without a deadline returned null");
        g.pinned_timeouts.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      pinned_copy(pw, slot, rng);
      if (pick(rng, 0, 1))
        out.push_back(std::move(slot));
      else
        pinned_release(pw, slot, "private pinned ring");  // idle, its copy maybe pending
    }
    // A slot dropped on another thread while the ring dies here.
    if (!out.empty() && pick(rng, 0, 3) == 0) {
      pinned_hand_over(pw, std::move(out.back()));
      out.pop_back();
      handed = true;
    }
    ring.reset();  // waits for the copies of its idle slots, unpins them
    if (!handed)
      CHECK(pinner->ranges() == out.size(), std::to_string(pinner->ranges()) +
                                                " ranges page-locked after a ring died with " +
                                                std::to_string(out.size()) + " slots out");
    g.private_rings.fetch_add(1, std::memory_order_relaxed);
    g.orphans.fetch_add(out.size(), std::memory_order_relaxed);
    for (auto& slot : out) {
      if (pick(rng, 0, 2) == 0) {
        pinned_hand_over(pw, std::move(slot));
        handed = true;
      } else {
        pinned_release(pw, slot, "slot of a dead pinned ring");
      }
    }
    if (handed) {
      std::lock_guard<std::mutex> lock(pw.pinners_mutex);
      pw.pinners.push_back(pinner);
    } else {
      CHECK(pinner->ranges() == 0 && pinner->bytes() == 0,
            std::to_string(pinner->ranges()) +
                " ranges still page-locked after a dead ring's slots were dropped");
    }
  }
}

}  // namespace

// ---------------------------------------------------------------- array rows

// An array of (kArrayRows, kArrayCols) uint32 values row * 1000 + col, in chunks of
// (16, 4) that cut across each row (two per row, the second partial), each shuffled
// and zlib-compressed; one chunk never written reads as the fill value. Clients read
// random rows, many sharing chunks, through both shared readers at once: the decoded
// chunks are shared between batches and threads through the readers' chunk caches.
constexpr uint64_t kArrayRows = 200, kArrayCols = 6, kChunkRows = 16, kChunkCols = 4;
constexpr uint64_t kMissingChunkIndex = 5;
constexpr uint32_t kFill = 0xDEADBEEF;

uint32_t array_value(uint64_t row, uint64_t col) {
  if ((row / kChunkRows) * 2 + col / kChunkCols == kMissingChunkIndex) return kFill;
  return static_cast<uint32_t>(row * 1000 + col);
}

std::shared_ptr<io::FileTable> make_array(const std::string& path) {
  auto a = std::make_shared<io::ArrayLayout>();
  a->id = io::next_layout_id();
  a->name = path + ":/x";
  a->shape = {kArrayRows, kArrayCols};
  a->chunk_shape = {kChunkRows, kChunkCols};
  a->itemsize = 4;
  a->fill.resize(4);
  std::memcpy(a->fill.data(), &kFill, 4);
  a->steps = {{io::ChunkFilter::kShuffle, 4}, {io::ChunkFilter::kZlib, 0}};
  a->paths = {path};
  std::vector<uint8_t> file;
  for (uint64_t c = 0; c < a->num_chunks(); ++c) {
    a->chunk_file.push_back(0);
    a->chunk_mask.push_back(0);
    if (c == kMissingChunkIndex) {
      a->chunk_offset.push_back(io::kMissingChunk);
      a->chunk_size.push_back(0);
      continue;
    }
    std::vector<uint32_t> values(kChunkRows * kChunkCols, 0);
    for (uint64_t r = 0; r < kChunkRows; ++r) {
      for (uint64_t k = 0; k < kChunkCols; ++k) {
        uint64_t row = (c / 2) * kChunkRows + r, col = (c % 2) * kChunkCols + k;
        if (row < kArrayRows && col < kArrayCols)
          values[r * kChunkCols + k] = array_value(row, col);
      }
    }
    std::vector<uint8_t> shuffled(values.size() * 4);
    const auto* bytes = reinterpret_cast<const uint8_t*>(values.data());
    for (size_t e = 0; e < values.size(); ++e) {
      for (size_t j = 0; j < 4; ++j) shuffled[j * values.size() + e] = bytes[e * 4 + j];
    }
    uLongf size = compressBound(shuffled.size());
    std::vector<uint8_t> packed(size);
    if (compress2(packed.data(), &size, shuffled.data(), shuffled.size(), 6) != Z_OK) {
      failure("compress2");
    }
    a->chunk_offset.push_back(file.size());
    a->chunk_size.push_back(size);
    file.insert(file.end(), packed.begin(), packed.begin() + size);
  }
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(file.data()), static_cast<std::streamsize>(file.size()));
  a->check();
  auto table = std::make_shared<io::FileTable>();
  table->paths = {path};
  table->arrays = {a};
  return table;
}

void array_client(int id, World& w, std::shared_ptr<const io::FileTable> table) {
  Rng rng(5000 + id);
  const uint64_t row_bytes = kArrayCols * 4;
  while (!g_stop.load(std::memory_order_relaxed)) {
    io::ShardReader& reader = pick(rng, 0, 1) ? *w.second : *w.first;
    size_t n = pick(rng, 1, 64);
    uint64_t near = pick(rng, 0, kArrayRows - 1);
    std::vector<io::ReadRequest> requests(n);
    for (size_t i = 0; i < n; ++i) {
      io::ReadRequest& r = requests[i];
      r.codec = io::Codec::kArrayRow;
      // Rows near one another (sharing chunks), with some anywhere.
      r.offset = pick(rng, 0, 3) ? std::min(kArrayRows - 1, near + pick(rng, 0, 40))
                                 : pick(rng, 0, kArrayRows - 1);
      r.out_length = row_bytes;
      r.dest_offset = i * 32;
    }
    std::vector<uint8_t> dest(n * 32);
    try {
      reader.submit(table, requests, dest.data(), dest.size())->wait(-1);
    } catch (const std::exception& e) {
      failure(std::string("array rows: ") + e.what());
      continue;
    }
    for (size_t i = 0; i < n; ++i) {
      for (uint64_t col = 0; col < kArrayCols; ++col) {
        uint32_t got;
        std::memcpy(&got, dest.data() + i * 32 + col * 4, 4);
        CHECK(got == array_value(requests[i].offset, col),
              "array row " + std::to_string(requests[i].offset) + " col " + std::to_string(col));
      }
    }
    g.array_batches++;
    g.array_rows += n;
  }
}

// The reader's Backlog, with batches of our own: the oldest batch with a chunk left comes
// first, its own waiter's batch is skipped, batches fully claimed or gone are dropped (and
// none that is neither: every one stays offered until it is), and it never grows past the
// batches still wanting help.
struct BacklogBatch {
  bool open = true;
  bool unclaimed() const { return open; }
};

void check_present_pages() {
  // 3 leaves of 32,768 pages, the last partly used.
  const uint64_t pages = 2 * 32768 + 100;
  io::PageLedger roomy(uint64_t(1) << 40);
  io::PresentPages present(pages, roomy);
  auto expect = [&](uint64_t first, uint64_t end, bool want, const char* when) {
    if (present.all(first, end) != want) failure(std::string("present pages: ") + when);
  };
  expect(0, 1, false, "a page never marked");
  expect(5, 5, true, "an empty range");
  present.mark(60, 70);  // across a word
  expect(60, 70, true, "the pages marked");
  expect(61, 69, true, "pages inside those marked");
  expect(59, 70, false, "a page before");
  expect(60, 71, false, "a page after");
  present.mark(32768 - 3, 32768 + 3);  // across a leaf
  expect(32768 - 3, 32768 + 3, true, "pages across two leaves");
  expect(32768 - 4, 32768 + 3, false, "one more before a leaf's end");
  present.mark(64, 128);  // a whole word
  expect(60, 128, true, "a word marked whole, after a part of the one before");
  present.mark(192, 256);
  expect(64, 256, false, "a word unmarked between two marked");
  present.mark(pages - 1, pages);
  expect(pages - 1, pages, true, "the last page");
  expect(2 * 32768, pages, false, "the last leaf but one page");

  // Past its ledger's budget every note is dropped, and marking starts again.
  io::PageLedger small(100);
  io::PresentPages first(1000, small), second(1000, small);
  first.mark(0, 60);
  second.mark(0, 30);
  if (!first.all(0, 60) || !second.all(0, 30)) failure("present pages: notes under the budget");
  first.mark(50, 70);  // 10 more pages noted: 100, not past it
  if (!first.all(0, 70)) failure("present pages: notes at the budget");
  second.mark(30, 31);  // 101: past it
  if (first.all(0, 1) || second.all(30, 31)) failure("present pages: notes past the budget");
  first.mark(5, 6);
  if (!first.all(5, 6) || first.all(0, 5)) failure("present pages: marks of a new generation");

  // Threads marking one leaf's words at once, each round on a fresh map whose leaf the
  // threads race to make: every bit lands, in the leaf that won.
  for (int round = 0; round < 20; ++round) {
    io::PresentPages shared(32768, roomy);
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    for (uint64_t t = 0; t < 4; ++t) {
      threads.emplace_back([&shared, &ready, t] {
        ready.fetch_add(1);
        while (ready.load() < 4) {
        }
        for (uint64_t page = t; page < 32768; page += 4) shared.mark(page, page + 1);
      });
    }
    for (auto& thread : threads) thread.join();
    if (!shared.all(0, 32768)) failure("present pages: marks made at once went missing");
  }
}

void check_chunk_cache() {
  using io::ChunkCache;
  using io::ChunkRegion;
  const uint64_t layout = 7, part = 5 | ChunkCache::kPartOfChunk;

  // Foresight counts tasks down, merges windows, and a fresh one forgets the layout's.
  ChunkCache cache(uint64_t(64) << 20);
  ChunkCache::Foresight two;
  two.tasks_left = 2;
  two.region = {10, 20, 30, 40};
  two.keep = true;
  cache.foresee(layout, {{5, two}}, true);
  ChunkCache::Foresight seen;
  if (!cache.take_foresight(layout, 5, seen) || seen.tasks_left != 1 || !seen.keep ||
      !seen.region.holds({10, 20, 30, 40})) {
    failure("chunk cache: the first of two tasks foreseen");
  }
  two.region = {0, 5, 0, 5};
  two.keep = false;
  cache.foresee(layout, {{5, two}}, false);  // the next window: 1 + 2 left, regions merged
  if (!cache.take_foresight(layout, 5, seen) || seen.tasks_left != 2 || !seen.keep ||
      !seen.region.holds({0, 20, 0, 40})) {
    failure("chunk cache: a window's foresight merged into the last's");
  }
  cache.foresee(layout, {{6, two}}, true);  // a new epoch: chunk 5's are forgotten
  if (cache.take_foresight(layout, 5, seen) || cache.take_foresight(layout + 1, 6, seen)) {
    failure("chunk cache: foresight left behind by a fresh one, or of another layout");
  }
  if (!cache.take_foresight(layout, 6, seen) || !cache.take_foresight(layout, 6, seen) ||
      cache.take_foresight(layout, 6, seen)) {
    failure("chunk cache: foresight outlives its last task");
  }

  // A part is kept under its own key, with its region, and never found as the whole.
  auto bytes = cache.buffer(1000);
  const uint8_t* where = bytes->data();
  cache.put(layout, part, bytes, {1, 2, 3, 4});
  ChunkRegion held;
  if (cache.find(layout, 5) || !cache.find(layout, part, &held) || !held.holds({1, 2, 3, 4}) ||
      held.holds({0, 2, 3, 4})) {
    failure("chunk cache: a part found as the whole, or with another region");
  }
  auto wider = cache.buffer(1000);
  cache.put(layout, part, wider, {0, 9, 0, 9}, true);
  if (!cache.find(layout, part, &held) || !held.holds({0, 9, 0, 9})) {
    failure("chunk cache: a part put in place of another");
  }
  cache.erase(layout, part);
  if (cache.find(layout, part)) failure("chunk cache: a part let go of is still found");
  bytes.reset();  // its last holder: the buffer goes back for the next of its size
  if (cache.buffer(1000)->data() != where) failure("chunk cache: a buffer given back not reused");

  // Threads taking buffers, keeping and letting go of them, in a cache small enough to drop
  // chunks all the time: a buffer is handed out again only once nobody holds its bytes.
  auto small = std::make_unique<ChunkCache>(64 * 4096);
  std::vector<ChunkCache::Bytes> outlive;  // held past the cache's end
  std::mutex outlive_mutex;
  std::vector<std::thread> threads;
  for (uint8_t t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (uint64_t i = 0; i < 2000; ++i) {
        const uint64_t chunk = (t * 1000003 + i) % 97 | ((i & 1) ? ChunkCache::kPartOfChunk : 0);
        auto mine = small->buffer(4096);
        std::memset(mine->data(), t + 1, mine->size());
        small->put(layout, chunk, mine, {0, 1, 0, 1});
        if (i % 3 == 0) small->erase(layout, chunk);
        ChunkCache::Bytes found = small->find(layout, chunk);
        if (found && ((*found)[0] == 0 || (*found)[0] > 4)) failure("chunk cache: torn bytes");
        if (mine->front() != t + 1 || mine->back() != t + 1) {
          failure("chunk cache: a buffer handed out again while its bytes were held");
        }
        if (i % 500 == 0) {
          std::lock_guard<std::mutex> lock(outlive_mutex);
          outlive.push_back(std::move(mine));
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  small.reset();
  outlive.clear();  // given back after the cache is gone: freed, not pooled
}

void check_backlog() {
  io::Backlog<BacklogBatch> backlog;
  std::vector<std::shared_ptr<BacklogBatch>> batches;
  for (int i = 0; i < 5; ++i) {
    batches.push_back(std::make_shared<BacklogBatch>());
    backlog.add(batches.back());
  }
  auto expect = [&](const BacklogBatch* except, int index, size_t size, const char* when) {
    auto got = backlog.oldest_unclaimed(except);
    const BacklogBatch* want = index < 0 ? nullptr : batches[size_t(index)].get();
    if (got.get() != want || backlog.size() != size) {
      failure(std::string("backlog ") + when + ": not the batch or the count expected");
    }
  };
  expect(nullptr, 0, 5, "at first");
  expect(nullptr, 0, 5, "asked again");  // asking takes nothing away
  expect(batches[0].get(), 1, 5, "skipping the waiter's own");
  batches[0]->open = false;
  expect(nullptr, 1, 4, "the oldest fully claimed");
  batches[2].reset();  // its owner let go of it
  expect(batches[1].get(), 3, 3, "one gone");
  batches[1]->open = batches[3]->open = false;
  expect(nullptr, 4, 1, "all but the newest claimed");
  expect(batches[4].get(), -1, 1, "only the waiter's own left");
  for (int i = 0; i < 1000; ++i) {  // added and finished, never asked: stays small
    auto batch = std::make_shared<BacklogBatch>();
    backlog.add(batch);
    batch->open = false;
  }
  if (backlog.size() > 2) failure("backlog: batches fully claimed pile up when nobody asks");
}

int main(int argc, char** argv) {
  stoker::text::register_decoders();  // the reader's integer members, as the Python module does
  if (argc > 1 && (std::strcmp(argv[1], "-h") == 0 || std::strcmp(argv[1], "--help") == 0)) {
    std::printf("usage: %s [SECONDS [DIR]]\n", argv[0]);
    return 0;
  }
  double seconds = argc > 1 ? std::atof(argv[1]) : 10.0;
  if (!(seconds > 0)) {
    std::fprintf(stderr, "seconds must be positive, got '%s'\n", argv[1]);
    return 2;
  }
  std::string dir;
  bool remove_dir = false;
  if (argc > 2) {
    dir = argv[2];
    std::filesystem::create_directories(dir);
  } else {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/stoker-stress-XXXXXX";
    if (mkdtemp(templ.data()) == nullptr) {
      std::perror("mkdtemp");
      return 2;
    }
    dir = templ;
    remove_dir = true;
  }

  check_backlog();
  check_present_pages();
  check_chunk_cache();
  auto started = Clock::now();
  World w;
  const size_t kShards = 6;
  for (size_t s = 0; s < kShards; ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "/shard-%06zu.tar", s);
    w.shards.push_back(make_shard(dir + name, s, 30 + 6 * s));
    w.paths.push_back(w.shards.back().path);
  }
  uint64_t total_bytes = 0;
  for (const auto& shard : w.shards) total_bytes += shard.bytes.size();

  std::vector<format::ShardIndex> indexes;
  try {
    indexes = format::index_shards(w.paths, std::vector<std::string>(kShards, "tar"), 3);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: indexing: %s\n", e.what());
    if (remove_dir) std::filesystem::remove_all(dir);
    return 1;
  }
  for (size_t s = 0; s < kShards; ++s) check_index(w.shards[s], indexes[s]);
  if (g_failures.load() != 0) {
    if (remove_dir) std::filesystem::remove_all(dir);
    return 1;
  }

  auto checked = std::make_shared<io::FileTable>();
  auto unchecked = std::make_shared<io::FileTable>();
  auto stale = std::make_shared<io::FileTable>();
  checked->paths = unchecked->paths = stale->paths = w.paths;
  for (const auto& ix : indexes) {
    checked->identities.push_back(ix.identity);
    io::FileIdentity changed = ix.identity;
    changed.mtime_ns += 1;
    stale->identities.push_back(changed);
  }
  w.checked = checked;
  w.unchecked = unchecked;
  w.stale = stale;
  // Few descriptors, so they are evicted (and forgotten) while reads use them.
  w.first = std::make_unique<io::ShardReader>(3, 2);
  w.second = std::make_unique<io::ShardReader>(2, 1);

  std::printf(
      "stoker_stress: %zu shards (%.1f MB) in %s, %.1f s of 4 clients, 1 helper, "
      "1 forgetter, 2 array-row clients, 2 FileCache and 3 PinnedRing threads; 4 pinned-ring "
      "clients, 1 private "
      "pinned ring thread, 1 dropper, 1 copier\n",
      kShards, total_bytes / 1e6, dir.c_str(), seconds);
  std::fflush(stdout);

  PinnedWorld pw;
  std::vector<std::thread> threads;
  std::shared_ptr<const io::FileTable> array_table = make_array(dir + "/array.bin");
  for (int i = 0; i < 4; ++i) threads.emplace_back(client, i, std::ref(w));
  for (int i = 0; i < 2; ++i) threads.emplace_back(array_client, i, std::ref(w), array_table);
  threads.emplace_back(forgetter, std::ref(w));
  for (int i = 0; i < 2; ++i) threads.emplace_back(cache_worker, i, std::ref(w));
  for (int i = 0; i < 3; ++i) threads.emplace_back(ring_worker, i, std::ref(w));
  for (int i = 0; i < 4; ++i) threads.emplace_back(pinned_client, i, std::ref(pw));
  threads.emplace_back(pinned_private, std::ref(pw));
  std::thread helper_thread(helper, std::ref(w));
  std::thread dropper_thread(pinned_dropper, std::ref(pw));

  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(seconds));
  while (Clock::now() < deadline && g_failures.load() == 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  g_stop = true;
  // A thread that never finishes (a waiter nobody wakes) fails the run
  // instead of hanging it.
  std::mutex finish_mutex;
  std::condition_variable finish_cv;
  bool finished = false;
  std::weak_ptr<io::PinnedRing> watched = pw.ring;
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> lock(finish_mutex);
    if (!finish_cv.wait_for(lock, std::chrono::seconds(120), [&] { return finished; })) {
      auto ring = watched.lock();
      std::fprintf(stderr,
                   "FAIL: stoker_stress: threads still running 120 s after the stop (a waiter "
                   "never woken?); the shared pinned ring has %zu slots, %zu idle\n",
                   ring ? ring->slots() : 0, ring ? ring->idle_slots() : 0);
      std::fflush(stderr);
      std::_Exit(1);
    }
  });
  for (auto& t : threads) t.join();
  w.helper_stop = true;
  w.handoff_cv.notify_all();
  helper_thread.join();
  {
    std::lock_guard<std::mutex> lock(pw.drop_mutex);
    pw.drop_stop = true;
  }
  pw.drop_cv.notify_all();
  dropper_thread.join();

  for (auto& slot : w.exchange) release(w, slot, "exchange at the end");
  w.exchange.clear();
  CHECK(w.live.empty(), std::to_string(w.live.size()) + " slots never released");
  CHECK(w.ring->idle_slots() <= 4, "the ring keeps more idle slots than asked");
  // Destroying a reader joins its threads and drops queued work: no batch is
  // left holding a dropped buffer after that.
  w.first.reset();
  w.second.reset();
  size_t alive = 0;
  for (const auto& grave : w.graves) alive += !grave.pending.expired();
  CHECK(alive == 0, std::to_string(alive) + " dropped batches outlived their readers");
  w.graves.clear();

  // Every pinned slot is dropped; the rings go, once their copies are done:
  // then nothing may be page-locked any more.
  CHECK(pw.live.empty(), std::to_string(pw.live.size()) + " pinned slots never released");
  CHECK(pw.ring->slots() <= kPinnedSlots && pw.ring->pinned_bytes() <= kPinnedBytes &&
            pw.ring->idle_slots() == pw.ring->slots() &&
            pw.ring->pinned_bytes() == pw.pinner->bytes(),
        "the shared pinned ring at the end: " + std::to_string(pw.ring->slots()) + " slots, " +
            std::to_string(pw.ring->idle_slots()) + " idle, " +
            std::to_string(pw.ring->pinned_bytes()) + " bytes (the pinner saw " +
            std::to_string(pw.pinner->bytes()) + ")");
  size_t pinned_peak = pw.pinner->peak();
  pw.ring.reset();
  pw.pinners.push_back(pw.pinner);
  for (const auto& pinner : pw.pinners)
    CHECK(pinner->ranges() == 0 && pinner->bytes() == 0,
          pinner->name() + ": " + std::to_string(pinner->ranges()) + " ranges (" +
              std::to_string(pinner->bytes()) + " bytes) still page-locked at the end");
  pw.pinners.clear();
  pw.pinner.reset();
  pw.copier.stop();
  CHECK(g.pins == g.unpins,
        std::to_string(g.pins) + " pins but " + std::to_string(g.unpins) + " unpins");
  {
    std::lock_guard<std::mutex> lock(finish_mutex);
    finished = true;
  }
  finish_cv.notify_all();
  watchdog.join();

  double elapsed = std::chrono::duration<double>(Clock::now() - started).count();
  std::printf(
      "stoker_stress: %llu batches checked (%llu pieces, %.1f MB), %llu cancelled in flight "
      "(%llu too late to cancel), %llu dropped unwaited, %llu handed to another waiter, %llu "
      "through short-lived readers, %llu expected errors, %llu polls, %llu spins; %llu forgets, "
      "%llu FileCache reads; %llu ring slots (%llu passed between threads, %llu dead rings); "
      "%.1f s\n",
      (unsigned long long)g.batches, (unsigned long long)g.pieces, g.bytes / 1e6,
      (unsigned long long)g.cancels, (unsigned long long)g.late_cancels,
      (unsigned long long)g.dropped, (unsigned long long)g.handoffs,
      (unsigned long long)g.ephemeral, (unsigned long long)g.expected_errors,
      (unsigned long long)g.polls, (unsigned long long)g.spins, (unsigned long long)g.forgets,
      (unsigned long long)g.cache_reads, (unsigned long long)g.ring_slots,
      (unsigned long long)g.ring_passes, (unsigned long long)g.dead_rings, elapsed);
  std::printf("stoker_stress: %llu array-row batches (%llu rows) checked\n",
              (unsigned long long)g.array_batches, (unsigned long long)g.array_rows);
  std::printf(
      "stoker_stress: pinned ring: %llu slots (%llu copies, %llu of them paired; %llu handed to "
      "another thread; %llu deadlines passed, at most %.1f ms late), %llu oversized requests "
      "refused, %llu injected pin failures, %llu private rings (%llu slots outliving them); "
      "%llu pins, %llu unpins, at most %zu of %zu bytes page-locked; %llu copies saw their "
      "slot changed\n",
      (unsigned long long)g.pinned_slots, (unsigned long long)g.pinned_copies,
      (unsigned long long)g.pinned_pairs, (unsigned long long)g.pinned_handoffs,
      (unsigned long long)g.pinned_timeouts, g.pinned_late_us / 1e3,
      (unsigned long long)g.pinned_refusals, (unsigned long long)g.pin_failures,
      (unsigned long long)g.private_rings, (unsigned long long)g.orphans,
      (unsigned long long)g.pins, (unsigned long long)g.unpins, pinned_peak, kPinnedBytes,
      (unsigned long long)g.pinned_mismatches);

  if (remove_dir) std::filesystem::remove_all(dir);
  uint64_t failures = g_failures.load();
  if (failures == 0 && (g.batches == 0 || g.array_batches == 0 || g.cancels + g.late_cancels == 0 ||
                        g.pinned_slots == 0 || g.pinned_copies == 0 || g.orphans == 0)) {
    std::fprintf(stderr, "FAIL: the run was too short to exercise anything\n");
    return 1;
  }
  if (failures != 0) {
    std::fprintf(stderr, "stoker_stress: %llu check(s) FAILED\n", (unsigned long long)failures);
    return 1;
  }
  std::printf("stoker_stress: all checks passed\n");
  return 0;
}
