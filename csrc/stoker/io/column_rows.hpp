// Values (Codec::kColumnValue) of table sources' columns in a batch: grouped by
// the unit (column chunk or pages) they lie in, so that each unit a batch
// touches is read and decoded once, however many of the batch's rows share it,
// and kept for the next batches (ChunkCache); each row's value is then copied
// into its place, or handed to its field's decoder (an image, an integer).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "stoker/io/array_rows.hpp"
#include "stoker/io/column_layout.hpp"
#include "stoker/io/file_cache.hpp"
#include "stoker/io/shard_reader.hpp"

namespace stoker::io {

struct ColumnTask {
  uint32_t column;  // into FileTable::columns
  uint32_t unit;    // into its units
  uint32_t first;   // into ColumnPlan::requests
  uint32_t count;
};

struct ColumnPlan {
  std::vector<ColumnTask> tasks;
  std::vector<uint32_t> requests;  // the values each task serves, task by task
};

// Throws Error unless `r` (a kColumnValue request) names a row of a column of
// `files` whose value lands inside a buffer of `dest_size` bytes.
void validate_column_value(const FileTable& files, const ReadRequest& r, uint64_t dest_size);

// The batch's column values, one task per unit they lie in.
ColumnPlan plan_columns(const FileTable& files, const std::vector<ReadRequest>& requests);

// Reads and decodes the task's unit (unless the cache has it) and serves each of
// its values. Returns the bytes it read from the file. A value whose decoder
// blanks on error is zeroed and its request noted in `blanked`; one a request
// lets borrow (ReadRequest::borrow) that lies in the decoded unit, a unit the
// cache keeps, is noted in `borrowed` instead of copied.
uint64_t execute_column_task(const FileTable& files, const std::vector<ReadRequest>& requests,
                             const ColumnPlan& plan, const ColumnTask& task, uint8_t* dest,
                             FileCache& cache, ChunkCache& decoded, std::vector<uint32_t>& blanked,
                             std::vector<BorrowedValue>& borrowed);

// Values smaller than this are copied even where they may be borrowed: the copy costs
// less than the batch keeping the value's whole unit (often megabytes) alive.
constexpr uint64_t kBorrowMinBytes = 4096;

// Writes a value's size in bytes as a uint64 (UINT64_MAX for a null): what a
// batch of a column's variable-size values must know before it is laid out.
std::shared_ptr<const FieldDecoder> value_size_decoder();
// Widens a little-endian integer of `width` bytes (1, 2, 4 or 8) to an int64.
std::shared_ptr<const FieldDecoder> integer_decoder(uint32_t width, bool is_signed);

}  // namespace stoker::io
