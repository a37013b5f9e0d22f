// Parquet's metadata structures, read from Thrift's compact protocol without Thrift.
// A footer is hostile input like any other: every varint, length and count is checked
// against the bytes left before it is believed, fields this reader does not know are
// skipped whatever their type, and structs nest at most kMaxNesting deep.
#include "stoker/format/parquet_thrift.hpp"

#include <cstring>

#include "stoker/errors.hpp"
#include "stoker/format/parquet.hpp"
#include "stoker/util/little_endian.hpp"

namespace stoker::format::parquet {

namespace {

// Thrift's own readers stop at 64; parquet.thrift nests about six deep.
constexpr int kMaxNesting = 64;
constexpr size_t kMaxSchemaDepth = 1000;

// The compact protocol's type codes, as a field header or a collection header holds them.
enum CompactType : uint8_t {
  kStop = 0,
  kTrue = 1,  // a field's type is its value; in a collection, a byte follows
  kFalse = 2,
  kByte = 3,
  kI16 = 4,
  kI32 = 5,
  kI64 = 6,
  kDouble = 7,
  kBinary = 8,
  kList = 9,
  kSet = 10,
  kMap = 11,
  kStruct = 12,
};

class CompactReader {
 public:
  CompactReader(const uint8_t* data, uint64_t size, const std::string& path, uint64_t offset,
                std::string context)
      : data_(data), size_(size), path_(path), offset_(offset), context_(std::move(context)) {}

  [[noreturn]] void fail(const std::string& why) const {
    throw FormatError(path_, offset_ + pos_, context_ + why);
  }

  uint64_t position() const { return pos_; }

  // Calls on_field(id, type) for each field of a struct; a field it returns false for
  // (one it does not read) is skipped.
  template <typename OnField>
  void read_struct(int depth, OnField on_field) {
    if (depth > kMaxNesting)
      fail("structs nest more than " + std::to_string(kMaxNesting) + " deep");
    int64_t last = 0;
    for (;;) {
      uint8_t byte = u8();
      if (byte == kStop) return;
      uint8_t type = byte & 0x0f;
      int64_t id = byte >> 4 ? last + (byte >> 4) : zigzag();
      if (type > kStruct || type == kStop) fail("a field of unknown type " + std::to_string(type));
      if (id < INT16_MIN || id > INT16_MAX) fail("a field id out of range: " + std::to_string(id));
      last = id;
      if (!on_field(static_cast<int16_t>(id), type)) skip(type, depth + 1, false);
    }
  }

  template <typename OnField>
  void read_struct(uint8_t type, const char* label, int depth, OnField on_field) {
    expect(type, kStruct, label, "a struct");
    read_struct(depth, on_field);
  }

  // Calls each() once per element of a list (or set) of `element` types.
  template <typename Each>
  void read_list(uint8_t type, const char* label, uint8_t element, Each each) {
    if (type != kList && type != kSet) expect(type, kList, label, "a list");
    auto [got, count] = collection_header();
    if (count > 0 && got != element && !(integer(got) && integer(element))) {
      fail(std::string(label) + " holds elements of type " + std::to_string(got) +
           ", not of type " + std::to_string(element));
    }
    for (uint64_t i = 0; i < count; ++i) each(got);
  }

  int64_t integer_value(uint8_t type, const char* label, int64_t low, int64_t high) {
    int64_t v = 0;
    if (type == kByte) {
      v = static_cast<int8_t>(u8());
    } else if (integer(type)) {
      v = zigzag();
    } else {
      fail(std::string(label) + " is of type " + std::to_string(type) + ", not an integer");
    }
    if (v < low || v > high)
      fail(std::string(label) + " is " + std::to_string(v) + ", out of range");
    return v;
  }
  int32_t i32(uint8_t type, const char* label) {
    return static_cast<int32_t>(integer_value(type, label, INT32_MIN, INT32_MAX));
  }
  int64_t i64(uint8_t type, const char* label) {
    return integer_value(type, label, INT64_MIN, INT64_MAX);
  }
  // An i64 that a writer leaves out or makes 0 or more: sizes, counts, offsets.
  int64_t count64(uint8_t type, const char* label) {
    return integer_value(type, label, 0, INT64_MAX);
  }
  int32_t count32(uint8_t type, const char* label) {
    return static_cast<int32_t>(integer_value(type, label, 0, INT32_MAX));
  }

  bool boolean(uint8_t type, const char* label) {
    if (type != kTrue && type != kFalse) fail(std::string(label) + " is not a bool");
    return type == kTrue;
  }

  std::string binary(uint8_t type, const char* label) {
    expect(type, kBinary, label, "a string");
    uint64_t n = varint();
    if (n > size_ - pos_)
      fail("cut off: " + std::string(label) + "'s " + std::to_string(n) +
           " bytes run past the end");
    std::string out(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return out;
  }

  // A value of `type` this reader does not read; a bool in a collection is one byte.
  void skip(uint8_t type, int depth, bool in_collection) {
    if (depth > kMaxNesting) fail("values nest more than " + std::to_string(kMaxNesting) + " deep");
    switch (type) {
      case kTrue:
      case kFalse:
        if (in_collection) take(1);
        return;
      case kByte:
        take(1);
        return;
      case kI16:
      case kI32:
      case kI64:
        varint();
        return;
      case kDouble:
        take(8);
        return;
      case kBinary:
        take(varint());
        return;
      case kList:
      case kSet: {
        auto [element, count] = collection_header();
        for (uint64_t i = 0; i < count; ++i) skip(element, depth + 1, true);
        return;
      }
      case kMap: {
        uint64_t count = varint();
        if (count == 0) return;
        uint8_t types = u8();
        // Every key and value takes at least a byte.
        if (count > (size_ - pos_) / 2)
          fail("cut off: a map of " + std::to_string(count) + " entries runs past the end");
        for (uint64_t i = 0; i < count; ++i) {
          skip(types >> 4, depth + 1, true);
          skip(types & 0x0f, depth + 1, true);
        }
        return;
      }
      case kStruct:
        read_struct(depth, [](int16_t, uint8_t) { return false; });
        return;
      default:
        fail("a value of unknown type " + std::to_string(type));
    }
  }

 private:
  static bool integer(uint8_t type) { return type == kI16 || type == kI32 || type == kI64; }

  void expect(uint8_t type, uint8_t want, const char* label, const char* what) const {
    if (type != want)
      fail(std::string(label) + " is of type " + std::to_string(type) + ", not " + what);
  }

  uint8_t u8() {
    if (pos_ >= size_) fail("cut off: the bytes end inside it");
    return data_[pos_++];
  }
  void take(uint64_t n) {
    if (n > size_ - pos_)
      fail("cut off: a value of " + std::to_string(n) + " bytes runs past the end");
    pos_ += n;
  }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b = u8();
      v |= uint64_t(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return v;
    }
    fail("a varint longer than 10 bytes");
  }
  int64_t zigzag() {
    uint64_t v = varint();
    return static_cast<int64_t>(v >> 1) ^ -static_cast<int64_t>(v & 1);
  }
  std::pair<uint8_t, uint64_t> collection_header() {
    uint8_t byte = u8();
    uint64_t count = byte >> 4;
    if (count == 15) count = varint();
    uint8_t element = byte & 0x0f;
    if (element > kStruct || (element == kStop && count > 0)) {
      fail("a list of unknown element type " + std::to_string(element));
    }
    // Every element takes at least a byte, so a count the bytes cannot hold is a lie
    // told before anything is allocated for it.
    if (count > size_ - pos_)
      fail("cut off: a list of " + std::to_string(count) + " elements runs past the end");
    return {element, count};
  }

  const uint8_t* data_;
  uint64_t size_;
  uint64_t pos_ = 0;
  const std::string& path_;
  uint64_t offset_;
  std::string context_;
};

// Names of LogicalType's union members, by field id; null where the contract names none.
const char* logical_type_name(int16_t id) {
  static constexpr const char* kNames[] = {
      nullptr,     "STRING", "MAP",     "LIST",    "ENUM", "DECIMAL", "DATE", "TIME",
      "TIMESTAMP", nullptr,  "INTEGER", "UNKNOWN", "JSON", "BSON",    "UUID", "FLOAT16"};
  return id >= 0 && id < 16 ? kNames[id] : nullptr;
}

// TimeType and TimestampType: isAdjustedToUTC, then the unit (a union of empty structs).
void read_time(CompactReader& r, uint8_t type, int depth, SchemaElement& e) {
  r.read_struct(type, "a time type", depth, [&](int16_t id, uint8_t t) {
    if (id == 1) {
      e.adjusted_to_utc = r.boolean(t, "isAdjustedToUTC");
      return true;
    }
    if (id != 2) return false;
    r.read_struct(t, "TimeUnit", depth + 1, [&](int16_t unit, uint8_t) {
      static constexpr const char* kUnits[] = {"", "MILLIS", "MICROS", "NANOS"};
      if (unit >= 1 && unit <= 3) e.time_unit = kUnits[unit];
      return false;
    });
    return true;
  });
}

void read_logical_type(CompactReader& r, uint8_t type, int depth, SchemaElement& e) {
  r.read_struct(type, "LogicalType", depth, [&](int16_t id, uint8_t t) {
    const char* name = logical_type_name(id);
    if (name == nullptr) return false;
    e.logical_type = name;
    if (id == 5) {  // DecimalType
      r.read_struct(t, "DecimalType", depth + 1, [&](int16_t f, uint8_t ft) {
        if (f == 1) e.scale = r.i32(ft, "DecimalType.scale");
        if (f == 2) e.precision = r.i32(ft, "DecimalType.precision");
        return f == 1 || f == 2;
      });
    } else if (id == 7 || id == 8) {
      read_time(r, t, depth + 1, e);
    } else if (id == 10) {  // IntType
      r.read_struct(t, "IntType", depth + 1, [&](int16_t f, uint8_t ft) {
        if (f == 1) e.int_bit_width = r.i32(ft, "IntType.bitWidth");
        if (f == 2) e.int_signed = r.boolean(ft, "IntType.isSigned");
        return f == 1 || f == 2;
      });
    } else {
      r.skip(t, depth + 1, false);
    }
    return true;
  });
}

SchemaElement read_schema_element(CompactReader& r, uint8_t type, int depth) {
  SchemaElement e;
  bool named = false;
  r.read_struct(type, "SchemaElement", depth, [&](int16_t id, uint8_t t) {
    switch (id) {
      case 1:
        e.type = r.integer_value(t, "SchemaElement.type", 0, 7);
        return true;
      case 2:
        e.type_length = r.i32(t, "SchemaElement.type_length");
        return true;
      case 3:
        e.repetition = r.integer_value(t, "SchemaElement.repetition_type", 0, 2);
        return true;
      case 4:
        e.name = r.binary(t, "SchemaElement.name");
        named = true;
        return true;
      case 5:
        e.num_children = r.count32(t, "SchemaElement.num_children");
        return true;
      case 6:
        e.converted_type = r.i32(t, "SchemaElement.converted_type");
        return true;
      case 7:
        e.scale = r.i32(t, "SchemaElement.scale");
        return true;
      case 8:
        e.precision = r.i32(t, "SchemaElement.precision");
        return true;
      case 10:
        read_logical_type(r, t, depth + 1, e);
        return true;
    }
    return false;
  });
  if (!named) r.fail("a SchemaElement without a name");
  return e;
}

void read_column_meta_data(CompactReader& r, uint8_t type, int depth, ColumnChunkMeta& c) {
  bool typed = false, placed = false;
  r.read_struct(type, "ColumnMetaData", depth, [&](int16_t id, uint8_t t) {
    switch (id) {
      case 1:
        c.type = r.integer_value(t, "ColumnMetaData.type", 0, 7);
        typed = true;
        return true;
      case 2:
        r.read_list(t, "ColumnMetaData.encodings", kI32,
                    [&](uint8_t et) { c.encodings.push_back(r.i32(et, "an encoding")); });
        return true;
      case 3:
        r.read_list(t, "ColumnMetaData.path_in_schema", kBinary,
                    [&](uint8_t et) { c.path.push_back(r.binary(et, "a path_in_schema name")); });
        return true;
      case 4:
        c.codec = static_cast<Compression>(r.integer_value(t, "ColumnMetaData.codec", 0, 255));
        return true;
      case 5:
        c.num_values = r.count64(t, "ColumnMetaData.num_values");
        return true;
      case 6:
        c.total_uncompressed_size = r.count64(t, "ColumnMetaData.total_uncompressed_size");
        return true;
      case 7:
        c.total_compressed_size = r.count64(t, "ColumnMetaData.total_compressed_size");
        return true;
      case 9:
        c.data_page_offset = r.count64(t, "ColumnMetaData.data_page_offset");
        placed = true;
        return true;
      case 11:
        c.dictionary_page_offset = r.count64(t, "ColumnMetaData.dictionary_page_offset");
        return true;
    }
    return false;
  });
  if (!typed || !placed)
    r.fail(std::string("a ColumnMetaData without its ") + (typed ? "data_page_offset" : "type"));
}

ColumnChunkMeta read_column_chunk(CompactReader& r, uint8_t type, int depth) {
  ColumnChunkMeta c;
  bool described = false;
  r.read_struct(type, "ColumnChunk", depth, [&](int16_t id, uint8_t t) {
    switch (id) {
      case 1:
        c.file_path = r.binary(t, "ColumnChunk.file_path");
        return true;
      case 3:
        read_column_meta_data(r, t, depth + 1, c);
        described = true;
        return true;
      case 4:
        c.offset_index_offset = r.count64(t, "ColumnChunk.offset_index_offset");
        return true;
      case 5:
        c.offset_index_length = r.count32(t, "ColumnChunk.offset_index_length");
        return true;
      case 6:
        c.column_index_offset = r.count64(t, "ColumnChunk.column_index_offset");
        return true;
      case 7:
        c.column_index_length = r.count32(t, "ColumnChunk.column_index_length");
        return true;
      case 8:
      case 9:
        c.encrypted = true;
        return false;
    }
    return false;
  });
  if (!described && !c.encrypted) r.fail("a ColumnChunk without its ColumnMetaData");
  return c;
}

RowGroupMeta read_row_group(CompactReader& r, uint8_t type, int depth) {
  RowGroupMeta g;
  bool has_columns = false, counted = false;
  r.read_struct(type, "RowGroup", depth, [&](int16_t id, uint8_t t) {
    switch (id) {
      case 1:
        r.read_list(t, "RowGroup.columns", kStruct,
                    [&](uint8_t et) { g.columns.push_back(read_column_chunk(r, et, depth + 1)); });
        has_columns = true;
        return true;
      case 2:
        g.total_byte_size = r.count64(t, "RowGroup.total_byte_size");
        return true;
      case 3:
        g.num_rows = r.count64(t, "RowGroup.num_rows");
        counted = true;
        return true;
    }
    return false;
  });
  if (!has_columns || !counted)
    r.fail(std::string("a RowGroup without its ") + (counted ? "columns" : "num_rows"));
  return g;
}

// A list<KeyValue>: key required, value optional.
void read_key_values(CompactReader& r, uint8_t type, int depth,
                     std::vector<std::pair<std::string, std::string>>& out) {
  r.read_list(type, "key_value_metadata", kStruct, [&](uint8_t et) {
    std::pair<std::string, std::string> kv;
    bool keyed = false;
    r.read_struct(et, "KeyValue", depth + 1, [&](int16_t id, uint8_t t) {
      if (id == 1) {
        kv.first = r.binary(t, "KeyValue.key");
        keyed = true;
      } else if (id == 2) {
        kv.second = r.binary(t, "KeyValue.value");
      }
      return id == 1 || id == 2;
    });
    if (!keyed) r.fail("a KeyValue without its key");
    out.push_back(std::move(kv));
  });
}

}  // namespace

FileMetaData parse_file_metadata(const uint8_t* data, uint64_t size, const std::string& path,
                                 uint64_t offset) {
  CompactReader r(data, size, path, offset, "the Parquet footer (FileMetaData): ");
  FileMetaData m;
  unsigned seen = 0;
  r.read_struct(0, [&](int16_t id, uint8_t t) {
    switch (id) {
      case 1:
        m.version = r.i32(t, "version");
        break;
      case 2:
        r.read_list(t, "schema", kStruct,
                    [&](uint8_t et) { m.schema.push_back(read_schema_element(r, et, 1)); });
        break;
      case 3:
        m.num_rows = r.count64(t, "num_rows");
        break;
      case 4:
        r.read_list(t, "row_groups", kStruct,
                    [&](uint8_t et) { m.row_groups.push_back(read_row_group(r, et, 1)); });
        break;
      case 5:
        read_key_values(r, t, 1, m.key_value);
        break;
      case 6:
        m.created_by = r.binary(t, "created_by");
        break;
      case 8:
        m.encrypted = true;
        return false;
      default:
        return false;
    }
    seen |= 1u << id;
    return true;
  });
  static constexpr const char* kRequired[] = {nullptr, "version", "schema", "num_rows",
                                              "row_groups"};
  for (int id = 1; id <= 4; ++id) {
    if (!(seen & (1u << id))) r.fail(std::string("no ") + kRequired[id] + " field");
  }
  return m;
}

FooterSpan locate_footer(const uint8_t* tail, uint64_t tail_size, uint64_t file_size,
                         const std::string& path) {
  if (tail_size > file_size) throw Error("locate_footer: a tail longer than the file");
  if (file_size < 12) {
    throw FormatError(path, 0,
                      "not a Parquet file: " + std::to_string(file_size) +
                          " bytes, fewer than the 12 of PAR1, a footer length and PAR1");
  }
  if (tail_size < 8) throw Error("locate_footer: the tail must hold the file's last 8 bytes");
  const uint8_t* magic = tail + tail_size - 4;
  if (std::memcmp(magic, "PARE", 4) == 0) {
    throw FormatError(path, file_size - 4,
                      "an encrypted Parquet file (its footer ends with PARE): stoker does not "
                      "decrypt Parquet; decrypt it with pyarrow (pq.read_table(..., "
                      "decryption_properties=...)) and write it again without encryption");
  }
  if (std::memcmp(magic, "PAR1", 4) != 0) {
    throw FormatError(path, file_size - 4,
                      "not a Parquet file: it ends with " +
                          quoted(std::string_view(reinterpret_cast<const char*>(magic), 4)) +
                          ", not PAR1 (a file cut off, or another format)");
  }
  if (tail_size == file_size && std::memcmp(tail, "PAR1", 4) != 0) {
    throw FormatError(path, 0,
                      "not a Parquet file: it starts with " +
                          quoted(std::string_view(reinterpret_cast<const char*>(tail), 4)) +
                          ", not PAR1");
  }
  uint64_t length = util::le32(tail + tail_size - 8);
  if (length > file_size - 12) {
    throw FormatError(path, file_size - 8,
                      "the Parquet footer length is " + std::to_string(length) +
                          " bytes, more than the file's " + std::to_string(file_size) +
                          " bytes hold before it: the file is cut off or damaged");
  }
  return {file_size - 8 - length, length};
}

std::vector<PageLocation> parse_offset_index(const uint8_t* data, uint64_t size,
                                             const std::string& path, uint64_t offset) {
  CompactReader r(data, size, path, offset, "a Parquet offset index: ");
  std::vector<PageLocation> out;
  bool listed = false;
  r.read_struct(0, [&](int16_t id, uint8_t t) {
    if (id != 1) return false;
    listed = true;
    r.read_list(t, "page_locations", kStruct, [&](uint8_t et) {
      PageLocation p{-1, -1, -1};
      r.read_struct(et, "PageLocation", 1, [&](int16_t f, uint8_t ft) {
        if (f == 1) p.offset = r.count64(ft, "PageLocation.offset");
        if (f == 2) p.compressed_page_size = r.count32(ft, "PageLocation.compressed_page_size");
        if (f == 3) p.first_row_index = r.count64(ft, "PageLocation.first_row_index");
        return f >= 1 && f <= 3;
      });
      if (p.offset < 0 || p.compressed_page_size < 0 || p.first_row_index < 0) {
        r.fail("a PageLocation without its offset, compressed_page_size or first_row_index");
      }
      out.push_back(p);
    });
    return true;
  });
  if (!listed) r.fail("no page_locations field");
  return out;
}

std::vector<LeafColumn> leaf_columns(const FileMetaData& metadata, const std::string& path,
                                     uint64_t offset) {
  auto fail = [&](const std::string& why) {
    return FormatError(path, offset, "the Parquet footer's schema: " + why);
  };
  const auto& schema = metadata.schema;
  if (schema.empty()) throw fail("it is empty");
  // Groups still open, innermost last: children left, and the levels below the group.
  struct Open {
    int32_t children;
    int16_t definition, repetition, repeated_definition;
    std::vector<std::string> path;
  };
  std::vector<Open> open{{schema[0].num_children, 0, 0, -1, {}}};
  std::vector<LeafColumn> out;
  size_t next = 1;
  while (!open.empty()) {
    if (open.back().children == 0) {
      open.pop_back();
      continue;
    }
    --open.back().children;
    if (next >= schema.size()) {
      throw fail("its groups have more children than its " + std::to_string(schema.size()) +
                 " elements");
    }
    const SchemaElement& e = schema[next];
    Open level = open.back();
    level.path.push_back(e.name);
    if (e.repetition != 0) {
      if (level.definition == INT16_MAX) throw fail("definition levels past 32767");
      ++level.definition;
    }
    if (e.repetition == 2) {
      ++level.repetition;
      level.repeated_definition = level.definition;
    }
    if (e.type < 0) {
      if (open.size() >= kMaxSchemaDepth) {
        throw fail("groups nest more than " + std::to_string(kMaxSchemaDepth) + " deep");
      }
      level.children = e.num_children;
      open.push_back(std::move(level));
    } else {
      if (e.num_children != 0) throw fail("element " + quoted(e.name) + " has a type and children");
      LeafColumn leaf;
      leaf.schema_index = static_cast<int32_t>(next);
      leaf.spec.type = static_cast<PhysicalType>(e.type);
      leaf.spec.type_length = e.type_length;
      leaf.spec.max_definition = level.definition;
      leaf.spec.max_repetition = level.repetition;
      leaf.spec.repeated_definition = level.repeated_definition;
      leaf.spec.name = "column ";
      for (size_t i = 0; i < level.path.size(); ++i) {
        leaf.spec.name += (i ? "." : "") + level.path[i];
      }
      leaf.path = std::move(level.path);
      out.push_back(std::move(leaf));
    }
    ++next;
  }
  if (next != schema.size()) {
    throw fail("it has " + std::to_string(schema.size()) + " elements, but its tree holds " +
               std::to_string(next));
  }
  return out;
}

namespace {

detail::PageHeader page_header(const uint8_t* data, uint64_t size, const std::string& path,
                               uint64_t offset, const std::string& context) {
  CompactReader r(data, size, path, offset, context + "its page header: ");
  detail::PageHeader h;
  r.read_struct(0, [&](int16_t id, uint8_t t) {
    switch (id) {
      case 1:
        h.type = r.i32(t, "PageHeader.type");
        return true;
      case 2:
        h.uncompressed_page_size = r.count32(t, "PageHeader.uncompressed_page_size");
        return true;
      case 3:
        h.compressed_page_size = r.count32(t, "PageHeader.compressed_page_size");
        return true;
      case 5:
        h.has_data_v1 = true;
        r.read_struct(t, "DataPageHeader", 1, [&](int16_t f, uint8_t ft) {
          switch (f) {
            case 1:
              h.num_values = r.count32(ft, "DataPageHeader.num_values");
              return true;
            case 2:
              h.encoding = r.i32(ft, "DataPageHeader.encoding");
              return true;
            case 3:
              h.definition_level_encoding = r.i32(ft, "DataPageHeader.definition_level_encoding");
              return true;
            case 4:
              h.repetition_level_encoding = r.i32(ft, "DataPageHeader.repetition_level_encoding");
              return true;
          }
          return false;
        });
        return true;
      case 7:
        h.has_dictionary = true;
        r.read_struct(t, "DictionaryPageHeader", 1, [&](int16_t f, uint8_t ft) {
          if (f == 1) h.num_values = r.count32(ft, "DictionaryPageHeader.num_values");
          if (f == 2) h.encoding = r.i32(ft, "DictionaryPageHeader.encoding");
          return f == 1 || f == 2;
        });
        return true;
      case 8:
        h.has_data_v2 = true;
        r.read_struct(t, "DataPageHeaderV2", 1, [&](int16_t f, uint8_t ft) {
          switch (f) {
            case 1:
              h.num_values = r.count32(ft, "DataPageHeaderV2.num_values");
              return true;
            case 2:
              h.num_nulls = r.count32(ft, "DataPageHeaderV2.num_nulls");
              return true;
            case 3:
              h.num_rows = r.count32(ft, "DataPageHeaderV2.num_rows");
              return true;
            case 4:
              h.encoding = r.i32(ft, "DataPageHeaderV2.encoding");
              return true;
            case 5:
              h.definition_levels_byte_length =
                  r.count32(ft, "DataPageHeaderV2.definition_levels_byte_length");
              return true;
            case 6:
              h.repetition_levels_byte_length =
                  r.count32(ft, "DataPageHeaderV2.repetition_levels_byte_length");
              return true;
            case 7:
              h.is_compressed = r.boolean(ft, "DataPageHeaderV2.is_compressed");
              return true;
          }
          return false;
        });
        return true;
    }
    return false;
  });
  if (h.type < 0 || h.uncompressed_page_size < 0 || h.compressed_page_size < 0) {
    r.fail("no type, uncompressed_page_size or compressed_page_size");
  }
  h.header_size = r.position();
  return h;
}

}  // namespace

namespace detail {

PageHeader parse_page_header(const uint8_t* data, uint64_t size, const std::string& path,
                             uint64_t offset, const std::string& context) {
  // Errors name the header's own offset, as every page error does, and the byte in it.
  try {
    return page_header(data, size, path, offset, context);
  } catch (const FormatError& e) {
    throw FormatError(
        path, offset,
        e.detail() + " (at byte " + std::to_string(e.offset() - offset) + " of the header)");
  }
}

}  // namespace detail

}  // namespace stoker::format::parquet
