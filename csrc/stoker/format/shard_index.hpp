// What an index parser learns from a shard: its samples, each a key and some
// fields, each field a byte range (possibly compressed). Columnar, so Python
// turns it into numpy arrays without a loop per member.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "stoker/format/window_reader.hpp"
#include "stoker/io/decoder.hpp"
#include "stoker/io/posix_file.hpp"

namespace stoker::format {

struct NpyHeader {
  std::string descr;           // numpy dtype string, e.g. "<f4"
  bool fortran_order = false;  // refused for arrays with more than one axis of size > 1
  std::vector<uint64_t> shape;
  uint64_t data_offset = 0;
  uint64_t itemsize = 0;
  uint64_t data_bytes = 0;  // the whole array's
  uint64_t row_bytes = 0;   // bytes of one sample: one index along the first axis
};

struct ShardIndex {
  ShardIndex() = default;
  ShardIndex(std::string format_name, const io::FileIdentity& file)
      : format(std::move(format_name)), file_size(file.size), identity(file) {}

  std::string format;  // "tar", "zip", "npy", "mds" or "litdata"
  uint64_t file_size = 0;
  io::FileIdentity identity;  // the file as indexed; reads check it

  // tar and zip. sample_start has one entry per sample plus one.
  std::vector<std::string> keys;
  std::vector<uint32_t> sample_start{0};
  std::vector<std::string> field_names;
  std::vector<uint16_t> member_field;
  std::vector<uint64_t> member_offset;
  std::vector<uint64_t> member_length;      // bytes on disk
  std::vector<uint64_t> member_out_length;  // bytes once decoded
  std::vector<uint8_t> member_codec;        // io::Codec
  std::vector<uint32_t> member_crc;         // zip's CRC-32; checked for compressed members
  // Runs of consecutive members that share a key: the samples a reader that
  // groups only adjacent members (WebDataset) would see. More runs than keys
  // means a sample's members were stored apart and have been put together.
  uint64_t key_runs = 0;
  // Whether a member index sidecar was found beside the shard, and used (see
  // sidecar.hpp): a SidecarState.
  uint8_t sidecar = 0;

  // npy: the rows are the samples.
  NpyHeader npy;
};

// Groups members into samples. The key is the member's path up to the first
// dot of its base name, the field is the rest (WebDataset's naming). Every
// member of a key in the shard joins one sample, wherever it lies: archives
// written by `zip -r` or by tar without --sort=name store a sample's files
// apart. Samples keep the order in which their keys first appear, and each
// sample's members keep their order in the shard.
class SampleBuilder {
 public:
  SampleBuilder(ShardIndex& index, const std::string& path) : index_(index), path_(path) {}

  // `header_offset` is where the member's header is, for error messages.
  void add(const std::string& name, uint64_t header_offset, uint64_t offset, uint64_t length,
           uint64_t out_length, io::Codec codec, uint32_t crc);
  // Puts each sample's members together and checks that no sample has one
  // field twice.
  void finish();

 private:
  uint16_t field_id(const std::string& field, uint64_t header_offset);
  void group_by_sample();

  ShardIndex& index_;
  const std::string& path_;
  std::unordered_map<std::string, uint16_t> field_ids_;
  std::unordered_map<std::string, uint32_t> sample_of_key_;
  std::vector<uint32_t> member_sample_;
  std::vector<uint64_t> member_header_;  // where each member's header is
  bool grouped_ = true;                  // no key has come back after another one
};

// Each parser reads only headers, never the members' bytes, and throws
// FormatError (file and offset) on anything it cannot trust.
ShardIndex index_tar(WindowReader& in);
// Without locate_members only the central directory is read (what a remote
// shard's samples are, in one or two range requests); member offsets are 0.
ShardIndex index_zip(WindowReader& in, bool locate_members = true);
ShardIndex index_npy(WindowReader& in);
// The .npy header at `base` of `in` (a whole .npy file, or a .npy member of a shard of
// `length` bytes there), checked against those bytes; its data_offset is from `base`.
NpyHeader read_npy_header(WindowReader& in, uint64_t base, uint64_t length);
// MDS shards and LitData chunks: records behind an offset table, their columns
// described by the format string ("mds|name:size|..." or "litdata|...": see
// records.cpp). Each record is a sample (key: its number), each column a member.
ShardIndex index_records(WindowReader& in, const std::string& format);
bool is_record_format(const std::string& format);
// format: "tar", "zip", "npy", or a record format.
ShardIndex index_shard(WindowReader& in, const std::string& format, bool locate_members = true);
ShardIndex index_shard(const std::string& path, const std::string& format);

// Index many shards on `num_threads` threads; results in input order. The
// first failing shard (in input order) is the error thrown.
std::vector<ShardIndex> index_shards(const std::vector<std::string>& paths,
                                     const std::vector<std::string>& formats, size_t num_threads);

}  // namespace stoker::format
