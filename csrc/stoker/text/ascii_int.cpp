#include "stoker/text/ascii_int.hpp"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "stoker/errors.hpp"

namespace stoker::text {

namespace {

// Optional whitespace, an optional sign, 1 to 18 digits, optional whitespace.
class AsciiIntDecoder final : public io::FieldDecoder {
 public:
  uint64_t output_bytes() const override { return sizeof(int64_t); }
  uint64_t max_input_bytes() const override { return kMaxIntText; }
  const char* input_name() const override { return "an integer's text"; }

  void decode(const uint8_t* src, uint64_t length, uint64_t /*seed*/, uint8_t* dest,
              const std::string& path, uint64_t offset) const override {
    auto space = [](uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
    uint64_t i = 0, end = length;
    while (i < end && space(src[i])) ++i;
    while (end > i && space(src[end - 1])) --end;
    bool negative = false;
    if (i < end && (src[i] == '-' || src[i] == '+')) negative = src[i++] == '-';
    int64_t value = 0;
    uint64_t digits = end - i;
    bool ok = digits >= 1 && digits <= 18;
    for (; ok && i < end; ++i) {
      if (src[i] < '0' || src[i] > '9') ok = false;
      value = value * 10 + (src[i] - '0');
    }
    if (!ok) {
      std::string text(reinterpret_cast<const char*>(src), std::min<uint64_t>(length, 40));
      throw FormatError(path, offset, "not an integer: " + quoted(text));
    }
    value = negative ? -value : value;
    std::memcpy(dest, &value, sizeof value);
  }
};

}  // namespace

void register_decoders() {
  auto decoder = std::make_shared<const AsciiIntDecoder>();
  io::register_codec({kAsciiInt, "ASCII_INT", false, decoder, false});
  io::register_codec({kDeflateAsciiInt, "DEFLATE_ASCII_INT", true, decoder, false});
}

}  // namespace stoker::text
