// Parquet without Arrow: the footer (FileMetaData, Thrift's compact protocol read by
// our own reader), the offset index, and the pages of one column chunk decoded into
// one byte buffer per run of rows, so that the reader can cache decoded chunks and
// copy rows out of them as it copies any other member's bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "stoker/io/byte_vector.hpp"
#include "stoker/io/column_layout.hpp"
#include "stoker/io/posix_file.hpp"
namespace stoker::format::parquet {

enum class PhysicalType : uint8_t {
  kBoolean = 0,
  kInt32 = 1,
  kInt64 = 2,
  kInt96 = 3,
  kFloat = 4,
  kDouble = 5,
  kByteArray = 6,
  kFixedLenByteArray = 7
};
enum class Compression : uint8_t {
  kUncompressed = 0,
  kSnappy = 1,
  kGzip = 2,
  kLzo = 3,
  kBrotli = 4,
  kLz4 = 5,
  kZstd = 6,
  kLz4Raw = 7
};

// -- the footer ---------------------------------------------------------------------

struct SchemaElement {
  std::string name;
  int32_t type = -1;  // a PhysicalType; -1: a group
  int32_t type_length = 0;
  int32_t repetition = 0;  // 0 required, 1 optional, 2 repeated
  int32_t num_children = 0;
  int32_t converted_type = -1;
  int32_t scale = 0, precision = 0;
  // "STRING", "MAP", "LIST", "ENUM", "DECIMAL", "DATE", "TIME", "TIMESTAMP", "INTEGER",
  // "UNKNOWN", "JSON", "BSON", "UUID", "FLOAT16", or "" (none, or one newer than these).
  std::string logical_type;
  int32_t int_bit_width = 0;  // INTEGER
  bool int_signed = true;     // INTEGER
  std::string time_unit;      // TIME, TIMESTAMP: "MILLIS", "MICROS" or "NANOS"
  bool adjusted_to_utc = false;
};

struct ColumnChunkMeta {
  std::vector<std::string> path;
  int32_t type = -1;
  Compression codec = Compression::kUncompressed;
  std::vector<int32_t> encodings;
  int64_t num_values = 0;
  int64_t total_uncompressed_size = 0, total_compressed_size = 0;
  int64_t data_page_offset = -1;
  int64_t dictionary_page_offset = -1;
  int64_t offset_index_offset = -1;
  int32_t offset_index_length = 0;
  int64_t column_index_offset = -1;
  int32_t column_index_length = 0;
  std::string file_path;   // set: the chunk lies in another file
  bool encrypted = false;  // crypto_metadata (or encrypted metadata) present
};

struct RowGroupMeta {
  int64_t num_rows = 0;
  int64_t total_byte_size = 0;
  std::vector<ColumnChunkMeta> columns;
};

struct FileMetaData {
  int32_t version = 0;
  int64_t num_rows = 0;
  std::vector<SchemaElement> schema;
  std::vector<RowGroupMeta> row_groups;
  std::vector<std::pair<std::string, std::string>> key_value;
  std::string created_by;
  bool encrypted = false;  // encryption_algorithm set
};

// The FileMetaData in `size` bytes at `data`, which lie at file offset `offset`
// (for messages). FormatError for anything it cannot read.
FileMetaData parse_file_metadata(const uint8_t* data, uint64_t size, const std::string& path,
                                 uint64_t offset);

// Where the FileMetaData lies, from the last `tail_size` bytes of a file of
// `file_size` (the whole file when they are equal, and then its leading "PAR1" is
// checked too). FormatError for a file too short, a wrong magic, an encrypted
// footer ("PARE"), or a footer length larger than the file.
struct FooterSpan {
  uint64_t offset, size;
};
FooterSpan locate_footer(const uint8_t* tail, uint64_t tail_size, uint64_t file_size,
                         const std::string& path);

// What opening a dataset of many files needs of each before a batch reads it: its rows,
// its row groups' rows, the file as it was read, and a key that is equal for files whose
// columns read alike (the schema, and each column's codecs and encodings: what decides
// which columns can be read), so that one file's full reading stands for the others'
// until each is read. Reads the file's last `tail` bytes, and the footer if they did not
// hold it; errors as locate_footer and parse_file_metadata.
struct FileSummary {
  int64_t rows = 0;
  std::vector<int64_t> group_rows;
  io::FileIdentity identity;
  uint64_t columns_key = 0;
};
FileSummary summarize_file(const std::string& path, uint64_t tail = 64 * 1024);

struct PageLocation {
  int64_t offset;
  int32_t compressed_page_size;
  int64_t first_row_index;
};
std::vector<PageLocation> parse_offset_index(const uint8_t* data, uint64_t size,
                                             const std::string& path, uint64_t offset);

// -- pages --------------------------------------------------------------------------

// What one decode may produce in all (offsets, nulls and values) unless the caller
// sets another bound: a hostile page can ask for terabytes in a few bytes of runs.
constexpr uint64_t kMaxDecodedBytes = 4ull << 30;
// Byte strings of fewer bytes a row than this, on average, are copied out of their
// decompressed pages (see decode_column_chunk): keeping the pages costs a start and the
// 4-byte length a value, and the copy of a short string is cheap.
constexpr uint64_t kLeastBytesInPages = 128;

// What decoding one column chunk's pages needs.
struct ColumnSpec {
  PhysicalType type = PhysicalType::kByteArray;
  int32_t type_length = 0;  // kFixedLenByteArray
  int16_t max_definition = 0;
  int16_t max_repetition = 0;  // 0, or 1: a list of primitives (more is refused, by name)
  // max_repetition 1: the definition level at which the repeated field holds an element
  // (one above it: an empty list, below: a null list); -1: max_definition - 1, a list of
  // nullable elements as pyarrow writes them. leaf_columns() says what a schema has.
  int16_t repeated_definition = -1;
  Compression codec = Compression::kUncompressed;
  std::string name;  // e.g. "row group 3, column image.bytes": put into every message
  uint64_t max_decoded_bytes = kMaxDecodedBytes;
  uint64_t least_bytes_in_pages = kLeastBytesInPages;
};

// A leaf column of the schema, in the order of each row group's column chunks, with
// its levels worked out from the repetition of every field on its path (codec is left
// uncompressed and name is "column a.b.c": both are the caller's to set per chunk).
// FormatError (at `offset`, the footer's) for a schema whose tree does not add up.
struct LeafColumn {
  std::vector<std::string> path;
  int32_t schema_index = 0;
  ColumnSpec spec;
};
std::vector<LeafColumn> leaf_columns(const FileMetaData& metadata, const std::string& path,
                                     uint64_t offset);

// A decoded run of rows (a whole column chunk, or some of its pages), as ONE byte
// buffer so that it can sit in a cache of std::shared_ptr<const io::ByteVector>.
// Row r's value is data[offsets[r], offsets[r+1]): fixed-width types one little-endian
// value (BOOLEAN one byte, 0 or 1); BYTE_ARRAY the bytes; FIXED_LEN_BYTE_ARRAY its
// type_length bytes; a list (max_repetition 1) its elements' values back to back. A null
// row (a null scalar, a null struct above the leaf, a null list) has nulls[r] = 1 and
// an empty value; an empty list is a non-null empty value.
// A chunk whose values were left where they lie (decode_column_chunk) has starts: row
// r's value is the offsets[r + 1] - offsets[r] bytes at starts[r] in data (its
// decompressed pages, kept whole), or, where data is nullptr, in the chunk's stored
// bytes (from the `data` it was decoded from); every one inside them (a reader of a
// buffer it did not decode itself checks each value it takes).
struct DecodedView {
  uint64_t rows = 0;
  const uint64_t* offsets = nullptr;  // rows + 1
  const uint8_t* nulls = nullptr;     // rows bytes, or nullptr when no row is null
  const uint8_t* data = nullptr;      // nullptr when the values are in the stored bytes
  uint64_t data_size = 0;
  const uint64_t* starts = nullptr;  // rows, or nullptr: the values are in data, in order
};
// Error when `decoded` is not such a buffer. Offsets and data are 8-byte aligned in it.
DecodedView view_decoded(const io::ByteVector& decoded);

// The dictionary page at `data` (a page header then its body), decoded into the same
// format (entry i = "row" i); nullptr when the page there is not a dictionary page.
// *consumed: the page's bytes (header and body).
std::shared_ptr<const io::ByteVector> read_dictionary_page(const uint8_t* data, uint64_t size,
                                                           uint64_t file_offset,
                                                           const ColumnSpec& spec,
                                                           const std::string& path,
                                                           uint64_t* consumed);

// Data pages (v1 and v2) back to back at [data, data + size), which start at file
// offset `file_offset`, holding exactly `rows` rows (else FormatError), decoded;
// `dictionary` (from read_dictionary_page) for dictionary-encoded pages. Pages may mix
// dictionary and PLAIN encodings. FormatErrors name `path`, the page header's file
// offset, spec.name and the page's number (from 0, counting every page the call sees;
// rows in messages count from the call's first row too).
io::ByteVector decode_data_pages(const uint8_t* data, uint64_t size, uint64_t file_offset,
                                 const ColumnSpec& spec, const io::ByteVector* dictionary,
                                 uint64_t rows, const std::string& path);

// A whole column chunk: an optional dictionary page, then data pages. `left`, for a
// chunk of scalar byte strings with no dictionary page and every value PLAIN: with
// kInStored, an uncompressed chunk's values are left in [data, data + size), so that a
// caller that can read those bytes again (a mapped file) copies each value once, from
// there; with either, a compressed chunk of large values (spec.least_bytes_in_pages a
// row) keeps its decompressed pages whole and its values in them. The result says where
// they are (DecodedView::starts). Other chunks decode as with kCopied.
io::ByteVector decode_column_chunk(const uint8_t* data, uint64_t size, uint64_t file_offset,
                                   const ColumnSpec& spec, uint64_t rows, const std::string& path,
                                   io::ValuesLeft left = io::ValuesLeft::kCopied);

}  // namespace stoker::format::parquet
