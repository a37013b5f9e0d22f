#include "stoker/io/chunk_codec.hpp"

#include <cstring>
#include <mutex>

#include "stoker/errors.hpp"
#include "stoker/image/codec.hpp"
#include "stoker/io/inflate.hpp"
#include "stoker/util/dynamic_library.hpp"
#include "stoker/util/little_endian.hpp"

namespace stoker::io {

namespace {

// -- libraries opened at run time ---------------------------------------------------

struct ZstdApi {
  void* (*create)() = nullptr;
  size_t (*free_context)(void*) = nullptr;
  size_t (*decompress)(void*, void*, size_t, const void*, size_t) = nullptr;
  unsigned (*is_error)(size_t) = nullptr;
  const char* (*error_name)(size_t) = nullptr;
};

struct BloscApi {
  int (*decompress)(const void*, void*, size_t, int) = nullptr;
  void (*sizes)(const void*, size_t*, size_t*, size_t*) = nullptr;
};

struct Lz4Api {
  int (*decompress_safe)(const char*, char*, int, int) = nullptr;
};

// How one library is found and described, and where it stands.
struct LibraryState {
  LibraryState(std::vector<std::string> sonames, const char* needs_text, const char* install_text,
               const char* too_old_text)
      : names(std::move(sonames)),
        needs(needs_text),
        install(install_text),
        too_old(too_old_text) {}

  std::vector<std::string> names;  // sonames, the first in messages
  const char* needs;               // "the zstd codec needs libzstd"
  const char* install;             // how to get it
  const char* too_old;             // after "<library> has no <symbol>: it is too old"
  bool ready = false;
  std::string error;
  std::string path;  // the file the loader actually mapped
};

struct Libraries {
  std::mutex mutex;
  std::vector<std::string> dirs;
  ZstdApi zstd;
  BloscApi blosc;
  Lz4Api lz4;
  LibraryState zstd_state{{"libzstd.so.1", "libzstd.so"},
                          "the zstd codec needs libzstd",
                          "Debian/Ubuntu: apt-get install libzstd1",
                          ""};
  LibraryState blosc_state{{"libblosc.so.1", "libblosc.so"},
                           "the blosc codec needs libblosc (c-blosc 1.x)",
                           "Debian/Ubuntu: apt-get install libblosc1; or pip install blosc, whose "
                           "wheel carries the library",
                           " (1.x from 1.10 on)"};
  LibraryState lz4_state{{"liblz4.so.1", "liblz4.so"},
                         "the lz4 codec needs liblz4",
                         "Debian/Ubuntu: apt-get install liblz4-1",
                         ""};
};

Libraries& libraries() {
  static Libraries* libs = new Libraries;  // never destroyed: pool threads may use it at exit
  return *libs;
}

// The folders Python found first (where a package such as the `blosc` wheel put its
// copy, wherever that package is installed), then the loader's own path: a library a
// user installed with pip wins over a system one that may be older. `tried` says where
// it was looked for when none loaded.
util::DynamicLibrary open_library(const std::vector<std::string>& names,
                                  const std::vector<std::string>& dirs, std::string& tried,
                                  std::string& loaded) {
  std::vector<std::string> candidates;
  for (const auto& dir : dirs) {
    for (const auto& name : names) candidates.push_back(dir + "/" + name);
  }
  candidates.insert(candidates.end(), names.begin(), names.end());
  auto library = util::DynamicLibrary::open(candidates);
  if (library.loaded()) {
    loaded = library.mapped_path();
    return library;
  }
  tried.clear();
  for (const auto& dir : dirs) tried += dir + "/" + names.front() + ", ";
  tried += names.front() + " on the loader's path";
  return library;
}

// `api`, its entry points bound by `bind` on first use; null (and state.error says
// why) while the library cannot be found or is too old. Looked for again on each call
// until found, so set_codec_search_dirs can still help.
template <typename Api, typename Bind>
const Api* library_api(Api& api, LibraryState& state, Bind bind) {
  Libraries& libs = libraries();
  std::lock_guard<std::mutex> lock(libs.mutex);
  if (!state.ready) {
    std::string tried;
    auto library = open_library(state.names, libs.dirs, tried, state.path);
    if (!library.loaded()) {
      state.error = std::string(state.needs) + ", which was not found (tried " + tried +
                    "): install it (" + state.install + ")";
      return nullptr;
    }
    Api bound;
    bind(library, bound);
    if (!library.missing().empty()) {
      std::string soname = state.names.front();
      state.error = soname.substr(0, soname.find('.')) + " has no " + library.missing() +
                    ": it is too old" + state.too_old;
      return nullptr;
    }
    api = bound;
    state.ready = true;
  }
  return &api;
}

const ZstdApi* zstd_api() {
  Libraries& libs = libraries();
  return library_api(libs.zstd, libs.zstd_state, [](util::DynamicLibrary& library, ZstdApi& api) {
    library.bind("ZSTD_createDCtx", api.create);
    library.bind("ZSTD_freeDCtx", api.free_context);
    library.bind("ZSTD_decompressDCtx", api.decompress);
    library.bind("ZSTD_isError", api.is_error);
    library.bind("ZSTD_getErrorName", api.error_name);
  });
}

const BloscApi* blosc_api() {
  Libraries& libs = libraries();
  return library_api(libs.blosc, libs.blosc_state,
                     [](util::DynamicLibrary& library, BloscApi& api) {
                       library.bind("blosc_decompress_ctx", api.decompress);
                       library.bind("blosc_cbuffer_sizes", api.sizes);
                     });
}

const Lz4Api* lz4_api() {
  Libraries& libs = libraries();
  return library_api(libs.lz4, libs.lz4_state, [](util::DynamicLibrary& library, Lz4Api& api) {
    library.bind("LZ4_decompress_safe", api.decompress_safe);
  });
}

// The state of the library `filter` needs, once it has been looked for; null for a
// filter that needs none.
LibraryState* library_state(ChunkFilter filter) {
  Libraries& libs = libraries();
  switch (filter) {
    case ChunkFilter::kZstd:
      zstd_api();
      return &libs.zstd_state;
    case ChunkFilter::kBlosc:
      blosc_api();
      return &libs.blosc_state;
    case ChunkFilter::kLz4Raw:
      lz4_api();
      return &libs.lz4_state;
    default:
      return nullptr;
  }
}

// Snappy is decoded here, not by libsnappy: a C++ library that needs the shared
// libstdc++, which a wheel's extension (its C++ runtime linked in) must not load beside
// its own. The format is small: a varint of the decoded length, then literals and
// back-references, every one of which is checked against both buffers.
void decompress_snappy(const uint8_t* src, uint64_t n, uint8_t* dest, uint64_t size,
                       const std::string& path, uint64_t offset) {
  auto corrupt = [&](const char* what) {
    throw FormatError(path, offset, std::string("corrupt snappy data: ") + what);
  };
  uint64_t pos = 0, length = 0;
  for (int shift = 0;; shift += 7) {
    if (pos >= n || shift > 35) corrupt("its length header is damaged");
    uint8_t byte = src[pos++];
    length |= uint64_t(byte & 0x7f) << shift;
    if (!(byte & 0x80)) break;
  }
  if (length != size) {
    throw FormatError(path, offset,
                      "snappy data decodes to " + std::to_string(length) + " bytes, but " +
                          std::to_string(size) + " were expected");
  }
  uint64_t out = 0;
  while (pos < n) {
    const uint8_t tag = src[pos++];
    uint64_t len = 0, back = 0;
    switch (tag & 3) {
      case 0: {  // a literal; lengths past 60 in 1 to 4 bytes after the tag
        len = tag >> 2;
        if (len >= 60) {
          const uint64_t bytes = len - 59;
          if (n - pos < bytes) corrupt("a literal's length runs past the end");
          len = 0;
          for (uint64_t k = 0; k < bytes; ++k) len |= uint64_t(src[pos + k]) << (8 * k);
          pos += bytes;
        }
        ++len;
        if (n - pos < len) corrupt("a literal runs past the end");
        if (size - out < len) corrupt("a literal runs past the decoded length");
        std::memcpy(dest + out, src + pos, len);
        pos += len;
        out += len;
        continue;
      }
      case 1:  // a copy of 4-11 bytes, 11 bits of offset
        if (pos >= n) corrupt("a copy runs past the end");
        len = 4 + ((tag >> 2) & 7);
        back = (uint64_t(tag >> 5) << 8) | src[pos++];
        break;
      case 2:  // a copy of 1-64 bytes, 16 bits of offset
        if (n - pos < 2) corrupt("a copy runs past the end");
        len = (tag >> 2) + 1;
        back = util::le16(src + pos);
        pos += 2;
        break;
      default:  // a copy of 1-64 bytes, 32 bits of offset
        if (n - pos < 4) corrupt("a copy runs past the end");
        len = (tag >> 2) + 1;
        back = util::le32(src + pos);
        pos += 4;
        break;
    }
    if (back == 0 || back > out) corrupt("a copy reaches before the start");
    if (size - out < len) corrupt("a copy runs past the decoded length");
    uint8_t* to = dest + out;
    const uint8_t* from = to - back;
    if (back >= len) {
      std::memcpy(to, from, len);
    } else {  // overlapping: a repeated pattern, copied forward byte by byte
      for (uint64_t k = 0; k < len; ++k) to[k] = from[k];
    }
    out += len;
  }
  if (out != size) corrupt("it decodes to fewer bytes than its header says");
}

void decompress_lz4(const uint8_t* src, uint64_t n, uint8_t* dest, uint64_t size,
                    const std::string& path, uint64_t offset) {
  const Lz4Api* api = lz4_api();
  if (api == nullptr) throw FormatError(path, offset, codec_unavailable(ChunkFilter::kLz4Raw));
  if (n > INT32_MAX || size > INT32_MAX) {
    throw FormatError(path, offset, "an lz4 block of more than 2 GiB");
  }
  int got = api->decompress_safe(reinterpret_cast<const char*>(src), reinterpret_cast<char*>(dest),
                                 static_cast<int>(n), static_cast<int>(size));
  if (got < 0) {
    throw FormatError(path, offset,
                      "corrupt lz4 data (or data that decodes to more than the " +
                          std::to_string(size) + " bytes expected)");
  }
  if (static_cast<uint64_t>(got) != size) {
    throw FormatError(path, offset,
                      "lz4 data decodes to " + std::to_string(got) + " bytes, but " +
                          std::to_string(size) + " were expected");
  }
}

// -- the steps ----------------------------------------------------------------------

// HDF5's Fletcher-32: 16-bit words read big-endian, sums folded every 360 words.
uint32_t fletcher32_of(const uint8_t* data, uint64_t length) {
  uint32_t sum1 = 0, sum2 = 0;
  uint64_t words = length / 2;
  while (words > 0) {
    uint64_t block = std::min<uint64_t>(words, 360);
    words -= block;
    for (; block > 0; --block, data += 2) {
      sum1 += (uint32_t(data[0]) << 8) | data[1];
      sum2 += sum1;
    }
    sum1 = (sum1 & 0xffff) + (sum1 >> 16);
    sum2 = (sum2 & 0xffff) + (sum2 >> 16);
  }
  if (length % 2) {
    sum1 += uint32_t(*data) << 8;
    sum2 += sum1;
    sum1 = (sum1 & 0xffff) + (sum1 >> 16);
    sum2 = (sum2 & 0xffff) + (sum2 >> 16);
  }
  sum1 = (sum1 & 0xffff) + (sum1 >> 16);
  sum2 = (sum2 & 0xffff) + (sum2 >> 16);
  return (sum2 << 16) | sum1;
}

uint32_t byte_reversed(uint32_t v) {
  return (v >> 24) | ((v >> 8) & 0xff00) | ((v << 8) & 0xff0000) | (v << 24);
}

// Byte j of element e was stored at j * n + e; bytes past the last whole
// element were left where they were.
void unshuffle(const uint8_t* in, uint8_t* out, uint64_t length, uint32_t size) {
  uint64_t n = length / size;
  for (uint32_t j = 0; j < size; ++j) {
    const uint8_t* plane = in + uint64_t(j) * n;
    for (uint64_t e = 0; e < n; ++e) out[e * size + j] = plane[e];
  }
  std::memcpy(out + n * size, in + n * size, length - n * size);
}

// Stored big-endian: each element's bytes reversed, in place.
void swap_elements(uint8_t* data, uint64_t n, uint32_t size) {
  for (uint64_t at = 0; at + size <= n; at += size) {
    for (uint32_t j = 0; j < size / 2; ++j) std::swap(data[at + j], data[at + size - 1 - j]);
  }
}

// Each of a row's `count` elements (after the first `distance`) was stored as its
// difference from the element `distance` before it; unsigned, so the sums wrap
// as the writer's differences did.
template <typename T>
void undo_differences(uint8_t* data, uint64_t rows, uint64_t count, uint64_t distance) {
  for (uint64_t r = 0; r < rows; ++r) {
    uint8_t* row = data + r * count * sizeof(T);
    for (uint64_t i = distance; i < count; ++i) {
      T value, before;
      std::memcpy(&value, row + i * sizeof(T), sizeof(T));
      std::memcpy(&before, row + (i - distance) * sizeof(T), sizeof(T));
      value = static_cast<T>(value + before);
      std::memcpy(row + i * sizeof(T), &value, sizeof(T));
    }
  }
}

// TIFF's rows are along the chunk's last two axes: columns, then a pixel's samples.
// False when `n` bytes are not whole rows (a clipped edge of a chunk of rank 2).
bool undo_predictor(const ArrayLayout& layout, uint32_t param, uint8_t* data, uint64_t n) {
  const auto& c = layout.chunk_shape;
  const size_t rank = c.size();
  uint64_t distance = c[rank - 1];
  uint64_t count = rank < 2 ? c[0] : c[rank - 1] * c[rank - 2];
  if (n % (count * param) != 0) return false;
  uint64_t rows = n / (count * param);
  switch (param) {
    case 1:
      undo_differences<uint8_t>(data, rows, count, distance);
      break;
    case 2:
      undo_differences<uint16_t>(data, rows, count, distance);
      break;
    case 4:
      undo_differences<uint32_t>(data, rows, count, distance);
      break;
    default:
      undo_differences<uint64_t>(data, rows, count, distance);
      break;
  }
  return true;
}

}  // namespace

const char* filter_name(ChunkFilter filter) {
  switch (filter) {
    case ChunkFilter::kZlib:
      return "zlib";
    case ChunkFilter::kGzip:
      return "gzip";
    case ChunkFilter::kZstd:
      return "zstd";
    case ChunkFilter::kBlosc:
      return "blosc";
    case ChunkFilter::kShuffle:
      return "shuffle";
    case ChunkFilter::kFletcher32:
      return "fletcher32";
    case ChunkFilter::kCrc32c:
      return "crc32c";
    case ChunkFilter::kJpeg:
      return "jpeg";
    case ChunkFilter::kHorizontalPredictor:
      return "horizontal predictor";
    case ChunkFilter::kSnappy:
      return "snappy";
    case ChunkFilter::kLz4Raw:
      return "lz4";
  }
  return "?";
}

void set_codec_search_dirs(std::vector<std::string> dirs) {
  Libraries& libs = libraries();
  std::lock_guard<std::mutex> lock(libs.mutex);
  libs.dirs = std::move(dirs);
}

std::string codec_library(ChunkFilter filter) {
  LibraryState* state = library_state(filter);
  if (state == nullptr) return "";
  std::lock_guard<std::mutex> lock(libraries().mutex);
  return state->ready ? state->path : "";
}

std::string codec_unavailable(ChunkFilter filter) {
#ifndef STOKER_HAVE_IMAGE
  if (filter == ChunkFilter::kJpeg) {
    return "JPEG tiles need libjpeg-turbo, and this build of stoker was made without it: "
           "install its development files and libpng's (Debian: apt-get install "
           "libjpeg62-turbo-dev libpng-dev; Ubuntu: libjpeg-turbo8-dev libpng-dev) and "
           "reinstall stoker";
  }
#endif
  LibraryState* state = library_state(filter);
  if (state == nullptr) return "";
  std::lock_guard<std::mutex> lock(libraries().mutex);
  return state->ready ? "" : state->error;
}

void decompress_exact(ChunkFilter filter, const uint8_t* src, uint64_t n, uint8_t* dest,
                      uint64_t size, const std::string& path, uint64_t offset) {
  if (filter == ChunkFilter::kZlib || filter == ChunkFilter::kGzip) {
    inflate_exact(src, n, dest, size, path, offset,
                  filter == ChunkFilter::kZlib ? Wrapper::kZlib : Wrapper::kGzip);
    return;
  }
  if (filter == ChunkFilter::kSnappy) return decompress_snappy(src, n, dest, size, path, offset);
  if (filter == ChunkFilter::kLz4Raw) return decompress_lz4(src, n, dest, size, path, offset);
  if (filter != ChunkFilter::kZstd) {
    throw Error("decompress_exact: zlib, gzip, zstd, snappy or lz4");
  }
  const ZstdApi* api = zstd_api();
  if (api == nullptr) throw FormatError(path, offset, codec_unavailable(ChunkFilter::kZstd));
  struct Context {  // one per thread, freed with it
    const ZstdApi* api = nullptr;
    void* dctx = nullptr;
    ~Context() {
      if (dctx) api->free_context(dctx);
    }
  };
  thread_local Context context;
  if (context.dctx == nullptr) {
    context.api = api;
    context.dctx = api->create();
    if (context.dctx == nullptr) throw Error("zstd: cannot create a decompression context");
  }
  // `dest` has one byte more than `size` when the caller can spare it; without it a
  // frame that decodes past `size` fails as too small a destination, still refused.
  size_t got = api->decompress(context.dctx, dest, size, src, n);
  if (api->is_error(got)) {
    throw FormatError(path, offset, std::string("corrupt zstd data: ") + api->error_name(got));
  }
  if (got != size) {
    throw FormatError(path, offset,
                      "zstd data decodes to " + std::to_string(got) + " bytes, but " +
                          std::to_string(size) + " were expected");
  }
}

uint8_t* decode_chunk(const ArrayLayout& layout, uint32_t mask, uint8_t* src, uint64_t size,
                      uint64_t want, std::vector<uint8_t>& scratch_a,
                      std::vector<uint8_t>& scratch_b, const std::string& path, uint64_t offset,
                      const std::string& where, const ChunkRegion& region, uint8_t* into,
                      image::detail::EntropyMarks* marks) {
  auto fail = [&](const std::string& what) -> FormatError {
    return FormatError(path, offset, layout.name + ", chunk " + where + ": " + what);
  };
  uint8_t* data = src;
  uint64_t n = size;
  // The predictor needs values, so a big-endian chunk is swapped before it (it is the
  // writer's first step: check()) rather than last.
  bool swapped = layout.itemsize == 1;
  // Steps run last to first: the last to run is the first not skipped.
  size_t final_step = layout.steps.size();
  for (size_t k = 0; k < layout.steps.size(); ++k) {
    if (!(k < 32 && (mask >> k) & 1)) {
      final_step = k;
      break;
    }
  }
  size_t k = layout.steps.size();
  // Where step k writes `bytes`: the caller's `into` for the final step's whole chunk,
  // else the scratch buffer `data` is not in.
  // A JPEG step's scratch is skewed (image::detail::skewed_start), so that a tile's rows,
  // when their length is a multiple of 16 bytes, start off the boundaries where
  // libjpeg-turbo stores around the cache unless a crop's first column puts them there
  // (read_rows in image/jpeg.cpp decodes such rows into spare rows and copies them).
  auto output = [&](uint64_t bytes, bool skew = false) -> uint8_t* {
    if (into != nullptr && k == final_step && bytes == want) return into;
    const auto at = reinterpret_cast<uintptr_t>(data),
               a0 = reinterpret_cast<uintptr_t>(scratch_a.data());
    const bool in_a = at >= a0 && at < a0 + scratch_a.size();
    std::vector<uint8_t>& scratch = in_a ? scratch_b : scratch_a;
    const uint64_t room = bytes + (skew ? image::detail::kSkewedRoom : 0);
    if (scratch.size() < room) scratch.resize(room);
    return skew ? image::detail::skewed_start(scratch.data()) : scratch.data();
  };
  while (k-- > 0) {
    if (k < 32 && (mask >> k) & 1) continue;
    const ChunkStep& step = layout.steps[k];
    switch (step.filter) {
      case ChunkFilter::kFletcher32:
      case ChunkFilter::kCrc32c: {
        if (n < 4) throw fail("shorter than its 4-byte " + std::string(filter_name(step.filter)));
        n -= 4;
        uint32_t stored = util::le32(data + n);
        if (step.filter == ChunkFilter::kCrc32c) {
          uint32_t got = crc32c_of(data, n);
          if (got != stored) throw fail("CRC-32C mismatch: the chunk is corrupt");
        } else {
          uint32_t got = fletcher32_of(data, n);
          // HDF5 before 1.6.3 wrote the sum with its bytes reversed; both are accepted.
          if (got != stored && byte_reversed(got) != stored) {
            throw fail("Fletcher-32 checksum mismatch: the chunk is corrupt");
          }
        }
        break;
      }
      case ChunkFilter::kZlib:
      case ChunkFilter::kGzip:
      case ChunkFilter::kZstd:
      case ChunkFilter::kSnappy:
      case ChunkFilter::kLz4Raw: {
        uint8_t* out = output(want);
        try {
          decompress_exact(step.filter, data, n, out, want, path, offset);
        } catch (const FormatError& e) {
          throw fail(e.detail());
        }
        data = out;
        n = want;
        break;
      }
      case ChunkFilter::kBlosc: {
        const BloscApi* api = blosc_api();
        if (api == nullptr) throw fail(codec_unavailable(ChunkFilter::kBlosc));
        if (n < 16) throw fail("a blosc buffer shorter than its 16-byte header");
        size_t nbytes = 0, cbytes = 0, blocksize = 0;
        api->sizes(data, &nbytes, &cbytes, &blocksize);
        if (cbytes > n || cbytes < 16) {
          throw fail("the blosc header says " + std::to_string(cbytes) +
                     " compressed bytes, but the chunk holds " + std::to_string(n));
        }
        if (nbytes != want) {
          throw fail("the blosc header says " + std::to_string(nbytes) + " bytes, but " +
                     std::to_string(want) + " were expected");
        }
        uint8_t* out = output(want);
        int got = api->decompress(data, out, want, 1);
        if (got < 0 || uint64_t(got) != want) throw fail("corrupt blosc data");
        data = out;
        n = want;
        break;
      }
      case ChunkFilter::kShuffle: {
        if (step.param > 1 && n / step.param > 1) {
          uint8_t* out = output(n);
          unshuffle(data, out, n, step.param);
          data = out;
        }
        break;
      }
      case ChunkFilter::kJpeg: {
        std::string why = codec_unavailable(ChunkFilter::kJpeg);
        if (!why.empty()) throw Error(layout.name + ": " + why);
        const auto& shape = layout.chunk_shape;
        const size_t rank = shape.size();
        // Rows of (columns, samples) in the chunk's last two axes, or, for one sample
        // a pixel, of columns in its last.
        auto check = [&](uint32_t width, uint32_t height, uint32_t components) -> std::string {
          bool rows_fit =
              (components == shape[rank - 1] && rank >= 2 && width == shape[rank - 2]) ||
              (components == 1 && width == shape[rank - 1]);
          if (rows_fit && uint64_t(width) * height * components == want) return "";
          return "a JPEG tile of " + std::to_string(width) + " x " + std::to_string(height) +
                 " pixels of " + std::to_string(components) + " samples, where the chunk is " +
                 std::to_string(want) + " bytes";
        };
        uint8_t* out = output(want, true);
        std::string problem = image::detail::decode_jpeg_tile(
            layout.jpeg_tables.data(), layout.jpeg_tables.size(), data, n, step.param == kJpegRgb,
            check, out, {region.row0, region.row1, region.col0, region.col1}, marks);
        if (!problem.empty()) throw fail("JPEG: " + problem);
        data = out;
        n = want;
        break;
      }
      case ChunkFilter::kHorizontalPredictor: {
        if (n != want) {
          throw fail("holds " + std::to_string(n) + " bytes where a chunk of " +
                     std::to_string(want) + " was expected");
        }
        if (layout.byteswap && !swapped) {
          swap_elements(data, n, layout.itemsize);
          swapped = true;
        }
        if (!undo_predictor(layout, step.param, data, n)) {
          throw fail("a clipped chunk of rank 2 does not hold whole rows to undo the predictor in");
        }
        break;
      }
    }
  }
  if (n != want) {
    throw fail("holds " + std::to_string(n) + " bytes where a chunk of " + std::to_string(want) +
               " was expected");
  }
  if (layout.byteswap && !swapped) swap_elements(data, n, layout.itemsize);
  return data;
}

}  // namespace stoker::io
