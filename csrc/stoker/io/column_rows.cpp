#include "stoker/io/column_rows.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "stoker/errors.hpp"
#include "stoker/io/posix_file.hpp"

namespace stoker::io {

namespace {

// A unit is read whole into a thread's scratch buffer: a column chunk larger than
// this is a file to write with smaller row groups or pages (or a damaged footer).
constexpr uint64_t kMaxUnitBytes = uint64_t(1) << 31;
// A thread's scratch buffer is given back when a unit needed more than this.
constexpr size_t kUnitScratchKeep = 64 * 1024 * 1024;

class ValueSizeDecoder final : public FieldDecoder {
 public:
  uint64_t output_bytes() const override { return sizeof(uint64_t); }
  uint64_t max_input_bytes() const override { return std::numeric_limits<uint64_t>::max(); }
  const char* input_name() const override { return "a column value"; }
  void decode(const uint8_t*, uint64_t size, uint64_t, uint8_t* dest, const std::string&,
              uint64_t) const override {
    std::memcpy(dest, &size, sizeof size);
  }
};

class IntegerDecoder final : public FieldDecoder {
 public:
  IntegerDecoder(uint32_t width, bool is_signed) : width_(width), signed_(is_signed) {}
  uint64_t output_bytes() const override { return sizeof(int64_t); }
  uint64_t max_input_bytes() const override { return width_; }
  const char* input_name() const override { return "an integer"; }
  void decode(const uint8_t* src, uint64_t size, uint64_t, uint8_t* dest, const std::string& path,
              uint64_t offset) const override {
    if (size != width_) {
      throw FormatError(
          path, offset,
          "an integer value of " + std::to_string(size) + " bytes, not " + std::to_string(width_));
    }
    uint64_t bits = 0;
    for (uint32_t i = 0; i < width_; ++i) bits |= uint64_t(src[i]) << (8 * i);
    if (signed_ && width_ < 8 && (bits >> (8 * width_ - 1)) & 1)
      bits |= ~uint64_t(0) << (8 * width_);
    int64_t value;
    std::memcpy(&value, &bits, sizeof value);
    std::memcpy(dest, &value, sizeof value);
  }

 private:
  uint32_t width_;
  bool signed_;
};

// Whether the decoded-chunk cache keeps a unit of this size (a quarter of its limit at most).
bool keeps(const ChunkCache& decoded, const ByteVector& unit) {
  return unit.size() <= decoded.limit() / 4;
}

// [data, data + size) lies within `unit` (the decoded values, not the file's mapping).
bool lies_in(const uint8_t* data, uint64_t size, const ByteVector& unit) {
  const auto at = reinterpret_cast<uintptr_t>(data);
  const auto first = reinterpret_cast<uintptr_t>(unit.data());
  return at >= first && at - first <= unit.size() && size <= unit.size() - (at - first);
}

const ColumnLayout& column_of(const FileTable& files, const ReadRequest& r) {
  if (r.array >= files.columns.size()) {
    throw Error("read request names column " + std::to_string(r.array) + " but the table has " +
                std::to_string(files.columns.size()));
  }
  return *files.columns[r.array];
}

}  // namespace

std::shared_ptr<const FieldDecoder> value_size_decoder() {
  static const auto decoder = std::make_shared<const ValueSizeDecoder>();
  return decoder;
}

std::shared_ptr<const FieldDecoder> integer_decoder(uint32_t width, bool is_signed) {
  static const std::shared_ptr<const FieldDecoder> decoders[2][4] = {
      {std::make_shared<IntegerDecoder>(1, false), std::make_shared<IntegerDecoder>(2, false),
       std::make_shared<IntegerDecoder>(4, false), std::make_shared<IntegerDecoder>(8, false)},
      {std::make_shared<IntegerDecoder>(1, true), std::make_shared<IntegerDecoder>(2, true),
       std::make_shared<IntegerDecoder>(4, true), std::make_shared<IntegerDecoder>(8, true)}};
  switch (width) {
    case 1:
      return decoders[is_signed][0];
    case 2:
      return decoders[is_signed][1];
    case 4:
      return decoders[is_signed][2];
    case 8:
      return decoders[is_signed][3];
    default:
      throw Error("integers of " + std::to_string(width) + " bytes cannot be widened");
  }
}

size_t ColumnLayout::unit_of(uint64_t row) const {
  auto after = std::upper_bound(units.begin(), units.end(), row,
                                [](uint64_t r, const ColumnUnit& u) { return r < u.first_row; });
  return static_cast<size_t>(after - units.begin()) - 1;
}

void ColumnLayout::check() const {
  if (!decoder) throw Error(name + ": the column has no decoder");
  if (integer != ColumnInteger::kNone && width != 1 && width != 2 && width != 4 && width != 8) {
    throw Error(name + ": integers of " + std::to_string(width) + " bytes");
  }
  uint64_t next = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    const ColumnUnit& u = units[i];
    if (u.first_row != next || u.rows == 0) {
      throw Error(name + ": unit " + std::to_string(i) + " starts at row " +
                  std::to_string(u.first_row) + " with " + std::to_string(u.rows) +
                  " rows, where row " + std::to_string(next) + " was next");
    }
    if (u.offset + u.size < u.offset ||
        u.dictionary_offset + u.dictionary_size < u.dictionary_offset) {
      throw Error(name + ": unit " + std::to_string(i) + "'s byte range overflows");
    }
    next += u.rows;
  }
  if (next != rows) {
    throw Error(name + ": its units cover " + std::to_string(next) + " rows, not " +
                std::to_string(rows));
  }
}

void validate_column_value(const FileTable& files, const ReadRequest& r, uint64_t dest_size) {
  const ColumnLayout& c = column_of(files, r);
  if (c.file >= files.paths.size()) {
    throw Error(c.name + ": names file " + std::to_string(c.file) + " but the table has " +
                std::to_string(files.paths.size()));
  }
  if (r.offset >= c.rows) {
    throw Error(files.paths[c.file], 0,
                c.name + ": row " + std::to_string(r.offset) + " of " + std::to_string(c.rows));
  }
  if (r.decoder && r.out_length != r.decoder->output_bytes()) {
    throw Error(c.name + ": a value decodes to " + std::to_string(r.decoder->output_bytes()) +
                " bytes, not " + std::to_string(r.out_length));
  }
  if (r.out_length == kUnsizedValue && r.borrow && !r.decoder) return;  // no room laid out
  if (r.dest_offset > dest_size || r.out_length > dest_size - r.dest_offset) {
    throw Error(c.name + ": a value of " + std::to_string(r.out_length) +
                " bytes at buffer offset " + std::to_string(r.dest_offset) +
                " does not fit a buffer of " + std::to_string(dest_size));
  }
}

ColumnPlan plan_columns(const FileTable& files, const std::vector<ReadRequest>& requests) {
  struct Piece {
    uint32_t column, unit, request;
  };
  std::vector<Piece> pieces;
  for (uint32_t i = 0; i < requests.size(); ++i) {
    const ReadRequest& r = requests[i];
    if (r.codec != Codec::kColumnValue) continue;
    const ColumnLayout& c = *files.columns[r.array];
    pieces.push_back({r.array, static_cast<uint32_t>(c.unit_of(r.offset)), i});
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& x, const Piece& y) {
    return x.column != y.column ? x.column < y.column
           : x.unit != y.unit   ? x.unit < y.unit
                                : x.request < y.request;
  });
  ColumnPlan plan;
  plan.requests.reserve(pieces.size());
  for (const Piece& p : pieces) {
    if (plan.tasks.empty() || plan.tasks.back().column != p.column ||
        plan.tasks.back().unit != p.unit) {
      plan.tasks.push_back({p.column, p.unit, static_cast<uint32_t>(plan.requests.size()), 0});
    }
    plan.requests.push_back(p.request);
    ++plan.tasks.back().count;
  }
  return plan;
}

uint64_t execute_column_task(const FileTable& files, const std::vector<ReadRequest>& requests,
                             const ColumnPlan& plan, const ColumnTask& task, uint8_t* dest,
                             FileCache& cache, ChunkCache& decoded, std::vector<uint32_t>& blanked,
                             std::vector<BorrowedValue>& borrowed) {
  const ColumnLayout& c = *files.columns[task.column];
  const ColumnUnit& u = c.units[task.unit];
  const std::string& path = files.paths[c.file];
  uint64_t read = 0;
  thread_local ByteVector raw, raw_dictionary;
  struct Shrink {  // when decoding throws too
    ~Shrink() {
      give_back_if_larger(raw, kUnitScratchKeep);
      give_back_if_larger(raw_dictionary, kUnitScratchKeep);
    }
  } shrink;
  std::shared_ptr<const FileDescriptor> fd;
  auto open = [&] {
    fd = cache.get(path, files.identities.empty() ? FileIdentity{} : files.identities[c.file]);
  };
  const uint8_t* stored = nullptr;  // the unit's stored bytes, once read for this task
  ChunkCache::Claim claim;
  ChunkCache::Bytes values = decoded.find_or_claim(c.id, task.unit, claim);
  if (!values) {
    const uint64_t total = u.dictionary_size + u.size;
    if (total > kMaxUnitBytes || total < u.size) {
      throw FormatError(path, u.offset,
                        c.name + ": a column chunk of " + std::to_string(total) +
                            " bytes is more than stoker reads at once; write the file with "
                            "smaller row groups (pyarrow: row_group_size=)");
    }
    open();
    const uint8_t* dictionary =
        bytes_at(*fd, path, u.dictionary_offset, u.dictionary_size, raw_dictionary);
    stored = bytes_at(*fd, path, u.offset, u.size, raw);
    read = total;
    // Values stored as they are stay in the file's mapping, to be copied from it each
    // time the unit serves a batch: the cache keeps only where they are. Compressed
    // ones stay in their decompressed pages.
    const ValuesLeft left = stored != raw.data() ? ValuesLeft::kInStored : ValuesLeft::kInPages;
    try {
      values = std::make_shared<const ByteVector>(
          c.decoder->decode(dictionary, u.dictionary_size, u.dictionary_offset, stored, u.size,
                            u.offset, u.rows, path, left));
    } catch (const FormatError& e) {
      throw FormatError(e.path(), e.offset(),
                        "row group " + std::to_string(u.row_group) + ", " + e.detail());
    }
    if (keeps(decoded, *values)) decoded.put(c.id, task.unit, values);
  }
  // Values are lent out only of a unit the cache keeps: what batches hold alive past the
  // cache's limit is then units it let go of meanwhile, not every unit of every batch in
  // flight (a column chunk with no page index is one unit, up to gigabytes).
  const bool lends = keeps(decoded, *values);
  // A value handed out where it lies: in such a unit, and big enough to hold it for.
  auto lendable = [&](const uint8_t* src, uint64_t size) {
    return lends && size >= kBorrowMinBytes && lies_in(src, size, *values);
  };
  const ColumnValues v = c.decoder->view(*values);
  if (v.rows != u.rows) {
    throw FormatError(path, u.offset,
                      c.name + ": decoded " + std::to_string(v.rows) +
                          " rows where the footer says " + std::to_string(u.rows));
  }
  // Values left in the stored bytes are taken from them, read again (the file checked
  // to still hold them, see bytes_at) once a request wants a value and not its size.
  bool count_values = false;  // bytes read: the values taken from a mapping, not the unit
  auto value_at = [&](uint64_t row, uint64_t size, uint64_t index) -> const uint8_t* {
    if (v.starts == nullptr) return v.data + v.offsets[row];
    if (v.data != nullptr) {  // in the unit's kept pages
      if (v.starts[row] > v.data_size || size > v.data_size - v.starts[row]) {
        throw FormatError(path, u.offset,
                          c.name + ": row " + std::to_string(index) +
                              " lies outside its column chunk's decompressed pages");
      }
      return v.data + v.starts[row];
    }
    if (stored == nullptr) {
      open();
      stored = bytes_at(*fd, path, u.offset, u.size, raw);
      if (stored == raw.data()) {
        read += u.size;
      } else {
        count_values = true;
      }
    }
    if (v.starts[row] > u.size || size > u.size - v.starts[row]) {
      throw FormatError(path, u.offset,
                        c.name + ": row " + std::to_string(index) +
                            " lies outside its column chunk's stored bytes");
    }
    if (count_values) read += size;
    return stored + v.starts[row];
  };
  const FieldDecoder* sizes = value_size_decoder().get();
  std::vector<BorrowedValue> copies;  // unsized values to hand out from a copy of their own
  for (uint32_t k = task.first; k < task.first + task.count; ++k) {
    const uint32_t index = plan.requests[k];
    const ReadRequest& r = requests[index];
    const uint64_t row = r.offset - u.first_row;
    uint8_t* into = dest + r.dest_offset;
    const bool null = v.nulls != nullptr && v.nulls[row] != 0;
    const uint64_t size = v.offsets[row + 1] - v.offsets[row];
    if (r.decoder.get() == sizes) {
      const uint64_t said = null ? std::numeric_limits<uint64_t>::max() : size;
      std::memcpy(into, &said, sizeof said);
      continue;
    }
    if (null) {
      if (!r.decoder && r.out_length == 0) continue;  // a null a sample dict gives as None
      throw FormatError(path, u.offset,
                        c.name + ": row " + std::to_string(r.offset) +
                            " is null, and a batch asks for its value: leave the field out, or "
                            "fill its nulls (pyarrow.compute.fill_null) and write the file again");
    }
    const uint8_t* src = value_at(row, size, r.offset);
    if (!r.decoder) {
      const bool unsized = r.out_length == kUnsizedValue && r.borrow;  // no room laid out
      if (!unsized && size != r.out_length) {
        throw FormatError(path, u.offset,
                          c.name + ": row " + std::to_string(r.offset) + " is " +
                              std::to_string(size) + " bytes, not the " +
                              std::to_string(r.out_length) + " laid out for it");
      }
      if (r.borrow && lendable(src, size)) {
        borrowed.push_back({index, src, size, values});
      } else if (unsized) {  // small, or in the file's mapping: copied, below
        copies.push_back({index, src, size});
      } else if (size) {
        std::memcpy(into, src, size);
      }
    } else if (!r.decoder->blank_on_error()) {
      r.decoder->decode(src, size, r.seed, into, path, u.offset);
    } else {
      try {
        r.decoder->decode(src, size, r.seed, into, path, u.offset);
      } catch (const FormatError&) {
        std::memset(into, 0, r.out_length);
        blanked.push_back(index);
      }
    }
  }
  if (!copies.empty()) {
    // One buffer for the task's copies, each at an offset aligned for any list's numbers.
    constexpr uint64_t kCopyAlign = 16;
    uint64_t total = 0;
    for (const BorrowedValue& copy : copies) {
      total += (copy.size + kCopyAlign - 1) / kCopyAlign * kCopyAlign;
    }
    auto held = std::make_shared<ByteVector>(total);
    uint64_t at = 0;
    for (BorrowedValue& copy : copies) {
      if (copy.size) std::memcpy(held->data() + at, copy.data, copy.size);
      copy.data = held->data() + at;
      copy.owner = held;
      copy.shared = false;
      at += (copy.size + kCopyAlign - 1) / kCopyAlign * kCopyAlign;
      borrowed.push_back(std::move(copy));
    }
  }
  return read;
}

}  // namespace stoker::io
