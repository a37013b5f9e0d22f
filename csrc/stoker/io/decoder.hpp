// Field decoders and the codes requests name them by. The reader reads bytes,
// inflates deflated members and gathers array rows and boxes by itself; everything that
// turns a member's bytes into a value (an integer from its text, an image
// decoded and resized) is a decoder registered from above, so this layer knows
// none of them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace stoker::io {

// Makes one member's bytes into a value of fixed size in that member's slot of a
// batch buffer, on the reader's threads. Its options (an image's size and crop)
// are fixed when it is made, so its output size is known before anything is read.
class FieldDecoder {
 public:
  virtual ~FieldDecoder() = default;

  // The bytes one decoded member takes in the batch.
  virtual uint64_t output_bytes() const = 0;
  // The most encoded bytes it accepts: a deflated member that says it inflates to
  // more is refused unread.
  virtual uint64_t max_input_bytes() const = 0;
  // What its input is, for messages: "an encoded image".
  virtual const char* input_name() const = 0;
  // Decoding costs far more than reading (an image: about a millisecond), so the
  // reader gives each such member a unit of work of its own and a batch of them
  // spreads over every thread.
  virtual bool slow() const { return false; }
  // A member that does not decode becomes zeros, noted in the batch, instead of
  // failing the batch.
  virtual bool blank_on_error() const { return false; }

  // Decodes `size` bytes at `src` into output_bytes() bytes at `dest`. `seed` is
  // the request's, for decoders whose output is random (a crop). Throws
  // FormatError naming `path` and `offset` for bytes it cannot decode.
  virtual void decode(const uint8_t* src, uint64_t size, uint64_t seed, uint8_t* dest,
                      const std::string& path, uint64_t offset) const = 0;
};

// A code of ReadRequest::codec, of the member table's codec column and of
// stoker._core.Codec. The reader's own are named here; decoders register theirs.
enum class Codec : uint8_t {
  kStored = 0,    // bytes are used as they are on disk
  kDeflate = 1,   // raw deflate (zip method 8), inflated into the destination
  kArrayRow = 6,  // row `offset` of FileTable::arrays[array] (array_rows.hpp)
  kArrayBox = 7,  // the box ReadRequest::box of FileTable::arrays[array] (array_rows.hpp)
  // Row `offset` of column FileTable::columns[array] (column_rows.hpp): its value copied,
  // or handed to the request's decoder (an image's, an integer's).
  kColumnValue = 8,
  // A span of a file read whole, of which the request's decoder (span_box_decoder in
  // strided_copy.hpp) copies a strided box into the request's place.
  kSpanBox = 9,
};

struct CodecEntry {
  Codec code = Codec::kStored;
  const char* name = "";  // as stoker._core.Codec names it
  bool deflated = false;  // the member is raw deflate, inflated before it is decoded
  // The decoder of every request with this code, when it takes no options. Null
  // for the reader's own codes, and for decoders made per field from its options
  // (an image's): each request then brings its own (ReadRequest::decoder).
  std::shared_ptr<const FieldDecoder> decoder;
  bool per_field = false;  // requests must bring their decoder
};

// Registers `entry` under its code for the life of the process. Registering the
// same name under the same code again does nothing; another name throws Error.
void register_codec(CodecEntry entry);
// The entry of `code`, or null when nothing registered it. Safe on any thread.
const CodecEntry* find_codec(Codec code);
// Every registered code, in order.
std::vector<const CodecEntry*> registered_codecs();

}  // namespace stoker::io
