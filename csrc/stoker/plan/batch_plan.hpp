// BatchPlan: the fields= fast path's layout, worked out per batch in C++. Given
// a batch's sample indices and the member table, it finds each named field's
// member for every sample (the first of its alternatives a sample has), checks
// sizes, lays every field out in one buffer (each region aligned so any dtype
// can be viewed in place) and makes the read requests: the whole batch is then
// one submit to the ShardReader, and the caller only wraps the finished buffer.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "stoker/format/shard_index.hpp"
#include "stoker/image/image.hpp"
#include "stoker/io/shard_reader.hpp"

namespace stoker::plan {

// Where each piece starts in a batch buffer: aligned so any dtype views it.
constexpr uint64_t kAlign = 64;

enum class Kind : uint8_t {
  kRaw = 0,     // member bytes are one fixed-size array
  kInt = 1,     // ASCII integer text, parsed into an int64
  kNpy = 2,     // a row of a .npy shard, or a .npy file stored as a member
  kBytes = 3,   // variable-length bytes, handed out one view per sample
  kColumn = 4,  // an integer column of the dataset (a CSV's labels): no member
  kImage = 5,   // a JPEG or PNG, decoded into a fixed-size RGB array by the reader
};

struct FieldSpec {
  std::string name;  // the batch entry, for messages
  Kind kind = Kind::kBytes;
  uint64_t nbytes = 0;  // kRaw: bytes per sample
  std::string what;     // kRaw: "(3, 64, 64) uint8", for messages
  // The dataset's field ids of the alternatives, in order: each sample's member
  // is the first of them its shard's index has for it.
  std::vector<int32_t> field_ids;
  std::vector<std::string> alternatives;            // their names, for messages
  const int64_t* column = nullptr;                  // kColumn: one value per sample
  std::shared_ptr<const image::Target> image;       // kImage: what each image becomes
  std::shared_ptr<const io::FieldDecoder> decoder;  // kImage: made from `image` by the plan
  uint64_t length = 0;                              // kColumn: the column's entries
};

// A member column: stored, one value per row, or worked out from the row where the
// rows follow a rule (a .npy's, an array source's: a billion rows held as a few
// numbers). With base.size() members per sample, member j of sample i being row
// i * base.size() + j, that row holds base[j] + step[j] * i.
template <typename T>
struct MemberColumn {
  using Value = T;
  const T* stored = nullptr;
  std::vector<T> base, step;
  bool present() const { return stored != nullptr || !base.empty(); }
  T operator[](uint64_t row) const {
    if (stored != nullptr) return stored[row];
    const size_t period = base.size();
    const size_t j = period == 1 ? 0 : row % period;
    // In uint64, which wraps (Python's ComputedColumn does the same); then the column's type.
    return static_cast<T>(static_cast<uint64_t>(base[j]) +
                          static_cast<uint64_t>(step[j]) * (row / period));
  }
};

// One indexed shard's members, rows numbered within the shard. Stored columns are
// the caller's arrays; `keep` holds them for as long as any batch plan uses them.
struct ShardColumns {
  int64_t first_sample = 0;  // the dataset's number of the shard's first sample
  uint64_t samples = 0;
  uint64_t rows = 0;
  MemberColumn<uint32_t> file;  // into the dataset's FileTable
  MemberColumn<uint64_t> offset;
  MemberColumn<uint64_t> length;
  MemberColumn<uint64_t> out;
  MemberColumn<uint8_t> codec;
  MemberColumn<uint32_t> crc;
  MemberColumn<int32_t> decoder;
  MemberColumn<uint32_t> array;
  MemberColumn<int64_t> sample_first;  // per sample of the shard: its first row
  // Per field id of the dataset: each sample's row of that field (-1: none), or
  // absent where no sample of the shard has the field.
  std::vector<MemberColumn<int64_t>> field_rows;
  std::shared_ptr<const void> keep;
};

// One member: its shard's columns and its row there. `id` is how Python names
// it: shard << 32 | row.
struct MemberRef {
  const ShardColumns* shard = nullptr;
  uint64_t row = 0;
  int64_t id = 0;
};

// The dataset's index as a batch sees it: where each shard's samples start, and
// the columns of the shards indexed now (only those a batch may read need be).
struct Members {
  std::shared_ptr<const std::vector<int64_t>> shard_start;  // shards + 1 entries
  std::unordered_map<uint32_t, std::shared_ptr<const ShardColumns>> resident;
  uint64_t samples = 0;
  std::shared_ptr<const io::FileTable> files;
  // Per decoder id (rows of .npy shards; 0 is raw bytes): bytes per row, and
  // "(3,) float32" for messages.
  std::vector<uint64_t> decoder_row_bytes;
  std::vector<std::string> decoder_what;

  // The shard holding `sample`, and its number; null if that shard is not indexed.
  const ShardColumns* shard_of(int64_t sample, uint32_t& shard) const;
};

// Where one field of a prepared batch lies in its buffer.
struct FieldLayout {
  uint64_t offset = 0;           // the field's region
  int32_t decoder = 0;           // kNpy rows of .npy shards: their decoder
  bool members = false;          // kNpy: .npy files stored as members
  format::NpyHeader npy;         // kNpy members: the batch's first member's header
  uint64_t header_offset = 0;    // kNpy members: every member's header, side by side
  std::vector<uint8_t> header;   // kNpy members: the first member's header bytes
  std::vector<MemberRef> rows;   // kNpy members: each sample's member (for check())
  std::vector<uint64_t> starts;  // kBytes: where each sample's bytes are
  std::vector<uint64_t> lengths;
  size_t first_request = 0;  // kBytes: sample i's bytes are request first_request + i
};

struct PreparedBatch {
  std::vector<int64_t> indices;
  std::vector<io::ReadRequest> requests;
  std::vector<int64_t> request_rows;  // the member each request reads (MemberRef::id)
  std::vector<FieldLayout> fields;    // one per FieldSpec
  uint64_t nbytes = 0;
};

// A sample's key, for messages.
using KeyOf = std::function<std::string(int64_t sample)>;

class BatchPlan {
 public:
  explicit BatchPlan(std::vector<FieldSpec> fields);

  // Everything about the batch of samples `indices` short of reading it. Throws
  // FormatError naming the file, offset, field and sample for a member that is
  // missing or is not what its decoder needs. An image's random crop is seeded
  // by `augment_seed` and the sample's index alone.
  PreparedBatch prepare(const int64_t* indices, size_t n, const Members& members,
                        const KeyOf& key_of, uint64_t augment_seed = 0) const;
  // The integer columns' values, written into the batch's buffer.
  void write_columns(const PreparedBatch& batch, uint8_t* buffer) const;
  // After the read: every .npy member's header matches the batch's first.
  void check(const PreparedBatch& batch, const uint8_t* buffer, const Members& members) const;

  const std::vector<FieldSpec>& fields() const { return fields_; }

 private:
  std::vector<FieldSpec> fields_;
};

}  // namespace stoker::plan
