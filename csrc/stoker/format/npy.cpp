// .npy files (format versions 1, 2 and 3): each row along the first axis is
// one sample.
#include <cstring>
#include <string>

#include "stoker/errors.hpp"
#include "stoker/format/shard_index.hpp"
#include "stoker/format/window_reader.hpp"
#include "stoker/util/little_endian.hpp"

namespace stoker::format {

namespace {

// The header is a Python dict literal; this reads just the subset numpy
// writes: string, bool and integer-tuple values.
class HeaderParser {
 public:
  HeaderParser(const std::string& text, const std::string& path, uint64_t base)
      : s_(text), path_(path), base_(base) {}

  NpyHeader parse() {
    NpyHeader header;
    bool has_descr = false, has_order = false, has_shape = false;
    expect('{');
    for (;;) {
      skip_space();
      if (peek() == '}') break;
      std::string key = string_value();
      expect(':');
      skip_space();
      if (key == "descr") {
        if (peek() == '[') fail("structured dtypes are not supported");
        header.descr = string_value();
        has_descr = true;
      } else if (key == "fortran_order") {
        header.fortran_order = bool_value();
        has_order = true;
      } else if (key == "shape") {
        header.shape = shape_value();
        has_shape = true;
      } else {
        fail("unexpected key " + quoted(key));
      }
      skip_space();
      if (peek() == ',') {
        ++at_;
        continue;
      }
      if (peek() != '}') fail("expected ',' or '}'");
    }
    if (!has_descr || !has_order || !has_shape) {
      fail("header lacks one of 'descr', 'fortran_order', 'shape'");
    }
    return header;
  }

 private:
  [[noreturn]] void fail(const std::string& why) {
    throw FormatError(path_, base_ + at_, "bad .npy header: " + why);
  }
  char peek() { return at_ < s_.size() ? s_[at_] : '\0'; }
  void skip_space() {
    while (at_ < s_.size() && (s_[at_] == ' ' || s_[at_] == '\t' || s_[at_] == '\n')) ++at_;
  }
  void expect(char c) {
    skip_space();
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++at_;
  }
  std::string string_value() {
    skip_space();
    char quote = peek();
    if (quote != '\'' && quote != '"') fail("expected a string");
    size_t end = s_.find(quote, at_ + 1);
    if (end == std::string::npos) fail("unterminated string");
    std::string value = s_.substr(at_ + 1, end - at_ - 1);
    at_ = end + 1;
    return value;
  }
  bool bool_value() {
    if (s_.compare(at_, 4, "True") == 0) {
      at_ += 4;
      return true;
    }
    if (s_.compare(at_, 5, "False") == 0) {
      at_ += 5;
      return false;
    }
    fail("expected True or False");
  }
  std::vector<uint64_t> shape_value() {
    expect('(');
    std::vector<uint64_t> shape;
    for (;;) {
      skip_space();
      if (peek() == ')') break;
      if (peek() < '0' || peek() > '9') fail("shape must be a tuple of non-negative integers");
      uint64_t n = 0;
      while (peek() >= '0' && peek() <= '9') {
        if (n > (UINT64_MAX - 9) / 10) fail("dimension too large");
        n = n * 10 + (s_[at_++] - '0');
      }
      if (peek() == 'L') ++at_;  // written by Python 2
      shape.push_back(n);
      skip_space();
      if (peek() == ',') {
        ++at_;
        continue;
      }
      if (peek() != ')') fail("expected ',' or ')' in shape");
    }
    ++at_;
    return shape;
  }

  const std::string& s_;
  const std::string& path_;
  uint64_t base_;
  size_t at_ = 0;
};

// Bytes per element of a simple numpy dtype string ("<f4", "|b1", "<U10",
// "<M8[ns]"); 0 for anything stoker does not read (objects, structs).
uint64_t itemsize_of(const std::string& descr) {
  size_t i = 0;
  if (i < descr.size() && std::strchr("<>|=", descr[i])) ++i;
  if (i >= descr.size()) return 0;
  char kind = descr[i++];
  if (!std::strchr("biufcSUVmM", kind)) return 0;
  uint64_t n = 0;
  size_t digits = 0;
  while (i < descr.size() && descr[i] >= '0' && descr[i] <= '9') {
    if (++digits > 12) return 0;
    n = n * 10 + (descr[i++] - '0');
  }
  if (digits == 0) return 0;
  // Only the sizes numpy has for each kind: "<i3" or "<f5" is no array numpy could load.
  auto one_of = [n](std::initializer_list<uint64_t> sizes) {
    for (uint64_t s : sizes) {
      if (n == s) return true;
    }
    return false;
  };
  switch (kind) {
    case 'b':
      if (n != 1) return 0;
      break;
    case 'i':
    case 'u':
      if (!one_of({1, 2, 4, 8})) return 0;
      break;
    case 'f':
      if (!one_of({2, 4, 8, 16})) return 0;
      break;
    case 'c':
      if (!one_of({8, 16, 32})) return 0;
      break;
    case 'm':
    case 'M':
      if (n != 8) return 0;
      break;
    default:
      break;
  }
  if ((kind == 'm' || kind == 'M') && i < descr.size() && descr[i] == '[') {
    size_t close = descr.find(']', i);
    if (close == std::string::npos) return 0;
    static const char* const kUnits[] = {"Y",  "M",  "W",  "D",  "h",  "m",  "s",
                                         "ms", "us", "ns", "ps", "fs", "as", "generic"};
    std::string unit = descr.substr(i + 1, close - i - 1);
    // An optional count before the unit ("10ms") is allowed, as numpy allows it.
    size_t start = 0;
    while (start < unit.size() && unit[start] >= '0' && unit[start] <= '9') ++start;
    bool known = false;
    for (const char* u : kUnits) known = known || unit.substr(start) == u;
    if (!known) return 0;
    i = close + 1;
  }
  if (i != descr.size()) return 0;
  return kind == 'U' ? n * 4 : n;
}

bool mul_overflows(uint64_t a, uint64_t b, uint64_t& out) {
  if (a != 0 && b > UINT64_MAX / a) return true;
  out = a * b;
  return false;
}

}  // namespace

NpyHeader read_npy_header(WindowReader& in, uint64_t base, uint64_t length) {
  const std::string& path = in.path();
  if (length < 10) throw FormatError(path, base, "too short to be a .npy file");
  const uint8_t* pre = in.at(base, 10, ".npy preamble");
  if (std::memcmp(pre, "\x93NUMPY", 6) != 0) {
    throw FormatError(path, base, "bad magic: not a .npy file");
  }
  uint8_t major = pre[6], minor = pre[7];
  uint64_t header_length, header_start;
  if (major == 1) {
    header_length = util::le16(pre + 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (length < 12) throw FormatError(path, base, "too short to be a .npy file");
    header_length = util::le32(in.at(base + 8, 4, ".npy header length"));
    header_start = 12;
  } else {
    throw FormatError(
        path, base + 6,
        "unsupported .npy format version " + std::to_string(major) + "." + std::to_string(minor));
  }
  if (header_length > length - header_start) {
    throw FormatError(path, base + header_start, "truncated: the .npy header runs past the end");
  }
  const uint8_t* text = in.at(base + header_start, header_length, ".npy header");
  std::string header_text(reinterpret_cast<const char*>(text), header_length);
  NpyHeader header = HeaderParser(header_text, path, base + header_start).parse();
  header.data_offset = header_start + header_length;
  header.itemsize = itemsize_of(header.descr);
  if (header.itemsize == 0) {
    throw FormatError(path, base + header_start,
                      "dtype " + quoted(header.descr) +
                          " is not supported (numeric, bool, bytes, "
                          "unicode, datetime; not object or structured)");
  }
  uint64_t elements = 1;
  for (uint64_t d : header.shape) {
    if (mul_overflows(elements, d, elements)) {
      throw FormatError(path, base + header_start, "shape overflows");
    }
  }
  if (mul_overflows(elements, header.itemsize, header.data_bytes)) {
    throw FormatError(path, base + header_start, "shape overflows");
  }
  // Arrays of zero-byte rows cost nothing on disk, so the file cannot bound their
  // number; refuse counts no real array needs.
  constexpr uint64_t kMaxEmptyRows = 1ull << 24;
  if (header.data_bytes == 0 && !header.shape.empty() && header.shape[0] > kMaxEmptyRows) {
    throw FormatError(path, base + header_start,
                      "refusing " + std::to_string(header.shape[0]) + " rows of zero bytes each");
  }
  if (header.data_bytes > length - header.data_offset) {
    throw FormatError(path, base + header.data_offset,
                      "truncated: the header declares " + std::to_string(header.data_bytes) +
                          " bytes of data but the file holds " +
                          std::to_string(length - header.data_offset));
  }
  return header;
}

ShardIndex index_npy(WindowReader& in) {
  const std::string& path = in.path();
  ShardIndex index("npy", in.identity());
  NpyHeader header = read_npy_header(in, 0, in.size());
  if (header.shape.empty()) {
    throw FormatError(path, 0, "a 0-d array has no rows to use as samples");
  }
  int long_axes = 0;
  for (uint64_t d : header.shape) long_axes += d > 1;
  // In Fortran order a row is strided through the whole file; it is only
  // contiguous (and the same bytes as C order) when at most one axis is long.
  if (header.fortran_order && long_axes > 1) {
    throw FormatError(path, 0,
                      "Fortran-ordered array: its rows are not contiguous on disk, so they "
                      "cannot be read as samples. Re-save it with "
                      "numpy.save(path, numpy.ascontiguousarray(a))");
  }
  header.row_bytes = header.shape[0] ? header.data_bytes / header.shape[0] : 0;
  index.npy = std::move(header);
  return index;
}

}  // namespace stoker::format
