// Parquet's pages decoded into one buffer per run of rows (parquet.hpp). Levels and
// dictionary indices are read in batches by a resumable RLE/bit-packed decoder, so a
// page costs a few kilobytes of scratch beyond its decompressed bytes whatever it
// claims; every run, length and index is checked against the bytes it lies in, and
// what a decode writes is checked against spec.max_decoded_bytes before it is written.
#include <algorithm>
#include <cstring>
#include <memory>

#include "stoker/errors.hpp"
#include "stoker/format/parquet.hpp"
#include "stoker/format/parquet_thrift.hpp"
#include "stoker/io/chunk_codec.hpp"
#include "stoker/util/little_endian.hpp"

namespace stoker::format::parquet {

namespace {

using detail::PageHeader;

// Parquet's sizes are i32, so no page is larger than 2 GiB; a writer's is a megabyte.
constexpr uint64_t kMaxPageBytes = 1ull << 30;
// A thread's buffer of decompressed pages is given back after a decode that made it
// larger than this.
constexpr uint64_t kPageScratchKeep = 16ull << 20;
// Levels and indices decoded at a time.
constexpr size_t kBatch = 4096;
// A decoded buffer's header: rows, where the nulls are (0: no row is null), where the
// data is, how many bytes of it, where the starts of values left in place are (0: none
// are), how many bytes those values take when they are in the stored bytes, and 1 when
// they are in the data instead (0 otherwise); the row offsets follow.
constexpr uint64_t kHeaderBytes = 56;
// The RLE/bit-packed hybrid's run lengths are at most 2^31 - 1 values (Encodings.md).
constexpr uint64_t kMaxRun = (1ull << 31) - 1;

enum Encoding : int32_t {
  kPlain = 0,
  kPlainDictionary = 2,
  kRle = 3,
  kBitPacked = 4,
  kRleDictionary = 8,
  kByteStreamSplit = 9,
};

std::string encoding_name(int32_t e) {
  static constexpr const char* kNames[] = {"PLAIN",
                                           "GROUP_VAR_INT",
                                           "PLAIN_DICTIONARY",
                                           "RLE",
                                           "BIT_PACKED",
                                           "DELTA_BINARY_PACKED",
                                           "DELTA_LENGTH_BYTE_ARRAY",
                                           "DELTA_BYTE_ARRAY",
                                           "RLE_DICTIONARY",
                                           "BYTE_STREAM_SPLIT",
                                           "ALP"};
  std::string number = "encoding " + std::to_string(e);
  return e >= 0 && e < 11 ? std::string(kNames[e]) + " (" + number + ")" : number;
}

const char* type_name(PhysicalType t) {
  static constexpr const char* kNames[] = {
      "BOOLEAN", "INT32",  "INT64",      "INT96",
      "FLOAT",   "DOUBLE", "BYTE_ARRAY", "FIXED_LEN_BYTE_ARRAY"};
  return static_cast<uint8_t>(t) < 8 ? kNames[static_cast<uint8_t>(t)] : "an unknown type";
}

uint64_t round8(uint64_t n) { return (n + 7) & ~uint64_t{7}; }

// Bytes of one decoded value; 0 for BYTE_ARRAY, whose values vary.
uint64_t value_width(const ColumnSpec& s) {
  switch (s.type) {
    case PhysicalType::kBoolean:
      return 1;
    case PhysicalType::kInt32:
    case PhysicalType::kFloat:
      return 4;
    case PhysicalType::kInt64:
    case PhysicalType::kDouble:
      return 8;
    case PhysicalType::kInt96:
      return 12;
    case PhysicalType::kFixedLenByteArray:
      return static_cast<uint64_t>(s.type_length);
    default:
      return 0;
  }
}

uint32_t bit_width(uint32_t max_value) {
  uint32_t bits = 0;
  while (max_value >> bits) ++bits;
  return bits;
}

// The definition level at which a list's repeated field holds an element.
int32_t element_definition(const ColumnSpec& s) {
  return s.repeated_definition >= 0 ? s.repeated_definition : s.max_definition - 1;
}

// What cannot be decoded whatever the pages hold: refused before any page is read.
void check_spec(const ColumnSpec& s, const std::string& path, uint64_t offset) {
  auto refuse = [&](const std::string& why) {
    throw FormatError(path, offset, s.name + ": " + why);
  };
  if (static_cast<uint8_t>(s.type) > 7) {
    refuse("physical type " + std::to_string(static_cast<int>(s.type)) + " is not Parquet's");
  }
  if (s.type == PhysicalType::kInt96) {
    refuse(
        "INT96 (a legacy timestamp) is not supported: convert it with pyarrow: read the file "
        "(INT96 becomes timestamp[ns]) and write it again without "
        "use_deprecated_int96_timestamps, or with coerce_timestamps='us', or cast the column "
        "to timestamp[ns]");
  }
  if (s.type == PhysicalType::kFixedLenByteArray && s.type_length <= 0) {
    refuse("a FIXED_LEN_BYTE_ARRAY of type_length " + std::to_string(s.type_length));
  }
  if (s.max_definition < 0 || s.max_repetition < 0) refuse("negative maximum levels");
  if (s.max_repetition > 1) {
    refuse("nested lists (repetition level " + std::to_string(s.max_repetition) +
           ") are not supported: only a list of primitive values is; flatten the column");
  }
  if (s.max_repetition == 1) {
    if (s.type == PhysicalType::kByteArray) {
      refuse(
          "a list of byte arrays (strings or binaries) is not supported: only lists of "
          "fixed-width values are; store each list as one binary value instead");
    }
    int32_t element = element_definition(s);
    if (element < 1 || element > s.max_definition) {
      refuse("a list whose elements are present at definition level " + std::to_string(element) +
             ", outside 1 to the maximum " + std::to_string(s.max_definition));
    }
  }
  switch (s.codec) {
    case Compression::kUncompressed:
    case Compression::kSnappy:
    case Compression::kGzip:
    case Compression::kZstd:
    case Compression::kLz4Raw:
      return;
    case Compression::kLz4:
      refuse(
          "the deprecated Hadoop LZ4 codec (LZ4, codec 5) is not supported: rewrite the file "
          "with pyarrow, compression='lz4' (which writes LZ4_RAW), 'zstd' or 'snappy'");
    case Compression::kLzo:
    case Compression::kBrotli:
      refuse(std::string(s.codec == Compression::kLzo ? "LZO" : "BROTLI") +
             " compression is not supported: rewrite the file with pyarrow, compression='zstd' "
             "(or 'snappy', 'gzip', 'lz4', 'none')");
  }
  refuse("compression codec " + std::to_string(static_cast<int>(s.codec)) + " is not Parquet's");
}

// The RLE / bit-packed hybrid, resumable: each next() carries on where the last stopped.
class HybridDecoder {
 public:
  HybridDecoder() = default;
  HybridDecoder(const uint8_t* p, uint64_t size, uint32_t width)
      : p_(p), size_(size), width_(width) {}

  // Decodes `n` values into `out`; null, or what is wrong with the runs.
  const char* next(uint32_t* out, uint64_t n) {
    const char* why = nullptr;
    if (some(out, n, &why) == n) return nullptr;
    return why != nullptr ? why : "they end before every value is decoded";
  }

  // Up to `n` values into `out`, fewer where the runs end first (a page's last run may
  // be cut short after its last value); *why says what is wrong when they are damaged.
  uint64_t some(uint32_t* out, uint64_t n, const char** why) {
    uint64_t got = 0;
    while (got < n) {
      if (rle_left_ == 0 && literal_left_ == 0) {
        if (pos_ >= size_) return got;
        if ((*why = start_run()) != nullptr) return got;
        continue;
      }
      if (rle_left_ > 0) {
        uint64_t k = std::min(n - got, rle_left_);
        std::fill(out + got, out + got + k, rle_value_);
        got += k;
        rle_left_ -= k;
        continue;
      }
      const uint64_t readable =
          width_ == 0 ? literal_left_ : literal_bytes_ * 8 / width_ - literal_index_;
      const uint64_t k = std::min({n - got, literal_left_, readable});
      if (k == 0) {  // the run's bytes end before its values do
        literal_left_ = 0;
        continue;
      }
      unpack(out + got, k);
      literal_index_ += k;
      literal_left_ -= k;
      got += k;
    }
    return got;
  }

 private:
  const char* start_run() {
    uint64_t header = 0;
    for (int shift = 0;; shift += 7) {
      if (pos_ >= size_) return "a run header is cut off by the end of its bytes";
      if (shift > 35) return "a run header longer than 5 bytes";
      uint8_t b = p_[pos_++];
      header |= uint64_t(b & 0x7f) << shift;
      if ((b & 0x80) == 0) break;
    }
    uint64_t count = header >> 1;
    if (header & 1) {
      if (count * 8 > kMaxRun + 1) return "a bit-packed run longer than 2^31 values";
      literal_left_ = count * 8;
      literal_index_ = 0;
      literal_ = p_ + pos_;
      // A writer may end the last run early; only the values read must be there.
      literal_bytes_ = std::min(count * width_, size_ - pos_);
      pos_ += literal_bytes_;
      return nullptr;
    }
    if (count > kMaxRun) return "a run longer than 2^31 - 1 values";
    uint64_t bytes = (width_ + 7) / 8;
    if (bytes > size_ - pos_) return "a run's value is cut off by the end of its bytes";
    uint64_t value = 0;
    for (uint64_t i = 0; i < bytes; ++i) value |= uint64_t(p_[pos_ + i]) << (8 * i);
    pos_ += bytes;
    if (width_ < 32 && value >> width_) return "a run's value is wider than its bit width";
    rle_value_ = static_cast<uint32_t>(value);
    rle_left_ = count;
    return nullptr;
  }

  // Values are packed from each byte's least significant bit up.
  void unpack(uint32_t* out, uint64_t k) const {
    const uint64_t mask = (uint64_t{1} << width_) - 1;
    for (uint64_t i = 0; i < k; ++i) {
      uint64_t bit = (literal_index_ + i) * width_;
      uint64_t byte = bit >> 3;
      uint64_t word = 0;
      if (byte + 8 <= literal_bytes_) {
        word = util::le64(literal_ + byte);
      } else {
        for (uint64_t j = 0; byte + j < literal_bytes_; ++j) {
          word |= uint64_t(literal_[byte + j]) << (8 * j);
        }
      }
      out[i] = static_cast<uint32_t>((word >> (bit & 7)) & mask);
    }
  }

  const uint8_t* p_ = nullptr;
  uint64_t size_ = 0, pos_ = 0;
  uint32_t width_ = 0;
  uint64_t rle_left_ = 0;
  uint32_t rle_value_ = 0;
  uint64_t literal_left_ = 0, literal_index_ = 0, literal_bytes_ = 0;
  const uint8_t* literal_ = nullptr;
};

// The buffer view_decoded reads: header, row offsets, the values' starts (when they
// are left in place), nulls (when the column may have them), then the data, which
// grows as pages are decoded. `in_data`: the values are left in the data (pages kept
// whole), not in the stored bytes.
class Output {
 public:
  Output(uint64_t rows, bool nullable, bool has_starts, bool in_data)
      : rows_(rows), in_data_(in_data) {
    starts_at_ = has_starts ? kHeaderBytes + 8 * (rows + 1) : 0;
    nulls_at_ = kHeaderBytes + 8 * (rows + 1) + (has_starts ? 8 * rows : 0);
    data_at_ = nulls_at_ + (nullable ? round8(rows) : 0);
    // Null flags are read for every row and set only for the null ones, starts only for
    // the rows that are not null; the rest of the buffer is written before it is read, so
    // only this part is cleared.
    buffer_.assign(data_at_, 0);
    used_ = data_at_;
  }
  // Bytes the buffer needs before any data: what `rows` costs whatever the pages hold.
  static uint64_t fixed_bytes(uint64_t rows, bool nullable, bool has_starts) {
    return kHeaderBytes + 8 * (rows + 1) + (has_starts ? 8 * rows : 0) +
           (nullable ? round8(rows) : 0);
  }

  // Room for `bytes` of data made now, so that appends up to them copy nothing.
  void expect(uint64_t bytes) {
    if (buffer_.size() < used_ + bytes) buffer_.resize(used_ + bytes);
  }
  uint64_t data_size() const { return used_ - data_at_; }
  // The values' bytes the offsets count: those copied, or those left in place.
  uint64_t values_size() const { return in_data_ ? left_bytes_ : data_size() + left_bytes_; }
  uint64_t total_size() const { return used_; }
  bool has_starts() const { return starts_at_ != 0; }
  // Row `row`'s value: `n` bytes at `at` in the stored bytes (or the data), left there.
  void leave_in_place(uint64_t row, uint64_t at, uint64_t n) {
    std::memcpy(buffer_.data() + starts_at_ + 8 * row, &at, 8);
    left_bytes_ += n;
  }
  void set_offset(uint64_t row, uint64_t at) { std::memcpy(offsets(row), &at, 8); }
  // Where row `row`'s offset is, until the next append.
  uint8_t* offsets(uint64_t row) { return buffer_.data() + kHeaderBytes + 8 * row; }
  void set_null(uint64_t row) { buffer_[nulls_at_ + row] = 1; }
  // Room for `n` more bytes of data, written by the caller.
  uint8_t* append(uint64_t n) {
    if (used_ + n > buffer_.size()) {
      buffer_.resize(std::max(used_ + n, buffer_.size() + buffer_.size() / 2));
    }
    uint8_t* at = buffer_.data() + used_;
    used_ += n;
    return at;
  }

  io::ByteVector finish(bool any_null) {
    set_offset(rows_, values_size());
    buffer_.resize(used_);
    uint64_t header[7] = {rows_,      any_null ? nulls_at_ : 0,   data_at_, data_size(),
                          starts_at_, in_data_ ? 0 : left_bytes_, in_data_};
    std::memcpy(buffer_.data(), header, sizeof header);
    return std::move(buffer_);
  }

 private:
  io::ByteVector buffer_;
  uint64_t rows_, starts_at_, nulls_at_, data_at_, used_;
  bool in_data_;
  uint64_t left_bytes_ = 0;
};

// The byte range of each dictionary entry, from a buffer read_dictionary_page made.
struct Dictionary {
  DecodedView view;
  uint64_t entries = 0;
};

// Names a page in messages: its column, its number, and its header's file offset.
struct PageContext {
  const std::string& path;
  const std::string& column;
  uint64_t number = 0;
  uint64_t at = 0;

  std::string prefix() const { return column + ", page " + std::to_string(number) + ": "; }
  [[noreturn]] void fail(const std::string& why) const {
    throw FormatError(path, at, prefix() + why);
  }
};

// The header of the page at `data` (`size` bytes left in the chunk), its body checked
// to lie inside them.
PageHeader read_header(const PageContext& page, const ColumnSpec& spec, const uint8_t* data,
                       uint64_t size) {
  PageHeader h = detail::parse_page_header(data, size, page.path, page.at, page.prefix());
  if (static_cast<uint64_t>(h.compressed_page_size) > size - h.header_size) {
    page.fail("its compressed size (" + std::to_string(h.compressed_page_size) +
              " bytes) runs past the end of the column chunk (" +
              std::to_string(size - h.header_size) + " bytes left after its header)");
  }
  // A page is scratch for what it decodes to, and no larger than that in any real file.
  const uint64_t limit = std::min(kMaxPageBytes, spec.max_decoded_bytes);
  if (static_cast<uint64_t>(h.uncompressed_page_size) > limit) {
    page.fail("its uncompressed size (" + std::to_string(h.uncompressed_page_size) +
              " bytes) is more than the " + std::to_string(limit) + " a page may have here");
  }
  return h;
}

// Decodes the pages of one column chunk (or of a dictionary page, as a PLAIN page of
// entries) into one Output.
class ColumnDecoder {
 public:
  // `stored`: where the chunk's stored bytes begin, for a decode in place (see
  // decode_column_chunk), which only byte strings stored as they are can have.
  // `kept_bytes`: not 0, the decompressed pages are kept whole, values left in them
  // (kept_pages_bytes says what they take), which only compressed byte strings can have.
  ColumnDecoder(const ColumnSpec& spec, const std::string& path, uint64_t rows,
                const Dictionary* dictionary, uint64_t first_page, uint64_t file_offset,
                const uint8_t* stored = nullptr, uint64_t kept_bytes = 0)
      : spec_(spec),
        path_(path),
        rows_(rows),
        width_(value_width(spec)),
        element_definition_(spec.max_repetition ? element_definition(spec) : 0),
        dictionary_(dictionary),
        page_{path, spec.name, first_page, file_offset},
        stored_(may_leave(spec, dictionary, rows) && spec.codec == Compression::kUncompressed
                    ? stored
                    : nullptr),
        kept_bytes_(may_leave(spec, dictionary, rows) && spec.codec != Compression::kUncompressed
                        ? kept_bytes
                        : 0),
        output_((check_rows(rows), rows), spec.max_definition > 0,
                stored_ != nullptr || kept_bytes_ != 0, kept_bytes_ != 0) {}
  ~ColumnDecoder() { io::give_back_if_larger(page_scratch(), kPageScratchKeep); }

  // Data pages back to back; INDEX_PAGEs skipped.
  void decode_pages(const uint8_t* data, uint64_t size, uint64_t file_offset) {
    // A column of fixed-width scalars needs at most a value a row: room made once, where
    // the pages' size makes it believable (a hostile footer's row count does not).
    if (width_ > 0 && spec_.max_repetition == 0) {
      const uint64_t room = spec_.max_decoded_bytes - output_.total_size();
      const uint64_t likely = std::min(rows_ <= room / width_ ? rows_ * width_ : room,
                                       size <= room / 8 ? size * 8 + 65536 : room);
      output_.expect(std::min(likely, room));
    } else if (kept_bytes_ != 0) {
      // What the pages' headers say, within the budget; up to a believable ratio to the
      // stored bytes made now (a few bytes of hostile headers may claim gigabytes).
      output_.expect(std::min<uint64_t>(kept_bytes_, 16 * size + (1 << 20)));
    } else if (width_ == 0 && !output_.has_starts()) {
      // Byte strings: about the pages' own size (a little more, for compressed pages),
      // made once, not grown page by page, each growth a copy into fresh memory.
      const uint64_t room = spec_.max_decoded_bytes - output_.total_size();
      output_.expect(std::min(size <= room ? size + size / 8 : room, room));
    }
    uint64_t pos = 0;
    bool first = true;
    while (pos < size) {
      if (!first) ++page_.number;
      first = false;
      page_.at = file_offset + pos;
      PageHeader h = read_header(page_, spec_, data + pos, size - pos);
      const uint8_t* body = data + pos + h.header_size;
      pos += h.header_size + h.compressed_page_size;
      if (h.type == detail::kIndexPage) continue;
      if (h.type == detail::kDictionaryPage) {
        fail("a dictionary page among the data pages: only a column chunk's first page may be one");
      }
      if (h.type != detail::kDataPage && h.type != detail::kDataPageV2) {
        fail("unknown page type " + std::to_string(h.type));
      }
      data_page(h, body);
    }
    if (row_ != rows_) {
      fail("the pages hold " + std::to_string(row_) + " rows, but the column chunk has " +
           std::to_string(rows_));
    }
  }

  // A dictionary page's body: `entries` PLAIN values, one "row" each.
  void dictionary_page(const PageHeader& h, const uint8_t* body) {
    if (h.encoding != kPlain && h.encoding != kPlainDictionary) {
      fail("a dictionary page in " + encoding_name(h.encoding) + ", not PLAIN");
    }
    const uint8_t* values =
        decompressed(body, h.compressed_page_size, h.uncompressed_page_size, true);
    start_values(kPlain, values, h.uncompressed_page_size);
    for (uint64_t done = 0; done < rows_; done += kBatch) {
      walk(std::min<uint64_t>(kBatch, rows_ - done));
    }
    check_values_used();
  }

  io::ByteVector finish() { return output_.finish(any_null_); }

  [[noreturn]] void fail(const std::string& why) const { page_.fail(why); }

 private:
  // Whether `rows` rows' offsets, nulls and (left in place) starts fit the budget.
  static bool rows_fit(const ColumnSpec& spec, uint64_t rows, bool has_starts) {
    const uint64_t cap = spec.max_decoded_bytes, per_row = has_starts ? 17 : 9;
    return cap > kHeaderBytes && rows <= (cap - kHeaderBytes) / per_row &&
           Output::fixed_bytes(rows, spec.max_definition > 0, has_starts) <= cap;
  }

 public:
  // Whether the chunk's values may be left where they lie: in the stored bytes, when
  // they are uncompressed, else in the decompressed pages (kept_pages_bytes says
  // whether those fit the budget and are worth keeping). A chunk whose starts would not
  // fit the budget is copied instead, as any chunk the copying decode accepts must decode.
  static bool may_leave(const ColumnSpec& spec, const Dictionary* dictionary, uint64_t rows) {
    return spec.type == PhysicalType::kByteArray && spec.max_repetition == 0 &&
           dictionary == nullptr && rows_fit(spec, rows, true);
  }

 private:
  // (stored_ and kept_bytes_ are set before output_, which calls this.)
  void check_rows(uint64_t rows) const {
    const uint64_t cap = spec_.max_decoded_bytes;
    if (!rows_fit(spec_, rows, stored_ != nullptr || kept_bytes_ != 0)) {
      fail(std::to_string(rows) + " rows would decode to more than the " + std::to_string(cap) +
           " bytes allowed (ColumnSpec::max_decoded_bytes)");
    }
  }

  // `n` stored bytes of a page (or of a v2 page's values), `want` bytes once
  // decompressed: the codec undone unless the page says it was not applied.
  const uint8_t* decompressed(const uint8_t* src, uint64_t n, uint64_t want, bool compressed) {
    if (stored_as_is(n, want, compressed)) return src;
    io::ByteVector& scratch = page_scratch();
    if (scratch.size() < want + 1) {
      scratch.clear();  // (nothing of the last page to copy into the larger buffer)
      scratch.resize(want + 1);
    }
    decompress_into(src, n, scratch.data(), want);
    return scratch.data();
  }

  const uint8_t* page_bytes(const uint8_t* src, uint64_t n, uint64_t want, bool compressed) {
    return kept_bytes_ != 0 ? kept(src, n, want, compressed)
                            : decompressed(src, n, want, compressed);
  }

  // The same, appended to the data and kept there (kept_bytes_ set); kept_at_ says where.
  const uint8_t* kept(const uint8_t* src, uint64_t n, uint64_t want, bool compressed) {
    kept_at_ = output_.data_size();
    uint8_t* into = room_for(want);
    if (stored_as_is(n, want, compressed)) {
      std::memcpy(into, src, n);
    } else {
      decompress_into(src, n, into, want);
    }
    kept_page_ = into;
    return into;
  }

  bool stored_as_is(uint64_t n, uint64_t want, bool compressed) const {
    if (spec_.codec != Compression::kUncompressed && compressed) return false;
    if (n != want) {
      fail("stored uncompressed in " + std::to_string(n) + " bytes, but its header says " +
           std::to_string(want));
    }
    return true;
  }

  void decompress_into(const uint8_t* src, uint64_t n, uint8_t* dest, uint64_t want) {
    io::ChunkFilter filter = io::ChunkFilter::kZstd;
    const char* codec = "zstd";
    switch (spec_.codec) {
      case Compression::kSnappy:
        filter = io::ChunkFilter::kSnappy;
        codec = "snappy";
        break;
      case Compression::kGzip:
        // A gzip stream, as the format says; some writers stored zlib's wrapper.
        filter = n >= 2 && src[0] == 0x1f && src[1] == 0x8b ? io::ChunkFilter::kGzip
                                                            : io::ChunkFilter::kZlib;
        codec = "gzip";
        break;
      case Compression::kLz4Raw:
        filter = io::ChunkFilter::kLz4Raw;
        codec = "lz4";
        break;
      default:
        break;
    }
    try {
      io::decompress_exact(filter, src, n, dest, want, path_, page_.at);
    } catch (const FormatError& e) {
      fail(std::string(codec) + " page: " + e.detail());
    }
  }

  // Where one level stream lies in a v1 page: a 4-byte length, then the runs.
  HybridDecoder levels_v1(const uint8_t* page, uint64_t size, uint64_t& pos, int32_t encoding,
                          int16_t max_level, const char* what) {
    if (encoding == kBitPacked) {
      fail(std::string("its ") + what + " levels are in the legacy BIT_PACKED encoding, which is " +
           "not supported: rewrite the file with pyarrow");
    }
    if (encoding != kRle) {
      fail(std::string("its ") + what + " levels are in " + encoding_name(encoding) + ", not RLE");
    }
    if (size - pos < 4) fail(std::string("its ") + what + " levels' length is cut off");
    uint64_t length = util::le32(page + pos);
    pos += 4;
    if (length > size - pos) {
      fail(std::string("its ") + what + " levels (" + std::to_string(length) +
           " bytes) run past the end of the page");
    }
    HybridDecoder levels(page + pos, length, bit_width(max_level));
    pos += length;
    return levels;
  }

  void data_page(const PageHeader& h, const uint8_t* body) {
    const bool v2 = h.type == detail::kDataPageV2;
    if (v2 ? !h.has_data_v2 : !h.has_data_v1) {
      fail(std::string("a data page without its ") + (v2 ? "DataPageHeaderV2" : "DataPageHeader"));
    }
    if (h.num_values < 0) fail("a data page without its num_values");
    const uint64_t entries = h.num_values;
    if (entries == 0) return;
    // Each entry starts a row or adds a value, so more than that is a lie told before
    // any of it is decoded.
    uint64_t room = rows_ - row_;
    if (spec_.max_repetition > 0) room += (spec_.max_decoded_bytes - output_.total_size()) / width_;
    if (entries > room) {
      fail("it holds " + std::to_string(entries) + " values, more than the " +
           std::to_string(rows_ - row_) + " rows left in the column chunk can have");
    }
    HybridDecoder repetition, definition;
    const uint8_t* values = nullptr;
    uint64_t values_size = 0;
    if (v2) {
      const uint64_t rl = h.repetition_levels_byte_length, dl = h.definition_levels_byte_length;
      if (rl + dl > static_cast<uint64_t>(h.compressed_page_size) ||
          rl + dl > static_cast<uint64_t>(h.uncompressed_page_size)) {
        fail("its levels (" + std::to_string(rl + dl) + " bytes) are larger than the page");
      }
      repetition = HybridDecoder(body, rl, bit_width(spec_.max_repetition));
      definition = HybridDecoder(body + rl, dl, bit_width(spec_.max_definition));
      values_size = h.uncompressed_page_size - rl - dl;
      values = page_bytes(body + rl + dl, h.compressed_page_size - rl - dl, values_size,
                          h.is_compressed);
    } else {
      const uint8_t* page =
          page_bytes(body, h.compressed_page_size, h.uncompressed_page_size, true);
      uint64_t size = h.uncompressed_page_size, pos = 0;
      if (spec_.max_repetition > 0) {
        repetition = levels_v1(page, size, pos, h.repetition_level_encoding, spec_.max_repetition,
                               "repetition");
      }
      if (spec_.max_definition > 0) {
        definition = levels_v1(page, size, pos, h.definition_level_encoding, spec_.max_definition,
                               "definition");
      }
      values = page + pos;
      values_size = size - pos;
    }
    start_values(h.encoding, values, values_size);
    const uint64_t first_row = row_;
    for (uint64_t done = 0; done < entries; done += kBatch) {
      const uint64_t k = std::min<uint64_t>(kBatch, entries - done);
      if (spec_.max_repetition > 0) {
        if (const char* why = repetition.next(repetitions_.data(), k)) {
          fail(std::string("its repetition levels: ") + why);
        }
      }
      if (spec_.max_definition > 0) {
        if (const char* why = definition.next(definitions_.data(), k)) {
          fail(std::string("its definition levels: ") + why);
        }
      }
      walk(k);
    }
    check_values_used();
    if (v2 && h.num_rows >= 0 && row_ - first_row != static_cast<uint64_t>(h.num_rows)) {
      fail("it starts " + std::to_string(row_ - first_row) + " rows, but its header says " +
           std::to_string(h.num_rows));
    }
  }

  // `k` entries, their levels in repetitions_ and definitions_ (when the column has
  // them): rows started, nulls marked, values appended.
  void walk(uint64_t k) {
    const uint32_t max_definition = spec_.max_definition;
    const bool listed = spec_.max_repetition > 0;
    uint64_t at = output_.values_size();  // where the next value will start
    uint64_t present = 0;                 // fixed-width values, appended after the walk
    if (!listed && max_definition == 0 && width_ > 0) {  // a value a row: no levels to read
      if (k > rows_ - row_) {
        fail("it holds more rows than the " + std::to_string(rows_) + " of the column chunk");
      }
      uint8_t* offsets = output_.offsets(row_);
      for (uint64_t j = 0; j < k; ++j, at += width_) std::memcpy(offsets + 8 * j, &at, 8);
      row_ += k;
      take_fixed(k, room_for(k * width_));
      return;
    }
    for (uint64_t j = 0; j < k; ++j) {
      const uint32_t repetition = listed ? repetitions_[j] : 0;
      const uint32_t definition = max_definition ? definitions_[j] : 0;
      if (repetition > static_cast<uint32_t>(spec_.max_repetition)) {
        fail("a repetition level of " + std::to_string(repetition) + ", above the column's " +
             std::to_string(spec_.max_repetition));
      }
      if (definition > max_definition) {
        fail("a definition level of " + std::to_string(definition) + ", above the column's " +
             std::to_string(max_definition));
      }
      if (repetition == 0) {
        if (row_ == rows_) {
          fail("it holds more rows than the " + std::to_string(rows_) + " of the column chunk");
        }
        output_.set_offset(row_++, at);
        // A null or empty list is the whole of its row: no entry may continue it.
        list_ended_ = listed && static_cast<int32_t>(definition) < element_definition_;
      } else if (row_ == 0) {
        fail("its first entry continues a list (repetition level 1) that no page began");
      } else if (list_ended_) {
        fail("row " + std::to_string(row_ - 1) +
             " is a null or empty list, and an entry after it continues that list");
      }
      if (definition == max_definition) {
        if (width_ > 0) {
          at += width_;
          ++present;
        } else {
          at += append_byte_array();
        }
      } else if (!listed) {
        output_.set_null(row_ - 1);
        any_null_ = true;
      } else if (static_cast<int32_t>(definition) >= element_definition_) {
        fail("row " + std::to_string(row_ - 1) +
             " holds a null element in its list: lists are read only when none of their "
             "elements is null");
      } else if (repetition != 0) {
        fail("a list continues with an entry of definition level " + std::to_string(definition) +
             ", below the " + std::to_string(element_definition_) + " of an element");
      } else if (static_cast<int32_t>(definition) + 1 < element_definition_) {
        output_.set_null(row_ - 1);
        any_null_ = true;
      }
    }
    if (present > 0) take_fixed(present, room_for(present * width_));
  }

  uint8_t* room_for(uint64_t n) {
    if (n > spec_.max_decoded_bytes - output_.total_size()) {
      fail("the column chunk decodes to more than the " + std::to_string(spec_.max_decoded_bytes) +
           " bytes allowed (ColumnSpec::max_decoded_bytes)");
    }
    return output_.append(n);
  }

  // -- values ----------------------------------------------------------------------

  void start_values(int32_t encoding, const uint8_t* values, uint64_t size) {
    const bool boolean = spec_.type == PhysicalType::kBoolean;
    encoding_ = encoding;
    values_ = values;
    values_size_ = size;
    values_pos_ = 0;
    buffered_ = next_buffered_ = 0;
    switch (encoding) {
      case kPlain:
        return;
      case kPlainDictionary:
      case kRleDictionary: {
        if (dictionary_ == nullptr) {
          fail("it is dictionary-encoded (" + encoding_name(encoding) +
               "), but no dictionary page precedes it");
        }
        uint32_t width = size > 0 ? values[0] : 0;
        if (width > 32) fail("its dictionary indices are " + std::to_string(width) + " bits wide");
        indices_ = HybridDecoder(values + (size > 0), size - (size > 0), width);
        return;
      }
      case kRle:
        if (boolean) {
          if (size < 4) fail("its RLE-encoded booleans' length is cut off");
          uint64_t length = util::le32(values);
          if (length > size - 4) fail("its RLE-encoded booleans run past the end of the page");
          indices_ = HybridDecoder(values + 4, length, 1);
          return;
        }
        break;
      case kByteStreamSplit:
        if (!boolean && width_ > 0) {
          if (size % width_ != 0) {
            fail("its BYTE_STREAM_SPLIT values (" + std::to_string(size) +
                 " bytes) are not whole values of " + std::to_string(width_) + " bytes");
          }
          return;
        }
        break;
      default:
        break;
    }
    fail("its values are in " + encoding_name(encoding) + ", which is not supported for " +
         type_name(spec_.type) +
         " columns: rewrite the file with pyarrow, column_encoding='PLAIN' or use_dictionary=True");
  }

  // BYTE_STREAM_SPLIT's streams are as long as the page has values, so a page whose
  // levels count fewer was read with the wrong stride. (PLAIN values may be followed by
  // bytes no value uses: fastparquet writes some.)
  void check_values_used() const {
    if (encoding_ == kByteStreamSplit && values_pos_ * width_ != values_size_) {
      fail("its BYTE_STREAM_SPLIT values take " + std::to_string(values_size_) +
           " bytes, but its levels count " + std::to_string(values_pos_) + " values of " +
           std::to_string(width_) + " bytes");
    }
  }

  // The next batch of dictionary indices (or RLE booleans) into index_buffer_.
  void refill_indices() {
    const char* why = nullptr;
    buffered_ = indices_.some(index_buffer_.data(), kBatch, &why);
    next_buffered_ = 0;
    if (buffered_ == 0) {
      fail(std::string(encoding_ == kRle ? "its RLE-encoded booleans: "
                                         : "its dictionary indices: ") +
           (why != nullptr ? why : "they end before every value is decoded"));
    }
  }

  uint32_t next_index() {
    if (next_buffered_ == buffered_) refill_indices();
    return index_buffer_[next_buffered_++];
  }

  uint32_t next_entry() {
    uint32_t index = next_index();
    if (index >= dictionary_->entries) {
      fail("a dictionary index of " + std::to_string(index) + ", past the dictionary's " +
           std::to_string(dictionary_->entries) + " entries");
    }
    return index;
  }

  // `n` values of width_ bytes into `dest`.
  void take_fixed(uint64_t n, uint8_t* dest) {
    const bool boolean = spec_.type == PhysicalType::kBoolean;
    switch (encoding_) {
      case kPlain:
        if (boolean) {  // one bit each, from each byte's least significant bit up
          if (n > values_size_ * 8 - values_pos_) fail("its PLAIN booleans are cut off");
          for (uint64_t i = 0; i < n; ++i, ++values_pos_) {
            dest[i] = (values_[values_pos_ >> 3] >> (values_pos_ & 7)) & 1;
          }
        } else {
          if (n * width_ > values_size_ - values_pos_) {
            fail("its PLAIN values are cut off: " + std::to_string(n) + " more of " +
                 std::to_string(width_) + " bytes, in the page's last " +
                 std::to_string(values_size_ - values_pos_) + " bytes");
          }
          std::memcpy(dest, values_ + values_pos_, n * width_);
          values_pos_ += n * width_;
        }
        return;
      case kByteStreamSplit: {
        // Byte b of value i is in stream b, each stream as long as the values are many.
        const uint64_t stride = values_size_ / width_;
        if (n > stride - values_pos_) fail("its BYTE_STREAM_SPLIT values are cut off");
        for (uint64_t i = 0; i < n; ++i) {
          for (uint64_t b = 0; b < width_; ++b) {
            dest[i * width_ + b] = values_[b * stride + values_pos_ + i];
          }
        }
        values_pos_ += n;
        return;
      }
      case kRle:
        for (uint64_t i = 0; i < n; ++i) {
          uint32_t v = next_index();
          if (v > 1) fail("an RLE-encoded boolean of " + std::to_string(v));
          dest[i] = static_cast<uint8_t>(v);
        }
        return;
      default:
        switch (width_) {  // a copy of a known width compiles to one load and store
          case 1:
            return gather<1>(n, dest);
          case 2:
            return gather<2>(n, dest);
          case 4:
            return gather<4>(n, dest);
          case 8:
            return gather<8>(n, dest);
          default:
            return gather<0>(n, dest);
        }
    }
  }

  // `n` dictionary entries of width_ (`kWidth`, when not 0) bytes into `dest`, the
  // indices checked a batch at a time.
  template <uint64_t kWidth>
  void gather(uint64_t n, uint8_t* dest) {
    const uint64_t width = kWidth != 0 ? kWidth : width_;
    const uint8_t* entries = dictionary_->view.data;
    while (n > 0) {
      if (next_buffered_ == buffered_) refill_indices();
      const uint64_t k = std::min<uint64_t>(n, buffered_ - next_buffered_);
      const uint32_t* index = index_buffer_.data() + next_buffered_;
      const uint32_t bound =
          static_cast<uint32_t>(std::min<uint64_t>(dictionary_->entries, UINT32_MAX));
      uint32_t largest = 0;
      for (uint64_t i = 0; i < k; ++i) largest = std::max(largest, index[i]);
      if (largest >= bound) {
        fail("a dictionary index of " + std::to_string(largest) + ", past the dictionary's " +
             std::to_string(dictionary_->entries) + " entries");
      }
      for (uint64_t i = 0; i < k; ++i)
        std::memcpy(dest + i * width, entries + index[i] * width, width);
      dest += k * width;
      next_buffered_ += k;
      n -= k;
    }
  }

  // The next BYTE_ARRAY value, appended; returns its length.
  uint64_t append_byte_array() {
    const uint8_t* from = nullptr;
    uint64_t length = 0;
    if (encoding_ == kPlain) {
      if (values_size_ - values_pos_ < 4) fail("its PLAIN byte arrays are cut off");
      length = util::le32(values_ + values_pos_);
      values_pos_ += 4;
      if (length > values_size_ - values_pos_) {
        fail("a byte array of " + std::to_string(length) + " bytes runs past the end of the page");
      }
      from = values_ + values_pos_;
      values_pos_ += length;
      // (a value of row_ - 1, as only scalar columns are left in place)
      if (stored_ != nullptr) {
        output_.leave_in_place(row_ - 1, static_cast<uint64_t>(from - stored_), length);
        return length;
      }
      if (kept_bytes_ != 0) {
        output_.leave_in_place(row_ - 1, kept_at_ + static_cast<uint64_t>(from - kept_page_),
                               length);
        return length;
      }
    } else {
      uint32_t entry = next_entry();
      const uint64_t* offsets = dictionary_->view.offsets;
      from = dictionary_->view.data + offsets[entry];
      length = offsets[entry + 1] - offsets[entry];
    }
    if (length > 0) std::memcpy(room_for(length), from, length);
    return length;
  }

  const ColumnSpec& spec_;
  const std::string& path_;
  const uint64_t rows_;
  const uint64_t width_;
  const int32_t element_definition_;
  const Dictionary* dictionary_;
  PageContext page_;
  const uint8_t* stored_;      // set: byte strings are left in place, their starts from here
  const uint64_t kept_bytes_;  // not 0: pages are kept whole in the data, values in them
  Output output_;
  const uint8_t* kept_page_ = nullptr;  // the page kept last, kept_at_ bytes into the data
  uint64_t kept_at_ = 0;
  uint64_t row_ = 0;  // rows started
  bool any_null_ = false;
  bool list_ended_ = false;  // the row begun last is a null or empty list
  std::vector<uint32_t> repetitions_ = std::vector<uint32_t>(kBatch);
  std::vector<uint32_t> definitions_ = std::vector<uint32_t>(kBatch);
  // The page's values: PLAIN bytes (or bits, for booleans; values, for BYTE_STREAM_SPLIT)
  // read so far, or the runs of indices.
  int32_t encoding_ = kPlain;
  const uint8_t* values_ = nullptr;
  uint64_t values_size_ = 0, values_pos_ = 0;
  HybridDecoder indices_;
  std::vector<uint32_t> index_buffer_ = std::vector<uint32_t>(kBatch);
  uint64_t buffered_ = 0, next_buffered_ = 0;

  // Decompressed pages, one at a time: kept by the thread from one decode to the next,
  // as a page's worth of memory new to the process costs more than decompressing into
  // it (page faults and zeroing), up to a size that pyarrow's pages never reach.
  static io::ByteVector& page_scratch() {
    thread_local io::ByteVector scratch;
    return scratch;
  }
};

// A dictionary buffer's views, checked once so that every index into it can be trusted.
Dictionary dictionary_of(const io::ByteVector& buffer, const ColumnSpec& spec,
                         const std::string& path, uint64_t offset) {
  Dictionary d;
  d.view = view_decoded(buffer);
  d.entries = d.view.rows;
  const uint64_t width = value_width(spec);
  bool sound = d.view.nulls == nullptr && d.view.starts == nullptr && d.view.offsets[0] == 0;
  for (uint64_t i = 0; sound && i < d.entries; ++i) {
    uint64_t length = d.view.offsets[i + 1] - d.view.offsets[i];
    sound = d.view.offsets[i + 1] >= d.view.offsets[i] && (width == 0 || length == width) &&
            (width != 0 || length <= UINT32_MAX);
  }
  if (!sound) {
    throw FormatError(path, offset,
                      spec.name + ": the dictionary given is not one of this column's values");
  }
  return d;
}

}  // namespace

DecodedView view_decoded(const io::ByteVector& decoded) {
  uint64_t header[7];
  if (decoded.size() < kHeaderBytes) throw Error("view_decoded: not a decoded Parquet buffer");
  std::memcpy(header, decoded.data(), sizeof header);
  const uint64_t rows = header[0], nulls_at = header[1], data_at = header[2], size = header[3];
  const uint64_t starts_at = header[4], in_place = header[5], in_data = header[6];
  const uint64_t offsets_end = kHeaderBytes + 8 * (rows + 1);
  const uint64_t starts_end = starts_at != 0 ? starts_at + 8 * rows : offsets_end;
  if (rows > decoded.size() / 8 || data_at < starts_end || data_at % 8 != 0 ||
      data_at > decoded.size() || size != decoded.size() - data_at || in_data > 1 ||
      (starts_at != 0 && (starts_at != offsets_end || (size != 0 && !in_data))) ||
      (starts_at == 0 && (in_place != 0 || in_data)) || (in_data && in_place != 0) ||
      (nulls_at != 0 && (nulls_at != starts_end || data_at - nulls_at < rows))) {
    throw Error("view_decoded: not a decoded Parquet buffer");
  }
  DecodedView v;
  v.rows = rows;
  v.offsets = reinterpret_cast<const uint64_t*>(decoded.data() + kHeaderBytes);
  v.nulls = nulls_at != 0 ? decoded.data() + nulls_at : nullptr;
  if (starts_at != 0) v.starts = reinterpret_cast<const uint64_t*>(decoded.data() + starts_at);
  if (starts_at == 0 || in_data) {
    v.data = decoded.data() + data_at;
    v.data_size = size;
  }
  if (in_data ? v.offsets[rows] > size : v.offsets[rows] != size + in_place) {
    throw Error("view_decoded: not a decoded Parquet buffer");
  }
  return v;
}

std::shared_ptr<const io::ByteVector> read_dictionary_page(const uint8_t* data, uint64_t size,
                                                           uint64_t file_offset,
                                                           const ColumnSpec& spec,
                                                           const std::string& path,
                                                           uint64_t* consumed) {
  *consumed = 0;
  check_spec(spec, path, file_offset);
  ColumnSpec entries_spec = spec;  // entries have no levels
  entries_spec.max_definition = 0;
  entries_spec.max_repetition = 0;
  PageContext page{path, spec.name, 0, file_offset};
  PageHeader h = read_header(page, spec, data, size);
  if (h.type != detail::kDictionaryPage) return nullptr;
  if (!h.has_dictionary || h.num_values < 0) page.fail("a dictionary page without its header");
  // Every entry takes a byte of the page at least (four, for byte arrays), so a count
  // the page cannot hold allocates nothing.
  const uint64_t least = spec.type == PhysicalType::kByteArray ? 4
                         : spec.type == PhysicalType::kBoolean ? 0
                                                               : value_width(spec);
  const uint64_t entries = h.num_values;
  if (least > 0 ? entries > h.uncompressed_page_size / least
                : entries > uint64_t(h.uncompressed_page_size) * 8) {
    page.fail("a dictionary of " + std::to_string(entries) + " entries in " +
              std::to_string(h.uncompressed_page_size) + " bytes");
  }
  ColumnDecoder decoder(entries_spec, path, entries, nullptr, 0, file_offset);
  decoder.dictionary_page(h, data + h.header_size);
  *consumed = h.header_size + h.compressed_page_size;
  return std::make_shared<const io::ByteVector>(decoder.finish());
}

namespace {

// What the data pages at [data, data + size) take decompressed (a v2 page's levels
// aside), if the decode may keep them whole: 0 where the values are too small for that
// to pay (ColumnSpec::least_bytes_in_pages), where they would not fit the budget beside the
// rows' offsets and starts (the chunk is copied instead, as any chunk the copying decode
// accepts must decode), or where a header cannot be read (the decode says why).
uint64_t kept_pages_bytes(const uint8_t* data, uint64_t size, uint64_t file_offset,
                          const ColumnSpec& spec, uint64_t rows, const std::string& path) {
  PageContext page{path, spec.name, 0, file_offset};
  uint64_t pos = 0, total = 0;
  try {
    while (pos < size) {
      page.at = file_offset + pos;
      PageHeader h = read_header(page, spec, data + pos, size - pos);
      pos += h.header_size + h.compressed_page_size;
      uint64_t levels = 0;
      if (h.type == detail::kDataPageV2) {
        levels = uint64_t(h.repetition_levels_byte_length) + h.definition_levels_byte_length;
        if (levels > static_cast<uint64_t>(h.uncompressed_page_size)) return 0;
      } else if (h.type != detail::kDataPage) {
        if (h.type == detail::kIndexPage) continue;
        return 0;
      }
      total += h.uncompressed_page_size - levels;  // each at most kMaxPageBytes
      if (total > spec.max_decoded_bytes) return 0;
      ++page.number;
    }
  } catch (const FormatError&) {
    return 0;
  }
  const uint64_t fixed = Output::fixed_bytes(rows, spec.max_definition > 0, true);
  if (rows == 0 || total / rows < spec.least_bytes_in_pages || fixed > spec.max_decoded_bytes ||
      total > spec.max_decoded_bytes - fixed) {
    return 0;
  }
  return total;
}

io::ByteVector decode_pages(const uint8_t* data, uint64_t size, uint64_t file_offset,
                            const ColumnSpec& spec, const io::ByteVector* dictionary, uint64_t rows,
                            const std::string& path, uint64_t first_page,
                            io::ValuesLeft left = io::ValuesLeft::kCopied,
                            const uint8_t* stored = nullptr) {
  check_spec(spec, path, file_offset);
  Dictionary entries;
  if (dictionary != nullptr) entries = dictionary_of(*dictionary, spec, path, file_offset);
  const Dictionary* used = dictionary != nullptr ? &entries : nullptr;
  const uint64_t kept_bytes = left != io::ValuesLeft::kCopied &&
                                      spec.codec != Compression::kUncompressed &&
                                      ColumnDecoder::may_leave(spec, used, rows)
                                  ? kept_pages_bytes(data, size, file_offset, spec, rows, path)
                                  : 0;
  ColumnDecoder decoder(spec, path, rows, used, first_page, file_offset,
                        left == io::ValuesLeft::kInStored ? stored : nullptr, kept_bytes);
  decoder.decode_pages(data, size, file_offset);
  return decoder.finish();
}

}  // namespace

io::ByteVector decode_data_pages(const uint8_t* data, uint64_t size, uint64_t file_offset,
                                 const ColumnSpec& spec, const io::ByteVector* dictionary,
                                 uint64_t rows, const std::string& path) {
  return decode_pages(data, size, file_offset, spec, dictionary, rows, path, 0);
}

io::ByteVector decode_column_chunk(const uint8_t* data, uint64_t size, uint64_t file_offset,
                                   const ColumnSpec& spec, uint64_t rows, const std::string& path,
                                   io::ValuesLeft left) {
  uint64_t consumed = 0;
  std::shared_ptr<const io::ByteVector> dictionary;
  if (size > 0) dictionary = read_dictionary_page(data, size, file_offset, spec, path, &consumed);
  return decode_pages(data + consumed, size - consumed, file_offset + consumed, spec,
                      dictionary.get(), rows, path, dictionary ? 1 : 0, left, data);
}

}  // namespace stoker::format::parquet
