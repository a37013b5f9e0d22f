#include "stoker/format/shard_index.hpp"

#include <algorithm>
#include <cctype>
#include <exception>

#include "stoker/errors.hpp"

namespace stoker::format {

void SampleBuilder::add(const std::string& raw_name, uint64_t header_offset, uint64_t offset,
                        uint64_t length, uint64_t out_length, io::Codec codec, uint32_t crc) {
  std::string_view name(raw_name);
  while (name.substr(0, 2) == "./") name.remove_prefix(2);
  if (name.empty() || name.back() == '/') return;  // a directory
  size_t slash = name.rfind('/');
  std::string_view dir =
      slash == std::string_view::npos ? std::string_view() : name.substr(0, slash + 1);
  std::string_view base = slash == std::string_view::npos ? name : name.substr(slash + 1);
  size_t dot = base.find('.');
  // No extension, or a dot file: nothing to call the field, so not a sample part.
  if (dot == std::string_view::npos || dot == 0) return;
  std::string_view stem = base.substr(0, dot);
  // __key__, __index__ and the like are metadata, not samples.
  if (stem.size() >= 4 && stem.substr(0, 2) == "__" && stem.substr(stem.size() - 2) == "__") return;

  std::string key;
  key.reserve(dir.size() + stem.size());
  key.append(dir).append(stem);
  std::string field(base.substr(dot + 1));
  for (char& c : field) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));

  if (index_.keys.empty() || index_.keys.back() != key) {
    if (!index_.keys.empty()) {
      index_.sample_start.push_back(static_cast<uint32_t>(index_.member_field.size()));
    }
    index_.keys.push_back(std::move(key));
    fields_in_sample_.clear();
  }
  uint16_t id = field_id(field, header_offset);
  if (std::find(fields_in_sample_.begin(), fields_in_sample_.end(), id) !=
      fields_in_sample_.end()) {
    throw FormatError(
        path_, header_offset,
        "sample '" + index_.keys.back() + "' has two members with field '" + field + "'");
  }
  fields_in_sample_.push_back(id);
  if (index_.member_field.size() >= UINT32_MAX) {
    throw FormatError(path_, header_offset, "too many members in one shard");
  }
  index_.member_field.push_back(id);
  index_.member_offset.push_back(offset);
  index_.member_length.push_back(length);
  index_.member_out_length.push_back(out_length);
  index_.member_codec.push_back(static_cast<uint8_t>(codec));
  index_.member_crc.push_back(crc);
}

void SampleBuilder::finish() {
  if (!index_.keys.empty()) {
    index_.sample_start.push_back(static_cast<uint32_t>(index_.member_field.size()));
  }
}

uint16_t SampleBuilder::field_id(const std::string& field, uint64_t header_offset) {
  auto it = field_ids_.find(field);
  if (it != field_ids_.end()) return it->second;
  if (index_.field_names.size() >= UINT16_MAX) {
    throw FormatError(path_, header_offset, "more than 65535 distinct field names in one shard");
  }
  auto id = static_cast<uint16_t>(index_.field_names.size());
  index_.field_names.push_back(field);
  field_ids_.emplace(field, id);
  return id;
}

ShardIndex index_shard(WindowReader& in, const std::string& format, bool locate_members) {
  if (format == "tar") return index_tar(in);
  if (format == "zip") return index_zip(in, locate_members);
  if (format == "npy") return index_npy(in);
  throw FormatError(in.path(), 0,
                    "unknown shard format '" + format + "' (expected tar, zip or npy)");
}

ShardIndex index_shard(const std::string& path, const std::string& format) {
  if (format != "tar" && format != "zip" && format != "npy") {
    throw FormatError(path, 0, "unknown shard format '" + format + "' (expected tar, zip or npy)");
  }
  WindowReader in(path);
  return index_shard(in, format);
}

std::vector<ShardIndex> index_shards(const std::vector<std::string>& paths,
                                     const std::vector<std::string>& formats, size_t num_threads) {
  if (paths.size() != formats.size())
    throw Error("index_shards: paths and formats differ in length");
  std::vector<ShardIndex> results(paths.size());
  std::vector<std::exception_ptr> errors(paths.size());
  io::parallel_for(paths.size(), num_threads, [&](size_t i) {
    try {
      results[i] = index_shard(paths[i], formats[i]);
    } catch (...) {
      errors[i] = std::current_exception();
    }
  });
  for (auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
  return results;
}

}  // namespace stoker::format
