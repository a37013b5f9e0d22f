// A Parquet file summed up from its footer alone, for opening datasets of many files
// without reading every footer's columns in Python (see parquet.hpp, FileSummary).
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "stoker/format/parquet.hpp"
#include "stoker/io/posix_file.hpp"
#include "stoker/util/fnv1a.hpp"

namespace stoker::format::parquet {

namespace {

// A key for comparing files' layouts.
class LayoutKey : public util::Fnv1a {
 public:
  using Fnv1a::add;
  void add(int64_t value) { add(&value, sizeof value); }
  void add(const std::string& s) {
    add(static_cast<int64_t>(s.size()));
    add(s.data(), s.size());
  }
};

}  // namespace

FileSummary summarize_file(const std::string& path, uint64_t tail) {
  io::FileDescriptor fd = io::open_for_read(path);
  FileSummary out;
  out.identity = io::identity_of(fd.get(), path);
  const uint64_t size = out.identity.size;
  if (size < 12) locate_footer(nullptr, 0, size, path);  // (says why, naming the file)
  const uint64_t tail_size = std::min(size, std::max<uint64_t>(tail, 8));
  std::vector<uint8_t> end(tail_size);
  io::pread_exact(fd.get(), path, end.data(), tail_size, size - tail_size);
  const FooterSpan span = locate_footer(end.data(), tail_size, size, path);
  std::vector<uint8_t> rest;
  const uint8_t* footer = nullptr;
  if (span.offset >= size - tail_size) {
    footer = end.data() + (span.offset - (size - tail_size));
  } else {
    rest.resize(span.size);
    io::pread_exact(fd.get(), path, rest.data(), span.size, span.offset);
    footer = rest.data();
  }
  const FileMetaData meta = parse_file_metadata(footer, span.size, path, span.offset);
  out.rows = meta.num_rows;
  LayoutKey key;
  key.add(static_cast<int64_t>(meta.encrypted));
  key.add(static_cast<int64_t>(meta.schema.size()));
  for (const SchemaElement& e : meta.schema) {
    key.add(e.name);
    for (int64_t v :
         {int64_t{e.type}, int64_t{e.type_length}, int64_t{e.repetition}, int64_t{e.num_children},
          int64_t{e.converted_type}, int64_t{e.scale}, int64_t{e.precision},
          int64_t{e.int_bit_width}, int64_t{e.int_signed}, int64_t{e.adjusted_to_utc}}) {
      key.add(v);
    }
    key.add(e.logical_type);
    key.add(e.time_unit);
  }
  // Per column: the codecs and encodings of all its chunks, and whether any lies in
  // another file or is encrypted (each decides whether the column can be read).
  std::vector<uint64_t> codecs, encodings, odd;
  out.group_rows.reserve(meta.row_groups.size());
  for (const RowGroupMeta& group : meta.row_groups) {
    out.group_rows.push_back(group.num_rows);
    if (codecs.size() < group.columns.size()) {
      codecs.resize(group.columns.size());
      encodings.resize(group.columns.size());
      odd.resize(group.columns.size());
    }
    for (size_t j = 0; j < group.columns.size(); ++j) {
      const ColumnChunkMeta& c = group.columns[j];
      odd[j] |= (c.file_path.empty() ? 0 : 1) | (c.encrypted ? 2 : 0);  // (refused in any group)
      if (group.num_rows == 0) continue;  // (points nowhere: see the Python reader)
      codecs[j] |= uint64_t{1} << (static_cast<unsigned>(c.codec) & 63);
      for (int32_t e : c.encodings) encodings[j] |= uint64_t{1} << (static_cast<unsigned>(e) & 63);
    }
  }
  key.add(static_cast<int64_t>(codecs.size()));
  for (size_t j = 0; j < codecs.size(); ++j) {
    key.add(static_cast<int64_t>(codecs[j]));
    key.add(static_cast<int64_t>(encodings[j]));
    key.add(static_cast<int64_t>(odd[j]));
  }
  out.columns_key = key.value();
  return out;
}

}  // namespace stoker::format::parquet
