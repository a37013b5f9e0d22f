// TIFF 6.0 and BigTIFF directories. Hostile files are the design case: every
// offset is checked against the file's size before it is followed, every
// count before anything is allocated for it, and a directory is believed only
// once its tiles (strips) are known to lie inside the file and to match its
// image's grid, so that a reader can use them without checking again.
#include "stoker/format/tiff.hpp"

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "stoker/errors.hpp"
#include "stoker/io/posix_file.hpp"

namespace stoker::format {

namespace {

// Far beyond any real file (a whole-slide image has a dozen directories, an
// IFD a few dozen entries), small enough that a file of loops and repeats
// costs little to refuse.
constexpr size_t kMaxDirectories = 4096;
constexpr uint64_t kMaxEntries = 4096;
constexpr int kMaxSubIfdDepth = 8;

enum Tag : uint16_t {
  kNewSubfileType = 254,
  kImageWidth = 256,
  kImageLength = 257,
  kBitsPerSample = 258,
  kCompression = 259,
  kPhotometric = 262,
  kImageDescription = 270,
  kStripOffsets = 273,
  kSamplesPerPixel = 277,
  kRowsPerStrip = 278,
  kStripByteCounts = 279,
  kPlanarConfig = 284,
  kPredictor = 317,
  kTileWidth = 322,
  kTileLength = 323,
  kTileOffsets = 324,
  kTileByteCounts = 325,
  kSubIfds = 330,
  kSampleFormat = 339,
  kJpegTables = 347,
  kYCbCrSubsampling = 530,
};

struct TagName {
  uint16_t tag;
  const char* name;
};

// The tags a directory is read for; every other one is skipped unread.
constexpr TagName kTagsRead[] = {
    {kNewSubfileType, "NewSubfileType"},
    {kImageWidth, "ImageWidth"},
    {kImageLength, "ImageLength"},
    {kBitsPerSample, "BitsPerSample"},
    {kCompression, "Compression"},
    {kPhotometric, "PhotometricInterpretation"},
    {kImageDescription, "ImageDescription"},
    {kStripOffsets, "StripOffsets"},
    {kSamplesPerPixel, "SamplesPerPixel"},
    {kRowsPerStrip, "RowsPerStrip"},
    {kStripByteCounts, "StripByteCounts"},
    {kPlanarConfig, "PlanarConfiguration"},
    {kPredictor, "Predictor"},
    {kTileWidth, "TileWidth"},
    {kTileLength, "TileLength"},
    {kTileOffsets, "TileOffsets"},
    {kTileByteCounts, "TileByteCounts"},
    {kSubIfds, "SubIFDs"},
    {kSampleFormat, "SampleFormat"},
    {kJpegTables, "JPEGTables"},
    {kYCbCrSubsampling, "YCbCrSubSampling"},
};
constexpr size_t kNumTagsRead = sizeof kTagsRead / sizeof kTagsRead[0];

// Its place in kTagsRead, or kNumTagsRead.
size_t tag_slot(uint16_t tag) {
  size_t i = 0;
  while (i < kNumTagsRead && kTagsRead[i].tag != tag) ++i;
  return i;
}

std::string tag_name(uint16_t tag) {
  size_t i = tag_slot(tag);
  return std::string(i < kNumTagsRead ? kTagsRead[i].name : "tag") + " (tag " +
         std::to_string(tag) + ")";
}

// Bytes of one value of each field type (BYTE, ASCII, SHORT, LONG, RATIONAL,
// SBYTE, UNDEFINED, SSHORT, SLONG, SRATIONAL, FLOAT, DOUBLE, IFD, -, -, LONG8,
// SLONG8, IFD8); 0 for types TIFF does not define.
uint64_t type_size(uint16_t type) {
  static constexpr uint8_t kSizes[] = {0, 1, 1, 2, 4, 8, 1, 1, 2, 4, 8, 4, 8, 4, 0, 0, 8, 8, 8};
  return type < sizeof kSizes ? kSizes[type] : 0;
}

// BYTE, SHORT, LONG, IFD, LONG8, IFD8: what sizes, counts and offsets may be.
bool unsigned_integer(uint16_t type) {
  return type == 1 || type == 3 || type == 4 || type == 13 || type == 16 || type == 18;
}

// Tiles (strips) in the grid of a directory whose sizes are all nonzero.
uint64_t chunk_count(const TiffDirectory& d, bool* overflow) {
  uint64_t across = 1, down = 0, n = 0;
  if (d.tile_width != 0) {
    across = (d.width - 1) / d.tile_width + 1;
    down = (d.length - 1) / d.tile_length + 1;
  } else {
    down = (d.length - 1) / d.rows_per_strip + 1;
  }
  bool over = __builtin_mul_overflow(across, down, &n);
  if (d.planar_config == 2) over |= __builtin_mul_overflow(n, d.samples_per_pixel, &n);
  if (overflow != nullptr) *overflow = over;
  return n;
}

struct Entry {
  bool present = false;
  uint16_t tag = 0;
  uint16_t type = 0;
  uint64_t count = 0;
  uint64_t at = 0;        // where the entry is in the file
  uint64_t field_at = 0;  // where its value (or its values' offset) field is
  uint8_t field[8] = {};
};

class Parser {
 public:
  Parser(const TiffRead& read, uint64_t size, const std::string& path)
      : read_(read), size_(size), path_(path) {}

  std::vector<TiffDirectory> parse() {
    if (size_ < 8) {
      fail(0, "not a TIFF file: " + std::to_string(size_) + " bytes, fewer than a TIFF header's 8");
    }
    uint8_t header[16] = {};
    fetch(header, std::min<uint64_t>(size_, sizeof header), 0);
    if (header[0] == 'I' && header[1] == 'I') {
      big_endian_ = false;
    } else if (header[0] == 'M' && header[1] == 'M') {
      big_endian_ = true;
    } else {
      bad_magic(header);
    }
    uint16_t version = u16(header + 2);
    uint64_t first = 0, first_at = 0;
    if (version == 42) {
      first = u32(header + 4);
      first_at = 4;
    } else if (version == 43) {
      big_tiff_ = true;
      if (size_ < 16) {
        fail(0, "BigTIFF header cut off: the file has " + std::to_string(size_) +
                    " bytes, fewer than the header's 16");
      }
      if (u16(header + 4) != 8 || u16(header + 6) != 0) {
        fail(4, "BigTIFF header says offsets are " + std::to_string(u16(header + 4)) +
                    " bytes (then " + std::to_string(u16(header + 6)) +
                    "); BigTIFF's are 8 (then 0)");
      }
      first = u64(header + 8);
      first_at = 8;
    } else {
      bad_magic(header);
    }
    if (first == 0) fail(first_at, "the file has no image directory (its first IFD offset is 0)");

    std::vector<TiffDirectory> out;
    chain(first, first_at, "directory ", 0, /*follow=*/true, out);
    return out;
  }

 private:
  [[noreturn]] void fail(uint64_t offset, const std::string& what) const {
    throw FormatError(path_, offset, what);
  }

  [[noreturn]] void bad_magic(const uint8_t* header) const {
    fail(0, "not a TIFF file: it starts with " +
                quoted(std::string_view(reinterpret_cast<const char*>(header), 4)) +
                ", not II*\\x00 or MM\\x00* (TIFF) or II+\\x00 or MM\\x00+ (BigTIFF)");
  }

  void fetch(uint8_t* dest, uint64_t length, uint64_t offset) const {
    if (length > 0) read_(dest, length, offset);
  }

  uint16_t u16(const uint8_t* p) const {
    return big_endian_ ? static_cast<uint16_t>(p[0] << 8 | p[1])
                       : static_cast<uint16_t>(p[0] | p[1] << 8);
  }
  uint32_t u32(const uint8_t* p) const {
    uint32_t a = u16(p), b = u16(p + 2);
    return big_endian_ ? (a << 16 | b) : (b << 16 | a);
  }
  uint64_t u64(const uint8_t* p) const {
    uint64_t a = u32(p), b = u32(p + 4);
    return big_endian_ ? (a << 32 | b) : (b << 32 | a);
  }
  uint64_t load(const uint8_t* p, uint64_t size) const {
    switch (size) {
      case 1:
        return *p;
      case 2:
        return u16(p);
      case 4:
        return u32(p);
      default:
        return u64(p);
    }
  }
  uint64_t offset_size() const { return big_tiff_ ? 8 : 4; }

  // Reads the chain of IFDs from `first` (whose offset is stored at
  // `first_at`), appending them to `out` as `prefix` 0, 1, ...; with `follow`
  // false, only the first.
  void chain(uint64_t first, uint64_t first_at, const std::string& prefix, int depth, bool follow,
             std::vector<TiffDirectory>& out) {
    uint64_t next = first, next_at = first_at;
    while (next != 0) {
      std::string label = prefix + std::to_string(out.size());
      out.push_back(directory(next, next_at, label, depth, next, next_at));
      if (!follow) break;
    }
  }

  // The IFD at `offset`; `next`, `next_at` become its next IFD offset and where that is stored.
  TiffDirectory directory(uint64_t offset, uint64_t pointer_at, const std::string& label, int depth,
                          uint64_t& next, uint64_t& next_at) {
    if (offset >= size_) {
      fail(pointer_at, label + "'s IFD offset " + std::to_string(offset) +
                           " lies past the end of the file (" + std::to_string(size_) + " bytes)");
    }
    auto [seen, fresh] = visited_.emplace(offset, label);
    if (!fresh) {
      fail(pointer_at, label + "'s IFD offset " + std::to_string(offset) + " is that of " +
                           seen->second + ", already read: the IFD chain loops");
    }
    if (visited_.size() > kMaxDirectories) {
      fail(pointer_at, "more than " + std::to_string(kMaxDirectories) +
                           " image directories: not a TIFF file this reader believes");
    }
    const uint64_t count_size = big_tiff_ ? 8 : 2, entry_size = big_tiff_ ? 20 : 12;
    if (count_size > size_ - offset) {
      fail(offset, label + "'s IFD at offset " + std::to_string(offset) +
                       " is cut off by the end of the file (" + std::to_string(size_) + " bytes)");
    }
    uint8_t count_bytes[8];
    fetch(count_bytes, count_size, offset);
    uint64_t entries = big_tiff_ ? u64(count_bytes) : u16(count_bytes);
    if (entries > kMaxEntries) {
      fail(offset, label + " has " + std::to_string(entries) + " entries, more than the " +
                       std::to_string(kMaxEntries) + " this reader believes of a TIFF directory");
    }
    const uint64_t body = entries * entry_size + offset_size();
    if (body > size_ - offset - count_size) {
      fail(offset, label + "'s " + std::to_string(entries) + " entries at offset " +
                       std::to_string(offset) + " run past the end of the file (" +
                       std::to_string(size_) + " bytes)");
    }
    std::vector<uint8_t> bytes(body);
    fetch(bytes.data(), body, offset + count_size);

    Entry found[kNumTagsRead];
    for (size_t i = 0; i < kNumTagsRead; ++i) found[i].tag = kTagsRead[i].tag;  // messages name it
    for (uint64_t i = 0; i < entries; ++i) {
      const uint8_t* p = bytes.data() + i * entry_size;
      uint16_t tag = u16(p);
      size_t slot = tag_slot(tag);
      if (slot == kNumTagsRead) continue;
      Entry& e = found[slot];
      if (e.present) continue;  // a repeated tag: the first one counts, as in libtiff
      e.present = true;
      e.type = u16(p + 2);
      e.count = big_tiff_ ? u64(p + 4) : u32(p + 4);
      e.at = offset + count_size + i * entry_size;
      e.field_at = e.at + (big_tiff_ ? 12 : 8);
      std::memcpy(e.field, p + (big_tiff_ ? 12 : 8), offset_size());
    }
    next_at = offset + count_size + entries * entry_size;
    next = big_tiff_ ? u64(bytes.data() + entries * entry_size)
                     : u32(bytes.data() + entries * entry_size);
    auto entry = [&](uint16_t tag) -> const Entry& { return found[tag_slot(tag)]; };

    TiffDirectory d;
    d.offset = offset;
    d.big_endian = big_endian_;
    d.big_tiff = big_tiff_;
    const Entry& width = entry(kImageWidth);
    const Entry& length = entry(kImageLength);
    if (!width.present || !length.present) {
      fail(offset, label + " has no " + tag_name(width.present ? kImageLength : kImageWidth));
    }
    d.width = scalar(width, label, 0);
    d.length = scalar(length, label, 0);
    if (d.width == 0 || d.length == 0) {
      fail(d.width == 0 ? width.at : length.at, label + "'s image is " + std::to_string(d.width) +
                                                    " x " + std::to_string(d.length) +
                                                    " pixels: an image has at least one");
    }
    d.samples_per_pixel = scalar(entry(kSamplesPerPixel), label, 1);
    if (d.samples_per_pixel == 0) {
      fail(entry(kSamplesPerPixel).at, label + " has 0 samples per pixel");
    }
    uint64_t pixels = 0, samples = 0;
    if (__builtin_mul_overflow(d.width, d.length, &pixels) ||
        __builtin_mul_overflow(pixels, d.samples_per_pixel, &samples)) {
      fail(width.at, label + "'s image (" + std::to_string(d.width) + " x " +
                         std::to_string(d.length) + " pixels, " +
                         std::to_string(d.samples_per_pixel) +
                         " samples each) is too large to address (over 2^64 samples)");
    }
    d.planar_config = scalar(entry(kPlanarConfig), label, 1);
    if (d.planar_config != 1 && d.planar_config != 2) {
      fail(entry(kPlanarConfig).at, label + "'s planar configuration is " +
                                        std::to_string(d.planar_config) +
                                        ", neither 1 (samples together) nor 2 (separate planes)");
    }

    const bool tiled =
        entry(kTileWidth).present || entry(kTileLength).present || entry(kTileOffsets).present;
    const char* piece = tiled ? "tile" : "strip";
    const Entry& offsets = entry(tiled ? kTileOffsets : kStripOffsets);
    const Entry& counts = entry(tiled ? kTileByteCounts : kStripByteCounts);
    if (tiled) {
      const Entry& tw = entry(kTileWidth);
      const Entry& tl = entry(kTileLength);
      if (!tw.present || !tl.present) {
        fail(offset,
             label + " is tiled but has no " + tag_name(tw.present ? kTileLength : kTileWidth));
      }
      d.tile_width = scalar(tw, label, 0);
      d.tile_length = scalar(tl, label, 0);
      if (d.tile_width == 0 || d.tile_length == 0) {
        fail(d.tile_width == 0 ? tw.at : tl.at,
             label + "'s tiles are " + std::to_string(d.tile_width) + " x " +
                 std::to_string(d.tile_length) + " pixels: a tile has at least one");
      }
    }
    d.rows_per_strip = scalar(entry(kRowsPerStrip), label, d.length);
    if (!tiled && d.rows_per_strip == 0) {
      fail(entry(kRowsPerStrip).at, label + " has 0 rows per strip");
    }
    if (!offsets.present || !counts.present) {
      fail(offset, label + " has no " + tag_name(offsets.present ? counts.tag : offsets.tag) +
                       ": where its image data lies is unknown");
    }
    if (offsets.count != counts.count) {
      fail(counts.at, label + " has " + std::to_string(offsets.count) + " " + piece +
                          " offsets but " + std::to_string(counts.count) + " " + piece +
                          " byte counts");
    }
    // Before reading the arrays: a count that matches no grid allocates nothing.
    const uint64_t needed = chunk_count(d, nullptr);
    if (offsets.count != needed) {
      std::string grid = tiled ? "in " + std::to_string(d.tile_width) + " x " +
                                     std::to_string(d.tile_length) + " tiles"
                               : "in strips of " + std::to_string(d.rows_per_strip) + " rows";
      if (d.planar_config == 2) grid += ", " + std::to_string(d.samples_per_pixel) + " planes";
      fail(offsets.at, label + " has " + std::to_string(offsets.count) + " " + piece +
                           " offsets, but its " + std::to_string(d.width) + " x " +
                           std::to_string(d.length) + " image " + grid + " needs " +
                           std::to_string(needed));
    }
    d.offsets = values(offsets, label, offsets.count);
    d.byte_counts = values(counts, label, counts.count);
    for (uint64_t i = 0; i < d.offsets.size(); ++i) {
      uint64_t at = d.offsets[i], n = d.byte_counts[i];
      if (at > size_ || n > size_ - at) {
        fail(at, std::string(piece) + " " + std::to_string(i) + " of " + label + " (offset " +
                     std::to_string(at) + ", " + std::to_string(n) +
                     " bytes) runs past the end of the file (" + std::to_string(size_) + " bytes)");
      }
    }

    const Entry& bits = entry(kBitsPerSample);
    if (bits.present) {
      d.bits_per_sample = values(bits, label, bits.count);
      if (d.bits_per_sample.empty()) {
        fail(bits.at, label + "'s " + tag_name(kBitsPerSample) + " has no value");
      }
    }
    d.sample_format = scalar(entry(kSampleFormat), label, 1);
    d.compression = scalar(entry(kCompression), label, 1);
    if (entry(kPhotometric).present) d.photometric = scalar(entry(kPhotometric), label, 0);
    d.predictor = scalar(entry(kPredictor), label, 1);
    d.new_subfile_type = scalar(entry(kNewSubfileType), label, 0);
    const Entry& subsampling = entry(kYCbCrSubsampling);
    if (subsampling.present) {
      std::vector<uint64_t> v = values(subsampling, label, 2);
      if (v.size() < 2) {
        fail(subsampling.at, label + "'s " + tag_name(kYCbCrSubsampling) + " has " +
                                 std::to_string(v.size()) + " values, not 2");
      }
      d.ycbcr_subsampling[0] = v[0];
      d.ycbcr_subsampling[1] = v[1];
    }
    if (entry(kJpegTables).present) d.jpeg_tables = raw(entry(kJpegTables), label);
    if (entry(kImageDescription).present) {
      std::vector<uint8_t> text = raw(entry(kImageDescription), label);
      auto end = std::find(text.begin(), text.end(), uint8_t{0});
      d.description.assign(text.begin(), end);
    }

    const Entry& subs = entry(kSubIfds);
    if (subs.present && subs.count > 0) {
      if (depth + 1 > kMaxSubIfdDepth) {
        fail(subs.at,
             label + "'s SubIFDs nest more than " + std::to_string(kMaxSubIfdDepth) + " deep");
      }
      std::vector<uint64_t> children = values(subs, label, subs.count);
      const uint64_t size = type_size(subs.type);
      const uint64_t base = subs.count <= offset_size() / size ? subs.field_at : field_offset(subs);
      // One SubIFD may head a chain of them (TIFF Technical Note 1); several
      // are each one directory, whatever their next-IFD offsets say.
      const bool follow = children.size() == 1;
      for (uint64_t i = 0; i < children.size(); ++i) {
        if (children[i] == 0) continue;  // a slot never filled in
        chain(children[i], base + i * size, label + ", SubIFD ", depth + 1, follow,
              d.sub_directories);
      }
    }
    return d;
  }

  uint64_t field_offset(const Entry& e) const { return big_tiff_ ? u64(e.field) : u32(e.field); }

  // The first `limit` values of an integer entry, as 64-bit numbers.
  std::vector<uint64_t> values(const Entry& e, const std::string& label, uint64_t limit) {
    if (!unsigned_integer(e.type)) {
      fail(e.at, label + "'s " + tag_name(e.tag) + " has field type " + std::to_string(e.type) +
                     ", not one of TIFF's unsigned integer types");
    }
    const uint64_t size = type_size(e.type);
    const uint64_t n = std::min(e.count, limit);
    std::vector<uint8_t> stored = bytes_of(e, label, size, n);
    std::vector<uint64_t> out(n);
    for (uint64_t i = 0; i < n; ++i) out[i] = load(stored.data() + i * size, size);
    return out;
  }

  // The bytes of a BYTE, ASCII or UNDEFINED entry.
  std::vector<uint8_t> raw(const Entry& e, const std::string& label) {
    if (type_size(e.type) != 1) {
      fail(e.at, label + "'s " + tag_name(e.tag) + " has field type " + std::to_string(e.type) +
                     ", not one of bytes");
    }
    return bytes_of(e, label, 1, e.count);
  }

  // The first `n` values (of `size` bytes) of `e`, from the entry itself when
  // all its values fit there, else from the offset it holds, which must hold
  // all of them.
  std::vector<uint8_t> bytes_of(const Entry& e, const std::string& label, uint64_t size,
                                uint64_t n) {
    if (e.count <= offset_size() / size) {
      return std::vector<uint8_t>(e.field, e.field + n * size);
    }
    const uint64_t at = field_offset(e);
    if (at > size_ || e.count > (size_ - at) / size) {
      fail(e.at, label + "'s " + tag_name(e.tag) + ": its " + std::to_string(e.count) +
                     " values at offset " + std::to_string(at) + " run past the end of the file (" +
                     std::to_string(size_) + " bytes)");
    }
    const uint64_t length = n * size;
    // Values shared between directories are legal, but directories that
    // repeat one array over and over are a way to ask for unbounded memory.
    read_bytes_ += length;
    if (read_bytes_ > 2 * size_ + (1u << 20)) {
      fail(e.at, "the directories' values add up to more than twice the file's " +
                     std::to_string(size_) + " bytes: directories repeat one array over and over");
    }
    std::vector<uint8_t> out(length);
    fetch(out.data(), length, at);
    return out;
  }

  // A tag of one integer, its first value if it has more; `absent` if missing.
  uint64_t scalar(const Entry& e, const std::string& label, uint64_t absent) {
    if (!e.present) return absent;
    if (e.count == 0) fail(e.at, label + "'s " + tag_name(e.tag) + " has no value");
    return values(e, label, 1)[0];
  }

  const TiffRead& read_;
  const uint64_t size_;
  const std::string& path_;
  bool big_endian_ = false;
  bool big_tiff_ = false;
  std::unordered_map<uint64_t, std::string> visited_;  // IFD offset -> its label
  uint64_t read_bytes_ = 0;
};

}  // namespace

uint64_t tiff_chunk_count(const TiffDirectory& d, const std::string& path) {
  if (d.width == 0 || d.length == 0 || (d.tile_width != 0 && d.tile_length == 0) ||
      (d.tile_width == 0 && d.rows_per_strip == 0)) {
    throw FormatError(path, d.offset, "a TIFF directory with an empty image or tile has no grid");
  }
  bool overflow = false;
  uint64_t n = chunk_count(d, &overflow);
  if (overflow) {
    throw FormatError(path, d.offset, "the TIFF directory's tile grid has more than 2^64 tiles");
  }
  return n;
}

std::vector<TiffDirectory> parse_tiff(const TiffRead& read, uint64_t file_size,
                                      const std::string& path) {
  return Parser(read, file_size, path).parse();
}

std::vector<TiffDirectory> read_tiff(const std::string& path) {
  io::FileDescriptor fd = io::open_for_read(path);
  const uint64_t size = io::identity_of(fd.get(), path).size;
  TiffRead read = [&](uint8_t* dest, uint64_t length, uint64_t offset) {
    io::pread_exact(fd.get(), path, dest, length, offset);
  };
  return parse_tiff(read, size, path);
}

}  // namespace stoker::format
