#include "stoker/format/shard_index.hpp"

#include <algorithm>
#include <cctype>
#include <exception>

#include "stoker/errors.hpp"
#include "stoker/format/sidecar.hpp"
#include "stoker/io/thread_pool.hpp"

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

  if (index_.member_field.size() >= UINT32_MAX) {
    throw FormatError(path_, header_offset, "too many members in one shard");
  }
  uint32_t sample;
  if (!member_sample_.empty() && index_.keys[member_sample_.back()] == key) {
    sample = member_sample_.back();  // the common case: the run goes on
  } else {
    auto [it, is_new] =
        sample_of_key_.try_emplace(std::move(key), static_cast<uint32_t>(index_.keys.size()));
    sample = it->second;
    if (is_new) {
      index_.keys.push_back(it->first);
    } else {
      grouped_ = false;
    }
    ++index_.key_runs;
  }
  member_sample_.push_back(sample);
  member_header_.push_back(header_offset);
  index_.member_field.push_back(field_id(field, header_offset));
  index_.member_offset.push_back(offset);
  index_.member_length.push_back(length);
  index_.member_out_length.push_back(out_length);
  index_.member_codec.push_back(static_cast<uint8_t>(codec));
  index_.member_crc.push_back(crc);
}

// A stable counting sort of the members by sample: O(members), and nothing
// moves when the shard was in key order already.
void SampleBuilder::group_by_sample() {
  size_t samples = index_.keys.size();
  std::vector<uint32_t> start(samples + 1, 0);
  for (uint32_t s : member_sample_) ++start[s + 1];
  for (size_t s = 0; s < samples; ++s) start[s + 1] += start[s];
  index_.sample_start = start;
  if (grouped_) return;
  std::vector<uint32_t> order(member_sample_.size());
  for (size_t m = 0; m < member_sample_.size(); ++m) order[start[member_sample_[m]]++] = m;
  auto permute = [&order](auto& column) {
    std::remove_reference_t<decltype(column)> sorted(column.size());
    for (size_t i = 0; i < order.size(); ++i) sorted[i] = column[order[i]];
    column.swap(sorted);
  };
  permute(index_.member_field);
  permute(index_.member_offset);
  permute(index_.member_length);
  permute(index_.member_out_length);
  permute(index_.member_codec);
  permute(index_.member_crc);
  permute(member_header_);
}

void SampleBuilder::finish() {
  group_by_sample();
  // One field twice in a sample: say where the second one is.
  std::vector<uint32_t> last_sample(index_.field_names.size(), UINT32_MAX);
  for (uint32_t s = 0; s + 1 < index_.sample_start.size(); ++s) {
    for (uint32_t m = index_.sample_start[s]; m < index_.sample_start[s + 1]; ++m) {
      uint16_t field = index_.member_field[m];
      if (last_sample[field] == s) {
        throw FormatError(path_, member_header_[m],
                          "sample " + quoted(index_.keys[s]) + " has two members with field " +
                              quoted(index_.field_names[field]));
      }
      last_sample[field] = s;
    }
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
  if (is_record_format(format)) return index_records(in, format);
  throw FormatError(in.path(), 0,
                    "unknown shard format '" + format + "' (expected tar, zip or npy)");
}

ShardIndex index_shard(const std::string& path, const std::string& format) {
  if (is_record_format(format)) {
    WindowReader in(path);
    return index_records(in, format);
  }
  if (format != "tar" && format != "zip" && format != "npy") {
    throw FormatError(path, 0, "unknown shard format '" + format + "' (expected tar, zip or npy)");
  }
  WindowReader in(path);
  if (format == "npy") return index_shard(in, format);
  ShardIndex index;
  SidecarState state;
  if (read_sidecar(path, in.identity(), index, state)) {
    if (index.format == format) return index;
    state = SidecarState::kStale;  // the index of a shard of another format
  }
  index = index_shard(in, format);
  index.sidecar = static_cast<uint8_t>(state);
  return index;
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
