// Where the values of one column of a table file (a Parquet leaf column) lie:
// in units (a row group's column chunk, or a run of its pages), each decoded
// whole by the decoder the format layer attaches, into a buffer of values the
// reader copies rows out of. Learnt once at open from the file's footer; reads
// then need no Parquet library.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "stoker/io/byte_vector.hpp"
namespace stoker::io {

// The rows of a decoded unit: row r's value is data[offsets[r], offsets[r + 1]).
// A null row (nulls[r] != 0) has an empty value. A unit whose values were left where
// they lie (see ValuesLeft) has starts: row r's value is then the
// offsets[r + 1] - offsets[r] bytes at starts[r] in data (the unit's decompressed
// pages), or, where data is null, in the unit's stored bytes, which the caller reads
// again to take it.
struct ColumnValues {
  uint64_t rows = 0;
  const uint64_t* offsets = nullptr;  // rows + 1 entries
  const uint8_t* nulls = nullptr;     // rows entries; null: no row is null
  const uint8_t* data = nullptr;
  uint64_t data_size = 0;
  const uint64_t* starts = nullptr;  // rows entries, or null: the values are in data
};

// Where a decode may leave byte strings instead of copying each out after the last:
// a copy of an image is as dear as decompressing it, and a batch copies it once more.
enum class ValuesLeft : uint8_t {
  kCopied,   // nowhere: every value is copied, back to back
  kInPages,  // in their decompressed pages, which the decoded unit keeps whole
  // also in the stored bytes of pages stored as they are, which can be had again
  // whenever the unit is used (they lie in a mapped file)
  kInStored,
};

// What the format layer knows and the reader does not: how a unit's stored
// bytes become values.
class ColumnDecoder {
 public:
  virtual ~ColumnDecoder() = default;
  // Decodes a unit's stored pages ([data, data + size), read from `file_offset`),
  // which must hold `rows` rows, after the dictionary page they need where it lies
  // apart from them (dictionary_size bytes at `dictionary`, read from
  // `dictionary_offset`; none: 0). Throws FormatError naming `path`.
  // `left`: where byte strings may stay (the result then says where each is).
  virtual ByteVector decode(const uint8_t* dictionary, uint64_t dictionary_size,
                            uint64_t dictionary_offset, const uint8_t* data, uint64_t size,
                            uint64_t file_offset, uint64_t rows, const std::string& path,
                            ValuesLeft left) const = 0;
  // The rows of what decode() returned.
  virtual ColumnValues view(const ByteVector& decoded) const = 0;
};

// Integers Int() widens to int64 (none: Int() parses the values as text).
enum class ColumnInteger : uint8_t { kNone = 0, kSigned = 1, kUnsigned = 2 };

struct ColumnUnit {
  uint64_t first_row = 0;
  uint64_t rows = 0;
  uint64_t offset = 0;  // the unit's stored bytes: its pages (a whole column chunk)
  uint64_t size = 0;
  // A dictionary page that lies apart from the unit's pages (a unit of some of a
  // dictionary-encoded chunk's pages): read first, just before them. 0: none.
  uint64_t dictionary_offset = 0;
  uint64_t dictionary_size = 0;
  uint64_t row_group = 0;  // for messages
};

struct ColumnLayout {
  uint64_t id = 0;    // unique in this process (next_layout_id): decoded units are cached by it
  std::string name;   // "column image.bytes", for messages (which name the file too)
  uint32_t file = 0;  // into FileTable::paths
  uint64_t rows = 0;
  uint32_t width = 0;  // bytes of every value that is not null; 0: values vary in size
  ColumnInteger integer = ColumnInteger::kNone;  // values are integers of `width` bytes
  std::vector<ColumnUnit> units;                 // by first row, covering [0, rows)
  std::shared_ptr<const ColumnDecoder> decoder;

  // The unit row `row` lies in (row < rows).
  size_t unit_of(uint64_t row) const;
  // Checks the layout is whole and consistent; throws Error naming it.
  void check() const;
};

}  // namespace stoker::io
