// Zip read through its central directory (zip64 included). Stored members are
// byte ranges read in place; deflated ones are inflated by the reader.
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "stoker/errors.hpp"
#include "stoker/format/shard_index.hpp"
#include "stoker/format/window_reader.hpp"
#include "stoker/util/little_endian.hpp"

namespace stoker::format {

namespace {

constexpr uint32_t kEndOfCentralDirectory = 0x06054b50;
constexpr uint32_t kZip64EndLocator = 0x07064b50;
constexpr uint32_t kZip64End = 0x06064b50;
constexpr uint32_t kCentralEntry = 0x02014b50;
constexpr uint32_t kLocalHeader = 0x04034b50;
constexpr uint64_t kEndSize = 22;
constexpr uint64_t kMaxComment = 65535;

struct CentralDirectory {
  uint64_t offset;
  uint64_t size;
  uint64_t entries;
  uint64_t end;  // where the records after the directory start
};

CentralDirectory find_central_directory(WindowReader& in) {
  const std::string& path = in.path();
  uint64_t size = in.size();
  if (size < kEndSize) {
    throw FormatError(path, 0, "too short to be a zip file (" + std::to_string(size) + " bytes)");
  }
  uint64_t tail_length = std::min(size, kEndSize + kMaxComment);
  uint64_t tail_start = size - tail_length;
  const uint8_t* tail_bytes = in.at(tail_start, tail_length, "zip tail");
  std::vector<uint8_t> tail(tail_bytes, tail_bytes + tail_length);
  // The end record is the last signature whose comment reaches the end of
  // the file exactly (a comment may itself contain the signature bytes).
  int64_t found = -1;
  for (int64_t i = static_cast<int64_t>(tail_length - kEndSize); i >= 0; --i) {
    if (util::le32(&tail[i]) == kEndOfCentralDirectory &&
        i + kEndSize + util::le16(&tail[i + 20]) == tail_length) {
      found = i;
      break;
    }
  }
  if (found < 0) {
    throw FormatError(path, size,
                      "no end of central directory record: not a zip file, or truncated");
  }
  const uint8_t* end = &tail[found];
  uint64_t end_pos = tail_start + found;
  if (util::le16(end + 4) != 0 || util::le16(end + 6) != 0) {
    throw FormatError(path, end_pos, "multi-disk zip archives are not supported");
  }
  CentralDirectory cd{util::le32(end + 16), util::le32(end + 12), util::le16(end + 10), end_pos};

  if (end_pos >= 20) {
    const uint8_t* locator = in.at(end_pos - 20, 20, "zip64 end locator");
    if (util::le32(locator) == kZip64EndLocator) {
      uint64_t record_pos = util::le64(locator + 8);
      if (record_pos + 56 > end_pos - 20) {
        throw FormatError(path, end_pos - 20, "zip64 end locator points past the end record");
      }
      const uint8_t* record = in.at(record_pos, 56, "zip64 end record");
      if (util::le32(record) != kZip64End) {
        throw FormatError(path, record_pos, "bad zip64 end of central directory signature");
      }
      cd = CentralDirectory{util::le64(record + 48), util::le64(record + 40),
                            util::le64(record + 32), record_pos};
    }
  }
  if (cd.offset > cd.end || cd.size > cd.end - cd.offset) {
    throw FormatError(path, end_pos,
                      "central directory (" + std::to_string(cd.size) + " bytes at offset " +
                          std::to_string(cd.offset) + ") does not fit before its end record at " +
                          std::to_string(cd.end) + ": truncated or corrupt");
  }
  return cd;
}

struct Entry {
  std::string name;
  uint64_t entry_pos;
  uint16_t flags;
  uint16_t method;
  uint32_t crc;
  uint64_t compressed;
  uint64_t uncompressed;
  uint64_t local_header;
  bool is_link;
};

std::vector<Entry> read_entries(WindowReader& in, const CentralDirectory& cd) {
  const std::string& path = in.path();
  const uint8_t* start = in.at(cd.offset, cd.size, "central directory");
  std::vector<uint8_t> dir(start, start + cd.size);
  std::vector<Entry> entries;
  entries.reserve(std::min<uint64_t>(cd.entries, cd.size / 46));
  uint64_t at = 0;
  for (uint64_t e = 0; e < cd.entries; ++e) {
    uint64_t pos = cd.offset + at;
    if (cd.size - at < 46 || util::le32(&dir[at]) != kCentralEntry) {
      throw FormatError(path, pos,
                        "broken central directory: entry " + std::to_string(e) + " of " +
                            std::to_string(cd.entries) + " is missing or has a bad signature");
    }
    const uint8_t* h = &dir[at];
    uint16_t name_length = util::le16(h + 28), extra_length = util::le16(h + 30),
             comment_length = util::le16(h + 32);
    if (cd.size - at - 46 < uint64_t(name_length) + extra_length + comment_length) {
      throw FormatError(path, pos, "broken central directory: entry runs past its end");
    }
    Entry entry;
    entry.entry_pos = pos;
    entry.name.assign(reinterpret_cast<const char*>(h + 46), name_length);
    entry.flags = util::le16(h + 8);
    entry.method = util::le16(h + 10);
    entry.crc = util::le32(h + 16);
    entry.compressed = util::le32(h + 20);
    entry.uncompressed = util::le32(h + 24);
    entry.local_header = util::le32(h + 42);
    uint32_t disk = util::le16(h + 34);
    uint16_t host = util::le16(h + 4) >> 8;
    uint32_t mode = util::le32(h + 38) >> 16;
    entry.is_link = host == 3 && S_ISLNK(mode);

    // zip64: the fields saturated at 0xFFFFFFFF come, in order, from extra 0x0001.
    const uint8_t* extra = h + 46 + name_length;
    for (uint32_t x = 0; x + 4 <= extra_length;) {
      uint16_t id = util::le16(extra + x), length = util::le16(extra + x + 2);
      if (x + 4 + length > extra_length) {
        throw FormatError(path, pos, "broken central directory: extra field runs past its entry");
      }
      if (id == 0x0001) {
        const uint8_t* v = extra + x + 4;
        uint32_t left = length;
        auto take = [&](uint64_t& field) {
          if (left < 8) throw FormatError(path, pos, "broken zip64 extra field");
          field = util::le64(v);
          v += 8;
          left -= 8;
        };
        if (entry.uncompressed == 0xFFFFFFFF) take(entry.uncompressed);
        if (entry.compressed == 0xFFFFFFFF) take(entry.compressed);
        if (entry.local_header == 0xFFFFFFFF) take(entry.local_header);
        if (disk == 0xFFFF && left >= 4) disk = util::le32(v);
      }
      x += 4 + length;
    }
    if (disk != 0) throw FormatError(path, pos, "member on another disk: multi-disk zip");
    entries.push_back(std::move(entry));
    at += 46 + name_length + extra_length + comment_length;
  }
  return entries;
}

}  // namespace

ShardIndex index_zip(WindowReader& in, bool locate_members) {
  const std::string& path = in.path();
  ShardIndex index("zip", in.identity());
  CentralDirectory cd = find_central_directory(in);
  std::vector<Entry> entries = read_entries(in, cd);

  SampleBuilder samples(index, path);
  for (const Entry& e : entries) {
    if (e.is_link || e.name.empty() || e.name.back() == '/') continue;
    if (e.flags & 0x1) {
      throw FormatError(path, e.entry_pos,
                        "member " + quoted(e.name) + " is encrypted (not supported)");
    }
    io::Codec codec;
    if (e.method == 0) {
      codec = io::Codec::kStored;
      if (e.compressed != e.uncompressed) {
        throw FormatError(path, e.entry_pos,
                          "stored member " + quoted(e.name) + " has compressed size " +
                              std::to_string(e.compressed) + " but size " +
                              std::to_string(e.uncompressed));
      }
    } else if (e.method == 8) {
      codec = io::Codec::kDeflate;
      // Deflate cannot expand more than about 1032:1; a larger claim is a lie
      // that would only make us allocate for bytes that cannot come.
      if (e.uncompressed / 1032 > e.compressed + 1) {
        throw FormatError(path, e.entry_pos,
                          "deflated member " + quoted(e.name) + " declares " +
                              std::to_string(e.uncompressed) + " bytes from " +
                              std::to_string(e.compressed) +
                              " compressed, more than deflate can produce");
      }
    } else {
      throw FormatError(path, e.entry_pos,
                        "member " + quoted(e.name) + " uses compression method " +
                            std::to_string(e.method) +
                            "; only stored (0) and deflate (8) are supported");
    }
    if (e.local_header >= cd.offset) {
      throw FormatError(path, e.entry_pos,
                        "member " + quoted(e.name) + " has its local header at " +
                            std::to_string(e.local_header) + ", past the central directory");
    }
    if (!locate_members) {
      samples.add(e.name, e.local_header, 0, e.compressed, e.uncompressed, codec, e.crc);
      continue;
    }
    const uint8_t* local = in.at(e.local_header, 30, "zip local header");
    if (util::le32(local) != kLocalHeader) {
      throw FormatError(path, e.local_header,
                        "bad local header signature for member " + quoted(e.name));
    }
    uint64_t data = e.local_header + 30 + util::le16(local + 26) + util::le16(local + 28);
    if (data > cd.offset || e.compressed > cd.offset - data) {
      throw FormatError(path, e.local_header,
                        "member " + quoted(e.name) + " (" + std::to_string(e.compressed) +
                            " bytes at offset " + std::to_string(data) +
                            ") runs into the central directory: truncated or corrupt");
    }
    samples.add(e.name, e.local_header, data, e.compressed, e.uncompressed, codec, e.crc);
  }
  samples.finish();
  return index;
}

}  // namespace stoker::format
