// Shards of records with an offset table: MosaicML Streaming's MDS shards and
// LitData's chunks. Both start with a little-endian uint32 record count n and
// n + 1 uint32 absolute offsets (record k is [offs[k], offs[k+1]), the last
// offset the file's size). A record is a prefix of uint32 sizes (MDS: one per
// variable-size column; LitData: one per leaf) and then each column's bytes in
// column order. The columns come from the peer's index.json, read in Python,
// and reach here in the format string:
//   "mds|name:size|name:v|..."  or  "litdata|name:v:numpy|name:8|..."
// (size: a fixed byte count, or v for variable; a third part, numpy or tensor,
// says the column's bytes start with a header to step over, so that a member
// is the array's values alone).
#include <cstring>

#include "stoker/errors.hpp"
#include "stoker/format/shard_index.hpp"
#include "stoker/util/little_endian.hpp"

namespace stoker::format {

namespace {

constexpr uint64_t kVariable = UINT64_MAX;

enum class Header : uint8_t { kNone, kNumpy, kTensor };

struct Column {
  std::string name;
  uint64_t size = kVariable;
  Header header = Header::kNone;
};

struct RecordLayout {
  bool every_column_sized = false;  // LitData: a size for every leaf
  std::vector<Column> columns;
  size_t prefixed() const {
    if (every_column_sized) return columns.size();
    size_t n = 0;
    for (const auto& c : columns) n += c.size == kVariable;
    return n;
  }
};

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  size_t at = 0;
  for (;;) {
    size_t next = text.find(sep, at);
    out.push_back(text.substr(at, next == std::string::npos ? std::string::npos : next - at));
    if (next == std::string::npos) return out;
    at = next + 1;
  }
}

RecordLayout parse_layout(const std::string& path, const std::string& format) {
  auto parts = split(format, '|');
  RecordLayout layout;
  layout.every_column_sized = parts[0] == "litdata";
  for (size_t i = 1; i < parts.size(); ++i) {
    auto fields = split(parts[i], ':');
    if (fields.size() < 2 || fields.size() > 3 || fields[0].empty()) {
      throw FormatError(path, 0, "bad column in the record format " + quoted(parts[i]));
    }
    Column c;
    c.name = fields[0];
    if (fields[1] != "v") {
      try {
        c.size = std::stoull(fields[1]);
      } catch (const std::exception&) {
        throw FormatError(path, 0, "bad column size in " + quoted(parts[i]));
      }
    }
    if (fields.size() == 3) {
      if (fields[2] == "numpy") {
        c.header = Header::kNumpy;
      } else if (fields[2] == "tensor") {
        c.header = Header::kTensor;
      } else {
        throw FormatError(path, 0, "bad column header kind in " + quoted(parts[i]));
      }
    }
    layout.columns.push_back(std::move(c));
  }
  if (layout.columns.empty() || layout.columns.size() > UINT16_MAX) {
    throw FormatError(path, 0, "a record format needs 1 to 65535 columns");
  }
  return layout;
}

uint32_t u32(const uint8_t* p, bool big_endian = false) {
  return big_endian ? uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]
                    : util::le32(p);
}

// The bytes of an array header at `at` (LitData's numpy: LE dtype, ndim, dims;
// tensor: the same big-endian), checked to fit the column's `length`.
uint64_t array_header(WindowReader& in, uint64_t at, uint64_t length, Header kind,
                      const std::string& column) {
  if (length < 8) {
    throw FormatError(in.path(), at,
                      "column " + quoted(column) + ": too short for its array header");
  }
  const uint8_t* h = in.at(at, 8, "an array header");
  uint32_t ndim = u32(h + 4, kind == Header::kTensor);
  if (ndim > 32 || 8 + 4ull * ndim > length) {
    throw FormatError(in.path(), at,
                      "column " + quoted(column) + ": an array header of " + std::to_string(ndim) +
                          " dimensions does not fit its " + std::to_string(length) + " bytes");
  }
  return 8 + 4ull * ndim;
}

}  // namespace

ShardIndex index_records(WindowReader& in, const std::string& format) {
  const std::string& path = in.path();
  RecordLayout layout = parse_layout(path, format);
  ShardIndex index(split(format, '|')[0], in.identity());
  const uint64_t size = in.size();
  const uint32_t n = util::le32(in.at(0, 4, "the record count"));
  const uint64_t table = 4 + 4ull * (uint64_t(n) + 1);
  if (table > size) {
    throw FormatError(path, 0,
                      "says it holds " + std::to_string(n) + " records, but its " +
                          std::to_string(size) + " bytes cannot hold their offset table");
  }
  std::vector<uint32_t> offs(n + 1);
  {
    const uint8_t* p = in.at(4, table - 4, "the record offset table");
    for (uint32_t k = 0; k <= n; ++k) offs[k] = util::le32(p + 4ull * k);
  }
  if (offs[0] < table) {
    throw FormatError(path, 4,
                      "the first record starts at " + std::to_string(offs[0]) +
                          ", inside the offset table that ends at " + std::to_string(table));
  }
  for (uint32_t k = 0; k < n; ++k) {
    if (offs[k + 1] < offs[k]) {
      throw FormatError(path, 4 + 4ull * (k + 1),
                        "record " + std::to_string(k + 1) + " starts at " +
                            std::to_string(offs[k + 1]) + ", before record " + std::to_string(k) +
                            " (" + std::to_string(offs[k]) + ")");
    }
  }
  if (offs[n] != size) {
    throw FormatError(path, 4 + 4ull * n,
                      "the records end at " + std::to_string(offs[n]) + " but the file has " +
                          std::to_string(size) +
                          " bytes (truncated, or written in a form stoker does not read)");
  }
  const size_t columns = layout.columns.size();
  const size_t prefixed = layout.prefixed();
  for (const auto& c : layout.columns) index.field_names.push_back(c.name);
  index.keys.reserve(n);
  index.sample_start.reserve(n + 1);
  // Records all of one size with at most one column of varying size lay every
  // column at the same place: the first record's prefix (and headers) say
  // where, and no other record needs reading.
  bool uniform = n > 0;
  for (uint32_t k = 1; k < n && uniform; ++k) {
    uniform = offs[k + 1] - offs[k] == offs[1] - offs[0];
  }
  size_t variable = 0;
  for (const auto& c : layout.columns) variable += c.size == kVariable || c.header != Header::kNone;
  uniform = uniform && variable <= 1;
  std::vector<uint64_t> place(columns), length(columns);
  std::vector<uint64_t> sizes(columns);
  for (uint32_t k = 0; k < n; ++k) {
    const uint64_t start = offs[k], end = offs[k + 1], record = end - start;
    if (!uniform || k == 0) {
      if (record < 4ull * prefixed) {
        throw FormatError(path, start,
                          "record " + std::to_string(k) + " of " + std::to_string(record) +
                              " bytes is shorter than its " + std::to_string(4 * prefixed) +
                              "-byte size prefix");
      }
      const uint8_t* prefix = prefixed ? in.at(start, 4 * prefixed, "a record's sizes") : nullptr;
      size_t next = 0;
      for (size_t c = 0; c < columns; ++c) {
        const Column& col = layout.columns[c];
        bool sized = layout.every_column_sized || col.size == kVariable;
        sizes[c] = sized ? util::le32(prefix + 4 * next++) : col.size;
        if (col.size != kVariable && sizes[c] != col.size) {
          throw FormatError(path, start,
                            "record " + std::to_string(k) + ": column " + quoted(col.name) +
                                " holds " + std::to_string(sizes[c]) + " bytes, but its type is " +
                                std::to_string(col.size));
        }
      }
      uint64_t at = start + 4 * prefixed;
      for (size_t c = 0; c < columns; ++c) {
        if (sizes[c] > end - at) {
          throw FormatError(path, start,
                            "record " + std::to_string(k) + ": column " +
                                quoted(layout.columns[c].name) + " of " + std::to_string(sizes[c]) +
                                " bytes runs past the record's end (" + std::to_string(end) + ")");
        }
        uint64_t skip =
            layout.columns[c].header == Header::kNone
                ? 0
                : array_header(in, at, sizes[c], layout.columns[c].header, layout.columns[c].name);
        place[c] = at + skip - start;
        length[c] = sizes[c] - skip;
        at += sizes[c];
      }
      if (at != end) {
        throw FormatError(path, start,
                          "record " + std::to_string(k) + ": its columns take " +
                              std::to_string(at - start) + " of its " + std::to_string(record) +
                              " bytes");
      }
    }
    index.keys.push_back(std::to_string(k));
    for (size_t c = 0; c < columns; ++c) {
      index.member_field.push_back(static_cast<uint16_t>(c));
      index.member_offset.push_back(start + place[c]);
      index.member_length.push_back(length[c]);
      index.member_out_length.push_back(length[c]);
      index.member_codec.push_back(static_cast<uint8_t>(io::Codec::kStored));
      index.member_crc.push_back(0);
    }
    index.sample_start.push_back(static_cast<uint32_t>(index.member_field.size()));
  }
  index.key_runs = n;
  return index;
}

bool is_record_format(const std::string& format) {
  return format.rfind("mds|", 0) == 0 || format.rfind("litdata|", 0) == 0;
}

}  // namespace stoker::format
