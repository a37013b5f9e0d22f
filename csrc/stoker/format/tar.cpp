// Tar in the WebDataset convention: ustar, GNU long names and pax headers.
#include <cstring>
#include <string>

#include "stoker/errors.hpp"
#include "stoker/format/shard_index.hpp"
#include "stoker/format/window_reader.hpp"

namespace stoker::format {

namespace {

constexpr uint64_t kBlock = 512;
// Long names and pax headers are read whole into memory: bound them.
constexpr uint64_t kMaxMetadata = 1 << 20;

bool all_zero(const uint8_t* block) {
  for (uint64_t i = 0; i < kBlock; ++i) {
    if (block[i] != 0) return false;
  }
  return true;
}

std::string field_string(const uint8_t* field, size_t width) {
  const auto* begin = reinterpret_cast<const char*>(field);
  return std::string(begin, strnlen(begin, width));
}

// A numeric header field: octal text, or GNU's base-256 for large values.
bool parse_number(const uint8_t* field, size_t width, uint64_t& out) {
  if (field[0] & 0x80) {
    if (field[0] == 0xff) return false;  // negative
    uint64_t value = field[0] & 0x7f;
    for (size_t i = 1; i < width; ++i) {
      if (value >> 56) return false;
      value = (value << 8) | field[i];
    }
    out = value;
    return true;
  }
  size_t i = 0;
  while (i < width && field[i] == ' ') ++i;
  uint64_t value = 0;
  for (; i < width && field[i] != 0 && field[i] != ' '; ++i) {
    if (field[i] < '0' || field[i] > '7' || (value >> 61)) return false;
    value = value * 8 + (field[i] - '0');
  }
  for (; i < width; ++i) {  // only terminators may follow the digits
    if (field[i] != 0 && field[i] != ' ') return false;
  }
  out = value;
  return true;
}

void check_checksum(const uint8_t* h, const std::string& path, uint64_t pos) {
  uint64_t stored;
  if (!parse_number(h + 148, 8, stored)) {
    throw FormatError(path, pos, "bad tar header: checksum field is not a number");
  }
  // The checksum is the header's byte sum with its own field read as spaces;
  // some old writers summed signed bytes, which tarfile also accepts.
  int64_t unsigned_sum = 8 * ' ';
  int64_t signed_sum = 8 * ' ';
  for (uint64_t i = 0; i < kBlock; ++i) {
    if (i >= 148 && i < 156) continue;
    unsigned_sum += h[i];
    signed_sum += static_cast<int8_t>(h[i]);
  }
  if (static_cast<int64_t>(stored) != unsigned_sum && static_cast<int64_t>(stored) != signed_sum) {
    throw FormatError(path, pos,
                      "bad tar header checksum: stored " + std::to_string(stored) + ", computed " +
                          std::to_string(unsigned_sum) + " (corrupt or not a tar file)");
  }
}

struct PaxOverrides {
  bool has_path = false;
  std::string path;
  bool has_size = false;
  uint64_t size = 0;
};

// Pax records: "<length> <key>=<value>\n", length counting the whole record.
PaxOverrides parse_pax(const uint8_t* data, uint64_t size, const std::string& path, uint64_t pos) {
  PaxOverrides pax;
  const char* p = reinterpret_cast<const char*>(data);
  uint64_t at = 0;
  auto bad = [&](const char* why) {
    return FormatError(path, pos, std::string("bad pax extended header: ") + why);
  };
  while (at < size) {
    if (p[at] == 0) break;  // padding after the last record
    uint64_t length = 0;
    uint64_t i = at;
    while (i < size && p[i] >= '0' && p[i] <= '9') {
      if (length > (1ull << 40)) throw bad("record length overflows");
      length = length * 10 + (p[i] - '0');
      ++i;
    }
    if (i == at || i >= size || p[i] != ' ') throw bad("record does not start with a length");
    if (length < i - at + 2 || at + length > size || p[at + length - 1] != '\n') {
      throw bad("record length does not match its text");
    }
    std::string record(p + i + 1, p + at + length - 1);
    size_t eq = record.find('=');
    if (eq == std::string::npos) throw bad("record has no '='");
    std::string key = record.substr(0, eq);
    std::string value = record.substr(eq + 1);
    if (key == "path") {
      pax.has_path = true;
      pax.path = value;
    } else if (key == "size") {
      uint64_t n = 0;
      if (value.empty() || value.size() > 19) throw bad("size is not a number");
      for (char c : value) {
        if (c < '0' || c > '9') throw bad("size is not a number");
        n = n * 10 + (c - '0');
      }
      pax.has_size = true;
      pax.size = n;
    }
    at += length;
  }
  return pax;
}

}  // namespace

ShardIndex index_tar(WindowReader& in) {
  const std::string& path = in.path();
  ShardIndex index("tar", in.identity());
  SampleBuilder samples(index, path);
  if (in.size() == 0) throw FormatError(path, 0, "empty file: not a tar archive");

  std::string long_name;  // from a GNU 'L' member, for the next header
  PaxOverrides pax;       // from a pax 'x' member, for the next header
  uint64_t pos = 0;
  // A tar without its closing zero blocks is accepted, as tarfile does.
  while (pos + kBlock <= in.size()) {
    const uint8_t* h = in.at(pos, kBlock, "tar header");
    if (all_zero(h)) break;  // end-of-archive marker
    check_checksum(h, path, pos);
    uint64_t size;
    if (!parse_number(h + 124, 12, size)) {
      throw FormatError(path, pos, "bad tar header: size field is not a number");
    }
    char type = static_cast<char>(h[156]);
    if (pax.has_size && type != 'x' && type != 'g' && type != 'L') size = pax.size;

    std::string name;
    if (pax.has_path) {
      name = pax.path;
    } else if (!long_name.empty()) {
      name = long_name;
    } else {
      name = field_string(h, 100);
      // POSIX ustar splits long paths into prefix + name; GNU's magic
      // ("ustar  ") uses those bytes for other things.
      if (std::memcmp(h + 257, "ustar\0", 6) == 0 && h[345] != 0) {
        name = field_string(h + 345, 155) + "/" + name;
      }
    }

    uint64_t data = pos + kBlock;
    if (size > in.size() - data) {
      throw FormatError(path, pos,
                        "member " + quoted(name) + " of " + std::to_string(size) +
                            " bytes runs past the end of the file (" + std::to_string(in.size()) +
                            " bytes): truncated shard");
    }
    uint64_t next = data + (size + kBlock - 1) / kBlock * kBlock;
    if ((type == 'L' || type == 'K' || type == 'x' || type == 'g') && size > kMaxMetadata) {
      throw FormatError(path, pos,
                        "tar metadata member of " + std::to_string(size) +
                            " bytes (a long name or pax header) is implausibly large");
    }

    switch (type) {
      case 'L':  // GNU long name of the next member
        long_name = field_string(in.at(data, size, "GNU long name"), size);
        pos = next;
        continue;
      case 'K':  // GNU long link name: links are skipped anyway
        pos = next;
        continue;
      case 'x':
        pax = parse_pax(in.at(data, size, "pax extended header"), size, path, pos);
        pos = next;
        continue;
      case 'g':  // global pax header: nothing in it changes where bytes are
        pos = next;
        continue;
      case 'S':
        throw FormatError(path, pos, "GNU sparse member " + quoted(name) + " is not supported");
      case '0':
      case '\0':
      case '7':  // contiguous file: a regular file everywhere that matters
        samples.add(name, pos, data, size, size, io::Codec::kStored, 0);
        break;
      default:  // directories, links, devices, fifos: not sample data
        break;
    }
    long_name.clear();
    pax = PaxOverrides();
    pos = next;
  }
  if (pos > in.size()) {
    // tar pads every member to whole blocks: a file that ends inside the
    // padding was cut short, even though the last member's bytes are there.
    throw FormatError(path, in.size(), "truncated: the file ends inside a member's block padding");
  }
  if (pos < in.size() && pos + kBlock > in.size()) {
    // A partial header after the last member is a truncation, unless it is
    // the zero padding some writers leave short.
    const uint8_t* rest = in.at(pos, in.size() - pos, "tar trailer");
    for (uint64_t i = 0; i < in.size() - pos; ++i) {
      if (rest[i] != 0)
        throw FormatError(path, pos, "truncated: partial tar header at end of file");
    }
  }
  samples.finish();
  return index;
}

}  // namespace stoker::format
