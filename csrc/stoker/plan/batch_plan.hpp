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
  // The member row of this field for every sample of the dataset (-1: none, or
  // not indexed yet), one table per alternative in order. Filled in place as
  // shards are indexed; owned by the caller for the plan's life.
  std::vector<const int64_t*> tables;
  std::vector<std::string> alternatives;       // the tables' field names, for messages
  const int64_t* column = nullptr;             // kColumn: one value per sample
  std::shared_ptr<const image::Target> image;  // kImage: what each image becomes
  uint64_t length = 0;                         // entries in each table (or the column)
};

// The member table's columns as they are now (rows are only ever added).
struct Members {
  const uint32_t* file = nullptr;
  const uint64_t* offset = nullptr;
  const uint64_t* length = nullptr;
  const uint64_t* out = nullptr;
  const uint8_t* codec = nullptr;
  const uint32_t* crc = nullptr;
  const int32_t* decoder = nullptr;
  const uint32_t* array = nullptr;
  const int64_t* sample_first = nullptr;
  uint64_t rows = 0;
  uint64_t samples = 0;
  std::shared_ptr<const io::FileTable> files;
  // Per decoder id (rows of .npy shards; 0 is raw bytes): bytes per row, and
  // "(3,) float32" for messages.
  std::vector<uint64_t> decoder_row_bytes;
  std::vector<std::string> decoder_what;
};

// Where one field of a prepared batch lies in its buffer.
struct FieldLayout {
  uint64_t offset = 0;           // the field's region
  int32_t decoder = 0;           // kNpy rows of .npy shards: their decoder
  bool members = false;          // kNpy: .npy files stored as members
  format::NpyHeader npy;         // kNpy members: the batch's first member's header
  uint64_t header_offset = 0;    // kNpy members: every member's header, side by side
  std::vector<uint8_t> header;   // kNpy members: the first member's header bytes
  std::vector<int64_t> rows;     // kNpy members: each sample's member (for check())
  std::vector<uint64_t> starts;  // kBytes: where each sample's bytes are
  std::vector<uint64_t> lengths;
};

struct PreparedBatch {
  std::vector<int64_t> indices;
  std::vector<io::ReadRequest> requests;
  std::vector<int64_t> request_rows;  // the member row each request reads
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
