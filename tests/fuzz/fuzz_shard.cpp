// libFuzzer target for the shard parsers and the reader on what they index.
//
// Input: one byte that picks the format (byte % 10: 0 tar, 1 zip, 2 npy, 3 a
// member index sidecar, 4 an image, 5 array chunks, 6 a gzip file, 7 an MDS
// shard or LitData chunk: a first line with its record format, "mds|a:8|b:v",
// then the shard, 8 a TIFF), then the shard's (or the sidecar's, or the image's) bytes. A gzip file
// (a .nii.gz) is read as a stream in uneven pieces, then finished (every trailer checked). An image
// is decoded as Image fields decode it, directly and through the reader with blank_on_error; a
// JPEG also as a TIFF tile, in parts with entropy marks, skimmed and not (which must agree). Array
// chunks are an array source's layout and its chunks (fuzz_chunks): every row is read through the
// reader, and rows of chunks stored as they are used must equal a plain recomputation of where each
// element lies. A TIFF's directories are parsed from memory and from a file, which must agree; each
// must describe only bytes inside the input, as many tiles (strips) as its image's grid has, and
// those read back through the reader as the input holds them. A sidecar is decoded, and what it
// says checked as any index is. A shard is
//   1. indexed from memory (a WindowReader over the bytes, with a small window
//      so that headers straddle windows) and from a real file (a memfd opened
//      by its /proc/self/fd path, as a Dataset opens a shard); the two must
//      agree exactly, and an index must only describe bytes inside the file;
//   2. read back with io::ShardReader, every member the index found, in
//      batches: stored bytes must equal the input's, deflated members are
//      inflated and CRC-checked by the reader.
// stoker::FormatError and stoker::ReadError are the expected rejections of bad
// input. Anything else (another exception, a crash, a sanitizer report, a
// hang, an index that points outside the file, wrong bytes) is a bug: the
// harness aborts with a message so that libFuzzer saves the input.
//
// Format 9 is a Parquet file: its footer is located and parsed, and every column chunk it
// names decoded from the input; each decoded buffer must be what view_decoded promises.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

#include "stoker/errors.hpp"
#include "stoker/format/parquet.hpp"
#include "stoker/format/shard_index.hpp"
#include "stoker/format/sidecar.hpp"
#include "stoker/format/tiff.hpp"
#include "stoker/format/window_reader.hpp"
#include "stoker/image/codec.hpp"
#include "stoker/image/image.hpp"
#include "stoker/io/array_layout.hpp"
#include "stoker/io/inflate.hpp"
#include "stoker/io/shard_reader.hpp"
#include "stoker/text/ascii_int.hpp"

namespace {

using stoker::format::ShardIndex;
using stoker::io::Codec;
using stoker::io::ReadRequest;

constexpr const char* kFormats[] = {"tar",   "zip",  "npy",    "idx",  "image",
                                    "chunk", "gzip", "record", "tiff", "parquet"};
constexpr size_t kNumFormats = sizeof kFormats / sizeof kFormats[0];
// What one input may make the harness decode in all, and per batch of reads:
// bounded, so memory stays far below libFuzzer's -rss_limit_mb.
constexpr uint64_t kMaxDecodedBytes = 64ull << 20;
constexpr size_t kBatchMembers = 256;
constexpr size_t kMaxMembers = 1024;
constexpr uint64_t kAlign = 64;  // as the Python Dataset lays out a batch

[[noreturn]] void bug(const std::string& what) {
  std::fprintf(stderr, "\n==stoker-fuzz== BUG: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// How indexing one input ended: an index, or a rejection (its offset and its
// message without the leading file name, so that the same rejection from
// memory and from the memfd compare equal).
struct Outcome {
  bool ok = false;
  uint64_t offset = 0;
  std::string message;
  ShardIndex index;
};

std::string without_path(const stoker::Error& e) {
  std::string what = e.what();
  if (!e.path().empty() && what.compare(0, e.path().size(), e.path()) == 0) {
    what.erase(0, e.path().size());
  }
  return what;
}

// Runs `parse`; FormatError and ReadError are outcomes, anything else a bug.
template <typename Parse>
Outcome attempt(const char* stage, Parse parse) {
  Outcome out;
  try {
    out.index = parse();
    out.ok = true;
  } catch (const stoker::FormatError& e) {
    out.offset = e.offset();
    out.message = without_path(e);
  } catch (const stoker::ReadError& e) {
    out.offset = e.offset();
    out.message = without_path(e);
  } catch (const std::exception& e) {
    bug(std::string(stage) + " threw " + typeid(e).name() + ": " + e.what());
  } catch (...) {
    bug(std::string(stage) + " threw something that is not a std::exception");
  }
  return out;
}

// What a Dataset assumes of any index the parsers return.
void check_index(const ShardIndex& index, const std::string& format, uint64_t size, bool located) {
  const std::string name = format.substr(0, format.find('|'));  // a record format's kind
  if (index.format != name) bug("index format '" + index.format + "' for a " + name);
  if (format == "npy") {
    const auto& h = index.npy;
    if (h.shape.empty() || h.itemsize == 0) bug("npy index without shape or itemsize");
    if (h.data_offset > size) bug("npy data offset past the end of the file");
    uint64_t rows = h.shape[0];
    if (h.row_bytes != 0 && rows > (size - h.data_offset) / h.row_bytes) {
      bug("npy index has " + std::to_string(rows) + " rows of " + std::to_string(h.row_bytes) +
          " bytes from offset " + std::to_string(h.data_offset) + " in a file of " +
          std::to_string(size) + " bytes");
    }
    return;
  }
  size_t members = index.member_field.size();
  if (index.member_offset.size() != members || index.member_length.size() != members ||
      index.member_out_length.size() != members || index.member_codec.size() != members ||
      index.member_crc.size() != members) {
    bug("member columns differ in length");
  }
  const auto& starts = index.sample_start;
  if (starts.size() != index.keys.size() + 1 || starts.front() != 0 || starts.back() != members) {
    bug("sample_start does not bracket the members");
  }
  for (size_t s = 0; s + 1 < starts.size(); ++s) {
    if (starts[s] >= starts[s + 1]) bug("a sample with no members");
  }
  for (size_t m = 0; m < members; ++m) {
    if (index.member_field[m] >= index.field_names.size()) bug("member field id out of range");
    auto codec = static_cast<Codec>(index.member_codec[m]);
    uint64_t offset = index.member_offset[m], length = index.member_length[m];
    uint64_t out = index.member_out_length[m];
    if (codec == Codec::kStored) {
      if (out != length) bug("stored member whose decoded length differs from its length");
    } else if (codec == Codec::kDeflate) {
      if (format != "zip") bug("a deflated member outside a zip");
    } else {
      bug("member codec " + std::to_string(index.member_codec[m]));
    }
    if (located && (offset > size || length > size - offset)) {
      bug("member " + std::to_string(m) + " (" + std::to_string(length) + " bytes at " +
          std::to_string(offset) + ") lies outside the file of " + std::to_string(size) + " bytes");
    }
  }
}

bool same_members(const ShardIndex& a, const ShardIndex& b, bool compare_offsets) {
  return a.keys == b.keys && a.sample_start == b.sample_start && a.field_names == b.field_names &&
         a.member_field == b.member_field &&
         (!compare_offsets || a.member_offset == b.member_offset) &&
         a.member_length == b.member_length && a.member_out_length == b.member_out_length &&
         a.member_codec == b.member_codec && a.member_crc == b.member_crc;
}

bool same_index(const ShardIndex& a, const ShardIndex& b) {
  const auto &x = a.npy, &y = b.npy;
  return same_members(a, b, true) && x.descr == y.descr && x.fortran_order == y.fortran_order &&
         x.shape == y.shape && x.data_offset == y.data_offset && x.itemsize == y.itemsize &&
         x.row_bytes == y.row_bytes;
}

// A memfd holding the shard: a real file for the parsers and the reader.
class MemFile {
 public:
  MemFile(const uint8_t* data, size_t size) {
    fd_ = memfd_create("stoker-fuzz", MFD_CLOEXEC);
    if (fd_ < 0) bug(std::string("memfd_create: ") + std::strerror(errno));
    for (size_t done = 0; done < size;) {
      ssize_t n = write(fd_, data + done, size - done);
      if (n <= 0) bug(std::string("write to memfd: ") + std::strerror(errno));
      done += static_cast<size_t>(n);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemFile() { close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

stoker::io::ShardReader& reader() {
  static stoker::io::ShardReader instance(/*num_threads=*/2, /*max_open_files=*/4);
  return instance;
}

// The requests that read the index's members (the rows of a .npy), as the
// Dataset makes them: each at the next aligned offset of one buffer.
std::vector<ReadRequest> member_requests(const ShardIndex& index) {
  std::vector<ReadRequest> requests;
  uint64_t decoded = 0;
  auto add = [&](uint64_t offset, uint64_t length, uint64_t out, Codec codec, uint32_t crc) {
    if (requests.size() >= kMaxMembers || out > kMaxDecodedBytes - decoded) return false;
    decoded += out;
    ReadRequest r;
    r.offset = offset;
    r.length = length;
    r.out_length = out;
    r.codec = codec;
    r.check_crc = codec != Codec::kStored;  // as the bindings do by default
    r.crc32 = crc;
    requests.push_back(r);
    return true;
  };
  if (index.format == "npy") {
    const auto& h = index.npy;
    for (uint64_t row = 0; row < h.shape[0]; ++row) {
      if (!add(h.data_offset + row * h.row_bytes, h.row_bytes, h.row_bytes, Codec::kStored, 0)) {
        break;
      }
    }
  } else {
    for (size_t m = 0; m < index.member_offset.size(); ++m) {
      if (!add(index.member_offset[m], index.member_length[m], index.member_out_length[m],
               static_cast<Codec>(index.member_codec[m]), index.member_crc[m])) {
        break;
      }
    }
  }
  return requests;
}

// Reads `requests` in one batch; stored bytes must equal the input's.
void read_batch(const std::shared_ptr<const stoker::io::FileTable>& files,
                std::vector<ReadRequest> requests, const uint8_t* shard) {
  uint64_t size = 0;
  for (auto& r : requests) {
    r.dest_offset = size;
    size += (r.out_length + kAlign - 1) / kAlign * kAlign;
  }
  // Exactly the batch's size, so that AddressSanitizer sees any write past it.
  std::unique_ptr<uint8_t[]> buffer(new uint8_t[size == 0 ? 1 : size]);
  try {
    reader().submit(files, requests, buffer.get(), size)->wait(-1);
  } catch (const stoker::FormatError&) {
    return;
  } catch (const stoker::ReadError&) {
    return;
  } catch (const std::exception& e) {
    bug(std::string("ShardReader threw ") + typeid(e).name() + ": " + e.what());
  }
  for (const auto& r : requests) {
    if (r.codec == Codec::kStored &&
        std::memcmp(buffer.get() + r.dest_offset, shard + r.offset, r.length) != 0) {
      bug("stored member at offset " + std::to_string(r.offset) +
          " read back with other bytes than the file holds");
    }
  }
}

// ASCII integers (WebDataset .cls, the Loader's Int()): the same members
// decoded by the reader's integer parser.
void read_as_ints(const std::shared_ptr<const stoker::io::FileTable>& files,
                  const ShardIndex& index) {
  std::vector<ReadRequest> requests;
  for (size_t m = 0; m < index.member_offset.size() && requests.size() < kBatchMembers; ++m) {
    if (static_cast<Codec>(index.member_codec[m]) != Codec::kStored) continue;
    ReadRequest r;
    r.offset = index.member_offset[m];
    r.length = index.member_length[m];
    r.out_length = sizeof(int64_t);
    r.codec = stoker::text::kAsciiInt;
    r.dest_offset = requests.size() * sizeof(int64_t);
    requests.push_back(r);
  }
  if (requests.empty()) return;
  std::vector<uint8_t> buffer(requests.size() * sizeof(int64_t));
  try {
    reader().submit(files, std::move(requests), buffer.data(), buffer.size())->wait(-1);
  } catch (const stoker::FormatError&) {
  } catch (const stoker::ReadError&) {
  } catch (const std::exception& e) {
    bug(std::string("ShardReader (ASCII integers) threw ") + typeid(e).name() + ": " + e.what());
  }
}

}  // namespace

// A JPEG, also as a TIFF tile: parts of it decoded with entropy marks, twice over (the
// second pass from the marks the first left), with stoker's skim decoder off and then on.
// Skimming only changes how the MCUs no part uses are stepped over: each part must end
// with the same error, or the same pixels, either way.
void fuzz_jpeg_tile(const uint8_t* bytes, uint64_t size) {
  namespace detail = stoker::image::detail;
  constexpr uint64_t kMaxPixels = 1u << 18;
  uint32_t width = 0, height = 0, components = 0;
  const detail::TileCheck fits = [&](uint32_t w, uint32_t h, uint32_t c) {
    if (uint64_t(w) * h > kMaxPixels) return std::string("larger than this harness decodes");
    width = w;
    height = h;
    components = c;
    return std::string();
  };
  std::vector<uint8_t> pixels(kMaxPixels * 3);
  detail::decode_jpeg_tile(nullptr, 0, bytes, size, false, fits, pixels.data(), {}, nullptr);
  if (width == 0 || height == 0) return;
  const detail::TileRegion parts[] = {{height / 2, height / 2 + 1, 0, width},
                                      {height / 3, height, width / 4, width / 2 + 1},
                                      {0, height / 4 + 1, width / 2, width},
                                      {height - 1, height, width - 1, width}};
  struct Outcome {
    std::string error;
    std::vector<uint8_t> pixels;  // the part's, row by row
  };
  std::vector<Outcome> outcomes[2];
  for (int skim = 0; skim < 2; ++skim) {
    detail::allow_entropy_skim(skim == 1);
    detail::EntropyMarks marks;
    for (int pass = 0; pass < 2; ++pass) {
      for (const detail::TileRegion& part : parts) {
        std::fill(pixels.begin(), pixels.end(), 0);
        Outcome o;
        o.error = detail::decode_jpeg_tile(nullptr, 0, bytes, size, false, fits, pixels.data(),
                                           part, &marks);
        if (o.error.empty()) {
          const size_t row_bytes = size_t(width) * components;
          for (uint32_t row = part.row0; row < part.row1; ++row) {
            const uint8_t* at = pixels.data() + row * row_bytes + size_t(part.col0) * components;
            o.pixels.insert(o.pixels.end(), at, at + size_t(part.col1 - part.col0) * components);
          }
        }
        outcomes[skim].push_back(std::move(o));
      }
    }
  }
  detail::allow_entropy_skim(true);
  for (size_t i = 0; i < outcomes[0].size(); ++i) {
    if (outcomes[0][i].error != outcomes[1][i].error) {
      bug("a JPEG tile's part " + std::to_string(i) + " failed differently when skimmed: \"" +
          outcomes[0][i].error + "\" against \"" + outcomes[1][i].error + "\"");
    }
    if (outcomes[0][i].pixels != outcomes[1][i].pixels) {
      bug("a JPEG tile's part " + std::to_string(i) + " decoded to other pixels when skimmed");
    }
  }
}

// An image: decoded into a few targets (each crop mode, both layouts) with a
// pixel limit that keeps one input's memory small; FormatError is the expected
// rejection. Then through the reader as one piece of a batch that blanks what
// does not decode: that must never fail.
void fuzz_image(const uint8_t* bytes, uint64_t size) {
  using stoker::image::Crop;
  using stoker::image::Target;
  std::vector<std::shared_ptr<Target>> targets;
  for (Crop crop : {Crop::kNone, Crop::kRandom, Crop::kCenter}) {
    auto t = std::make_shared<Target>();
    t->crop = crop;
    t->height = crop == Crop::kRandom ? 16 : 24;
    t->width = 20;
    t->flip = crop == Crop::kRandom;
    t->channels_last = crop != Crop::kCenter;
    t->max_pixels = 1u << 22;
    targets.push_back(t);
  }
  std::vector<uint8_t> out;
  for (size_t k = 0; k < targets.size(); ++k) {
    out.assign(targets[k]->nbytes(), 0);
    try {
      stoker::image::decode_into(bytes, size, *targets[k], size + k, out.data(), "image", 0);
    } catch (const stoker::FormatError&) {
    } catch (const std::exception& e) {
      bug(std::string("decode_into threw ") + typeid(e).name() + ": " + e.what());
    }
  }
  MemFile file(bytes, size);
  auto files = std::make_shared<stoker::io::FileTable>();
  files->paths = {file.path()};
  auto blank = std::make_shared<Target>(*targets[1]);
  blank->blank_on_error = true;
  ReadRequest r;
  r.length = size;
  r.codec = stoker::image::kImage;
  r.out_length = blank->nbytes();
  r.decoder = stoker::image::field_decoder(blank);
  r.seed = 1;
  std::vector<uint8_t> dest(r.out_length);
  try {
    reader().submit(files, {r}, dest.data(), dest.size())->wait(-1);
  } catch (const std::exception& e) {
    bug(std::string("a blanking image read threw: ") + e.what());
  }
  reader().forget(file.path());
  if (size >= 2 && bytes[0] == 0xFF && bytes[1] == 0xD8) fuzz_jpeg_tile(bytes, size);
}

// Array chunks. Eight header bytes: [0] rank (1 + %3), itemsize (1 << bits 2-3),
// F order (bit 4), big-endian (bit 5); [1..3] each axis's length (1 + %9, axis 0:
// 1 + %33) and chunk length (1 + high nibble %5); [4] the filters applied, in
// HDF5's order (bit 0 shuffle, bit 1 a compressor chosen by bits 2-3: zlib, gzip,
// zstd, blosc; bit 4 a checksum, bit 5 picking crc32c over fletcher32); [5] a
// seed for each chunk's filter mask; [6..7] unused. Then each chunk in grid
// order: a 2-byte little-endian length and that many stored bytes; length 0xFFFF
// is a chunk never written (the fill value), and chunks past the input's end
// point past the file's end.
void fuzz_chunks(const uint8_t* data, uint64_t size) {
  using stoker::io::ArrayLayout;
  using stoker::io::ChunkFilter;
  if (size < 8) return;
  auto a = std::make_shared<ArrayLayout>();
  a->id = stoker::io::next_layout_id();
  a->name = "fuzz:/x";
  const size_t rank = 1 + data[0] % 3;
  a->itemsize = 1u << ((data[0] >> 2) & 3);
  for (size_t d = 0; d < rank; ++d) {
    a->shape.push_back(1 + (data[1 + d] & 15) % (d == 0 ? 33 : 9));
    a->chunk_shape.push_back(1 + (data[1 + d] >> 4) % 5);
  }
  if (data[0] & 16) {
    for (size_t d = rank; d-- > 0;) a->order.push_back(static_cast<uint32_t>(d));
  }
  a->byteswap = (data[0] & 32) != 0;
  a->fill.assign(a->itemsize, 0xA5);
  const uint8_t f = data[4];
  if (f & 1) a->steps.push_back({ChunkFilter::kShuffle, a->itemsize});
  if (f & 2) {
    static constexpr ChunkFilter kCompressors[] = {ChunkFilter::kZlib, ChunkFilter::kGzip,
                                                   ChunkFilter::kZstd, ChunkFilter::kBlosc};
    a->steps.push_back({kCompressors[(f >> 2) & 3], 0});
  }
  if (f & 16) a->steps.push_back({f & 32 ? ChunkFilter::kCrc32c : ChunkFilter::kFletcher32, 0});
  const uint64_t n = a->num_chunks();
  const uint64_t file_size = size - 8;
  uint64_t at = 8;
  uint32_t mask_seed = data[5];
  for (uint64_t c = 0; c < n; ++c) {
    uint64_t length = at + 2 <= size ? data[at] | (uint64_t(data[at + 1]) << 8) : 64;
    uint64_t offset = at + 2 - 8;  // in the file, which holds the input after its header
    a->chunk_file.push_back(0);
    a->chunk_offset.push_back(length == 0xFFFF ? stoker::io::kMissingChunk : offset);
    a->chunk_size.push_back(length == 0xFFFF ? 0 : length);
    mask_seed = mask_seed * 1103515245u + 12345u;
    a->chunk_mask.push_back((mask_seed >> 16) % 8 == 0 ? (mask_seed >> 8) & 7 : 0);
    at += 2 + (length == 0xFFFF ? 0 : length);
  }
  MemFile file(data + 8, file_size);
  a->paths = {file.path()};
  a->check();
  auto files = std::make_shared<stoker::io::FileTable>();
  files->paths = {file.path()};
  files->arrays = {a};
  const uint64_t row = a->row_bytes();
  std::vector<ReadRequest> requests;
  for (uint64_t i = 0; i < a->shape[0]; ++i) {
    ReadRequest r;
    r.codec = Codec::kArrayRow;
    r.offset = i;
    r.out_length = row;
    r.dest_offset = i * ((row + kAlign - 1) / kAlign * kAlign);
    requests.push_back(r);
  }
  std::vector<uint8_t> dest(a->shape[0] * ((row + kAlign - 1) / kAlign * kAlign) + 1);
  try {
    reader().submit(files, requests, dest.data(), dest.size())->wait(-1);
  } catch (const stoker::FormatError&) {
    reader().forget(file.path());
    return;
  } catch (const stoker::ReadError&) {
    reader().forget(file.path());
    return;
  } catch (const std::exception& e) {
    bug(std::string("array rows threw ") + typeid(e).name() + ": " + e.what());
  }
  reader().forget(file.path());
  // Where each element lies, worked out afresh, for chunks stored as they are used.
  std::vector<uint64_t> coord(rank), grid(rank);
  for (size_t d = 0; d < rank; ++d) grid[d] = a->grid(d);
  const uint64_t elements = a->row_elements();
  for (uint64_t i = 0; i < a->shape[0]; ++i) {
    for (uint64_t e = 0; e < elements; ++e) {
      coord[0] = i;
      for (size_t d = rank, rest = e; d-- > 1;) {
        coord[d] = rest % a->shape[d];
        rest /= a->shape[d];
      }
      uint64_t chunk = 0, position = 0;
      for (size_t d = 0; d < rank; ++d) chunk = chunk * grid[d] + coord[d] / a->chunk_shape[d];
      for (size_t p = 0; p < rank; ++p) {
        size_t axis = a->order.empty() ? p : a->order[p];
        position = position * a->chunk_shape[axis] + coord[axis] % a->chunk_shape[axis];
      }
      const uint8_t* got = dest.data() + requests[i].dest_offset + e * a->itemsize;
      uint32_t applied = 0;
      for (size_t k = 0; k < a->steps.size(); ++k)
        applied |= ((a->chunk_mask[chunk] >> k) & 1) ? 0 : 1;
      std::vector<uint8_t> want(a->itemsize);
      if (a->chunk_offset[chunk] == stoker::io::kMissingChunk) {
        want = a->fill;
      } else if (applied) {
        continue;  // decoded: checked by its codec, not recomputed here
      } else {
        const uint8_t* src = data + 8 + a->chunk_offset[chunk] + position * a->itemsize;
        for (uint32_t b = 0; b < a->itemsize; ++b) {
          want[b] = src[a->byteswap ? a->itemsize - 1 - b : b];
        }
      }
      if (std::memcmp(got, want.data(), a->itemsize) != 0) {
        bug("array row " + std::to_string(i) + " element " + std::to_string(e) +
            " differs from its place in chunk " + std::to_string(chunk));
      }
    }
  }
}

// A gzip stream: inflated in pieces of growing size (some discarded), at most
// kMaxDecodedBytes in all, then finished; FormatError and ReadError are the
// expected rejections.
void fuzz_gzip(const uint8_t* bytes, uint64_t size) {
  MemFile file(bytes, size);
  try {
    stoker::io::GzipFile stream(file.path());
    std::vector<uint8_t> piece;
    uint64_t want = 1;
    while (stream.produced() < kMaxDecodedBytes / 8 && !stream.at_end()) {
      piece.resize(want);
      if (want % 3 == 0) {
        stream.read(nullptr, want);
      } else {
        stream.read(piece.data(), want);
      }
      want = want * 2 + 1;
    }
    stream.finish(1 << 20);
  } catch (const stoker::FormatError&) {
  } catch (const stoker::ReadError&) {
  } catch (const std::exception& e) {
    bug(std::string("GzipFile threw ") + typeid(e).name() + ": " + e.what());
  }
}

// What a patch reader assumes of every directory parse_tiff returns; `seen`
// counts directories, SubIFDs included.
void check_tiff(const stoker::format::TiffDirectory& d, uint64_t size, int depth, size_t& seen) {
  if (++seen > 4096) bug("more than 4096 TIFF directories accepted");
  if (depth > 8) bug("TIFF SubIFDs accepted " + std::to_string(depth) + " deep");
  if (d.offset >= size)
    bug("a TIFF directory at offset " + std::to_string(d.offset) + " of an input of " +
        std::to_string(size) + " bytes");
  if (d.width == 0 || d.length == 0) bug("a TIFF directory with an empty image");
  if (d.tiled() ? d.tile_length == 0 : (d.tile_length != 0 || d.rows_per_strip == 0)) {
    bug("a TIFF directory with empty tiles or strips");
  }
  if (d.samples_per_pixel == 0 || (d.planar_config != 1 && d.planar_config != 2)) {
    bug("a TIFF directory with 0 samples or planar configuration " +
        std::to_string(d.planar_config));
  }
  if (d.bits_per_sample.empty()) bug("a TIFF directory without bits per sample");
  uint64_t needed = 0;
  try {
    needed = stoker::format::tiff_chunk_count(d, "memory.tiff");
  } catch (const stoker::Error& e) {
    bug(std::string("an accepted TIFF directory has no grid: ") + e.what());
  }
  if (d.offsets.size() != needed || d.byte_counts.size() != needed) {
    bug("a TIFF directory with " + std::to_string(d.offsets.size()) + " offsets and " +
        std::to_string(d.byte_counts.size()) + " byte counts for a grid of " +
        std::to_string(needed));
  }
  for (size_t i = 0; i < needed; ++i) {
    if (d.offsets[i] > size || d.byte_counts[i] > size - d.offsets[i]) {
      bug("TIFF tile " + std::to_string(i) + " (" + std::to_string(d.byte_counts[i]) +
          " bytes at " + std::to_string(d.offsets[i]) + ") lies outside the input of " +
          std::to_string(size) + " bytes");
    }
  }
  for (const auto& sub : d.sub_directories) check_tiff(sub, size, depth + 1, seen);
}

bool same_tiff(const stoker::format::TiffDirectory& a, const stoker::format::TiffDirectory& b) {
  if (a.offset != b.offset || a.big_endian != b.big_endian || a.big_tiff != b.big_tiff ||
      a.width != b.width || a.length != b.length || a.tile_width != b.tile_width ||
      a.tile_length != b.tile_length || a.rows_per_strip != b.rows_per_strip ||
      a.samples_per_pixel != b.samples_per_pixel || a.bits_per_sample != b.bits_per_sample ||
      a.sample_format != b.sample_format || a.compression != b.compression ||
      a.photometric != b.photometric || a.planar_config != b.planar_config ||
      a.predictor != b.predictor || a.new_subfile_type != b.new_subfile_type ||
      a.jpeg_tables != b.jpeg_tables || a.ycbcr_subsampling[0] != b.ycbcr_subsampling[0] ||
      a.ycbcr_subsampling[1] != b.ycbcr_subsampling[1] || a.description != b.description ||
      a.offsets != b.offsets || a.byte_counts != b.byte_counts ||
      a.sub_directories.size() != b.sub_directories.size()) {
    return false;
  }
  for (size_t i = 0; i < a.sub_directories.size(); ++i) {
    if (!same_tiff(a.sub_directories[i], b.sub_directories[i])) return false;
  }
  return true;
}

// The tiles (strips) of `d` and its SubIFDs as stored members, up to kMaxMembers
// and kMaxDecodedBytes in all.
void tiff_requests(const stoker::format::TiffDirectory& d, std::vector<ReadRequest>& requests,
                   uint64_t& total) {
  for (size_t i = 0; i < d.offsets.size() && requests.size() < kMaxMembers; ++i) {
    if (d.byte_counts[i] > kMaxDecodedBytes - total) return;
    total += d.byte_counts[i];
    ReadRequest r;
    r.offset = d.offsets[i];
    r.length = r.out_length = d.byte_counts[i];
    requests.push_back(r);
  }
  for (const auto& sub : d.sub_directories) tiff_requests(sub, requests, total);
}

// A TIFF: parsed from memory (through a source that must be asked only for
// bytes inside the input) and from a memfd; FormatError and ReadError are the
// expected rejections, and both parses must end alike.
void fuzz_tiff(const uint8_t* bytes, uint64_t size) {
  using stoker::format::TiffDirectory;
  auto from_memory = [bytes, size](uint8_t* dest, uint64_t length, uint64_t offset) {
    if (offset > size || length > size - offset) {
      bug("parse_tiff asked its source for " + std::to_string(length) + " bytes at " +
          std::to_string(offset) + " of " + std::to_string(size));
    }
    if (length > 0) std::memcpy(dest, bytes + offset, length);
  };
  auto parse = [](const char* stage, auto run, std::vector<TiffDirectory>& out) -> std::string {
    try {
      out = run();
      return "";
    } catch (const stoker::FormatError& e) {
      return "rejected at " + std::to_string(e.offset()) + ": " + e.detail();
    } catch (const stoker::ReadError& e) {
      return "failed at " + std::to_string(e.offset()) + ": " + e.detail();
    } catch (const std::exception& e) {
      bug(std::string(stage) + " threw " + typeid(e).name() + ": " + e.what());
    } catch (...) {
      bug(std::string(stage) + " threw something that is not a std::exception");
    }
  };
  std::vector<TiffDirectory> memory, disk;
  std::string memory_error = parse(
      "parse_tiff (memory)",
      [&] { return stoker::format::parse_tiff(from_memory, size, "memory.tiff"); }, memory);
  MemFile file(bytes, size);
  std::string disk_error = parse(
      "read_tiff (file)", [&] { return stoker::format::read_tiff(file.path()); }, disk);
  if (memory_error != disk_error) {
    bug("TIFF parsed from memory and from a file end differently: '" + memory_error + "' vs '" +
        disk_error + "'");
  }
  if (!memory_error.empty()) return;
  if (memory.empty()) bug("a TIFF accepted without directories");
  if (memory.size() != disk.size()) bug("TIFF directories from memory and from a file differ");
  size_t seen = 0;
  for (size_t i = 0; i < memory.size(); ++i) {
    check_tiff(memory[i], size, 0, seen);
    if (!same_tiff(memory[i], disk[i])) bug("TIFF directories from memory and from a file differ");
  }
  // The tiles read back through the reader, as a patch reader reads them.
  std::vector<ReadRequest> requests;
  uint64_t total = 0;
  for (const auto& d : memory) tiff_requests(d, requests, total);
  auto files = std::make_shared<stoker::io::FileTable>();
  files->paths = {file.path()};
  std::shared_ptr<const stoker::io::FileTable> table = files;
  for (size_t first = 0; first < requests.size(); first += kBatchMembers) {
    size_t last = std::min(requests.size(), first + kBatchMembers);
    read_batch(table, std::vector<ReadRequest>(requests.begin() + first, requests.begin() + last),
               bytes);
  }
  reader().forget(file.path());
}

// What the reader assumes of a decoded Parquet chunk: `rows` rows whose offsets rise to
// the end of the data, empty values for null rows, one value's width for a fixed-width
// scalar that is not null.
void check_parquet_rows(const stoker::io::ByteVector& decoded, uint64_t rows,
                        const stoker::format::parquet::ColumnSpec& spec) {
  using stoker::format::parquet::PhysicalType;
  stoker::format::parquet::DecodedView v;
  try {
    v = stoker::format::parquet::view_decoded(decoded);
  } catch (const stoker::Error& e) {
    bug(std::string("decode_column_chunk made a buffer view_decoded refuses: ") + e.what());
  }
  if (v.rows != rows)
    bug("a Parquet chunk decoded to " + std::to_string(v.rows) + " rows, not " +
        std::to_string(rows));
  if (v.offsets[0] != 0) bug("a decoded Parquet chunk's first offset is not 0");
  uint64_t width = 0;
  switch (spec.type) {
    case PhysicalType::kBoolean:
      width = 1;
      break;
    case PhysicalType::kInt32:
    case PhysicalType::kFloat:
      width = 4;
      break;
    case PhysicalType::kInt64:
    case PhysicalType::kDouble:
      width = 8;
      break;
    case PhysicalType::kFixedLenByteArray:
      width = static_cast<uint64_t>(spec.type_length);
      break;
    default:
      break;
  }
  for (uint64_t r = 0; r < rows; ++r) {
    if (v.offsets[r + 1] < v.offsets[r])
      bug("decoded Parquet offsets fall at row " + std::to_string(r));
    uint64_t length = v.offsets[r + 1] - v.offsets[r];
    bool null = v.nulls != nullptr && v.nulls[r] != 0;
    if (null && length != 0) bug("a null Parquet row with a value");
    if (!null && width != 0 && length % width != 0) bug("a Parquet value of a partial width");
    if (!null && width != 0 && spec.max_repetition == 0 && length != width) {
      bug("a fixed-width Parquet value of " + std::to_string(length) + " bytes");
    }
    if (spec.type == PhysicalType::kBoolean) {
      for (uint64_t i = v.offsets[r]; i < v.offsets[r + 1]; ++i) {
        if (v.data[i] > 1) bug("a decoded Parquet boolean that is not 0 or 1");
      }
    }
  }
}

// A chunk decoded in place holds what the copying decode holds, each value inside the
// chunk's stored bytes, or inside its kept pages.
void check_left_in_place(const stoker::io::ByteVector& copied, const stoker::io::ByteVector& left,
                         const uint8_t* stored, uint64_t size) {
  namespace pq = stoker::format::parquet;
  pq::DecodedView a = pq::view_decoded(copied), b = pq::view_decoded(left);
  for (uint64_t r = 0; r < a.rows; ++r) {
    const uint64_t length = a.offsets[r + 1] - a.offsets[r];
    if (b.offsets[r + 1] - b.offsets[r] != length) bug("a Parquet value's size differs in place");
    if ((a.nulls != nullptr && a.nulls[r]) != (b.nulls != nullptr && b.nulls[r])) {
      bug("a Parquet row's null differs in place");
    }
    if (b.starts == nullptr || (b.nulls != nullptr && b.nulls[r])) continue;
    const uint8_t* from = b.data != nullptr ? b.data : stored;
    const uint64_t within = b.data != nullptr ? b.data_size : size;
    if (b.starts[r] > within || length > within - b.starts[r]) {
      bug("a Parquet value left in place lies outside its chunk");
    }
    if (length != 0 && std::memcmp(a.data + a.offsets[r], from + b.starts[r], length) != 0) {
      bug("a Parquet value left in place differs from its copy");
    }
  }
}

// A Parquet file held whole in memory: its footer, its schema's leaves, then each column
// chunk the metadata names (up to a few, each bounded to the input and to a small decode
// budget), and each offset index. FormatError is the expected rejection.
void fuzz_parquet(const uint8_t* bytes, uint64_t size) {
  namespace pq = stoker::format::parquet;
  const std::string path = "memory.parquet";
  auto expected = [](const char* stage, auto run) {
    try {
      run();
    } catch (const stoker::FormatError&) {
    } catch (const std::exception& e) {
      bug(std::string(stage) + " threw " + typeid(e).name() + ": " + e.what());
    }
  };
  pq::FileMetaData metadata;
  std::vector<pq::LeafColumn> leaves;
  bool parsed = false;
  expected("the Parquet footer", [&] {
    if (size < 8) return;
    pq::FooterSpan span = pq::locate_footer(bytes, size, size, path);
    if (span.offset + span.size > size - 8) bug("locate_footer gave a span outside the file");
    metadata = pq::parse_file_metadata(bytes + span.offset, span.size, path, span.offset);
    leaves = pq::leaf_columns(metadata, path, span.offset);
    parsed = true;
  });
  if (!parsed) return;
  size_t decoded = 0;
  for (size_t g = 0; g < metadata.row_groups.size(); ++g) {
    const pq::RowGroupMeta& group = metadata.row_groups[g];
    for (size_t c = 0; c < group.columns.size() && c < leaves.size(); ++c) {
      if (++decoded > 16) return;
      const pq::ColumnChunkMeta& chunk = group.columns[c];
      const int64_t start =
          chunk.dictionary_page_offset >= 0 ? chunk.dictionary_page_offset : chunk.data_page_offset;
      if (start >= 0 && static_cast<uint64_t>(start) <= size) {
        pq::ColumnSpec spec = leaves[c].spec;
        spec.codec = chunk.codec;
        spec.name = "row group " + std::to_string(g) + ", " + spec.name;
        spec.max_decoded_bytes = 8u << 20;
        const uint64_t length =
            std::min<uint64_t>(chunk.total_compressed_size, size - static_cast<uint64_t>(start));
        const uint64_t rows = static_cast<uint64_t>(group.num_rows);
        // Copied, and in place: the same values where they are stored (or in the kept
        // pages, which every compressed chunk of byte strings keeps here), none outside
        // them; a chunk refused one way is refused the other, for the same reason.
        stoker::io::ByteVector out, left;
        std::string refused[2];
        for (int way = 0; way < 2; ++way) {
          stoker::io::ByteVector& decoded = way == 0 ? out : left;
          expected("decode_column_chunk", [&] {
            try {
              decoded = pq::decode_column_chunk(
                  bytes + start, length, static_cast<uint64_t>(start), spec, rows, path,
                  way == 0 ? stoker::io::ValuesLeft::kCopied : stoker::io::ValuesLeft::kInStored);
              check_parquet_rows(decoded, rows, spec);
            } catch (const stoker::FormatError& e) {
              refused[way] = std::string("refused: ") + e.what();
            }
          });
          spec.least_bytes_in_pages = 0;
        }
        // (Values left in the stored bytes take none of the decode's budget, so a chunk
        // refused for that when copied may be read in place.)
        const bool budget = refused[0].find("max_decoded_bytes") != std::string::npos;
        if (refused[0] != refused[1] && !(budget && refused[1].empty())) {
          bug("a Parquet chunk decoded copied and in place differs: " +
              (refused[0].empty() ? std::string("accepted") : refused[0]) + " / " +
              (refused[1].empty() ? std::string("accepted") : refused[1]));
        }
        if (refused[0].empty()) check_left_in_place(out, left, bytes + start, length);
      }
      if (chunk.offset_index_offset >= 0) {
        const uint64_t at = static_cast<uint64_t>(chunk.offset_index_offset);
        const uint64_t n = static_cast<uint64_t>(chunk.offset_index_length);
        if (at <= size && n <= size - at) {
          expected("parse_offset_index", [&] { pq::parse_offset_index(bytes + at, n, path, at); });
        }
      }
    }
  }
}

// The decoders register their codes with the reader, as the Python module does.
extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  stoker::image::register_decoders();
  stoker::text::register_decoders();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  std::string format = kFormats[data[0] % kNumFormats];
  const uint8_t* shard = data + 1;
  uint64_t shard_size = size - 1;
  if (format == "record") {  // the first line is the record format, from a peer's index
    const void* end = std::memchr(shard, '\n', std::min<uint64_t>(shard_size, 256));
    if (end == nullptr) return 0;
    format.assign(reinterpret_cast<const char*>(shard), static_cast<const uint8_t*>(end) - shard);
    // (Python writes it from a peer's index.json: printable, never a NUL.)
    for (char c : format) {
      if (static_cast<unsigned char>(c) < 0x20) return 0;
    }
    if (!stoker::format::is_record_format(format)) return 0;
    shard_size -= static_cast<const uint8_t*>(end) - shard + 1;
    shard = static_cast<const uint8_t*>(end) + 1;
  }
  if (format == "image") {
    fuzz_image(shard, shard_size);
    return 0;
  }
  if (format == "chunk") {
    fuzz_chunks(shard, shard_size);
    return 0;
  }
  if (format == "gzip") {
    fuzz_gzip(shard, shard_size);
    return 0;
  }
  if (format == "tiff") {
    fuzz_tiff(shard, shard_size);
    return 0;
  }
  if (format == "parquet") {
    fuzz_parquet(shard, shard_size);
    return 0;
  }
  if (format == "idx") {  // a member index sidecar: decoded, and believed only if plausible
    ShardIndex index;
    uint64_t described = 0;
    int64_t mtime_ns = 0;
    std::vector<uint8_t> bytes(shard, shard + shard_size);
    if (stoker::format::decode_sidecar(bytes, index, described, mtime_ns)) {
      if (index.format != "tar" && index.format != "zip") bug("a sidecar of a " + index.format);
      check_index(index, index.format, described, true);
    }
    return 0;
  }

  // 1a. From memory, through a small window.
  auto read_memory = [shard, shard_size](uint8_t* dest, uint64_t length, uint64_t offset) {
    if (offset > shard_size || length > shard_size - offset) {
      bug("WindowReader asked its source for " + std::to_string(length) + " bytes at " +
          std::to_string(offset) + " of " + std::to_string(shard_size));
    }
    if (length > 0) std::memcpy(dest, shard + offset, length);
  };
  Outcome memory = attempt("index_shard (memory)", [&] {
    stoker::format::WindowReader in("memory." + format, shard_size, read_memory, 512);
    return stoker::format::index_shard(in, format);
  });
  if (memory.ok) check_index(memory.index, format, shard_size, true);

  if (format == "zip") {  // a remote shard's index: the central directory only
    Outcome directory = attempt("index_zip (central directory only)", [&] {
      stoker::format::WindowReader in("memory.zip", shard_size, read_memory, 4096);
      return stoker::format::index_zip(in, /*locate_members=*/false);
    });
    if (directory.ok) check_index(directory.index, format, shard_size, false);
    if (memory.ok && (!directory.ok || !same_members(memory.index, directory.index, false))) {
      bug("zip indexed with its members located disagrees with the central directory alone");
    }
  }

  // 1b. From a real file, as a Dataset opens a shard.
  MemFile file(shard, shard_size);
  Outcome disk = attempt("index_shard (file)",
                         [&] { return stoker::format::index_shard(file.path(), format); });
  if (disk.ok != memory.ok) {
    bug("index from memory " + std::string(memory.ok ? "succeeded" : "failed: " + memory.message) +
        " but from a file " + (disk.ok ? "succeeded" : "failed: " + disk.message));
  }
  if (!disk.ok) {
    if (disk.offset != memory.offset || disk.message != memory.message) {
      bug("memory and file parses fail differently: '" + memory.message + "' vs '" + disk.message +
          "'");
    }
    return 0;
  }
  check_index(disk.index, format, shard_size, true);
  if (disk.index.identity.size != shard_size) bug("file identity has the wrong size");
  if (!same_index(memory.index, disk.index)) bug("memory and file indexes differ");

  // 2. Read every member back, in batches, as a Dataset would.
  auto files = std::make_shared<stoker::io::FileTable>();
  files->paths = {file.path()};
  files->identities = {disk.index.identity};
  std::shared_ptr<const stoker::io::FileTable> table = files;
  std::vector<ReadRequest> requests = member_requests(disk.index);
  for (size_t first = 0; first < requests.size(); first += kBatchMembers) {
    size_t last = std::min(requests.size(), first + kBatchMembers);
    read_batch(table, std::vector<ReadRequest>(requests.begin() + first, requests.begin() + last),
               shard);
  }
  if (format != "npy") read_as_ints(table, disk.index);
  // The fd number (and so the path) comes back for the next input's memfd.
  reader().forget(file.path());
  return 0;
}
