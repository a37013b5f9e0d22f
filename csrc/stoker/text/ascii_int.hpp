// Integers written as ASCII text (WebDataset's .cls labels), parsed by the reader's
// threads straight into an int64 slot of the batch.
#pragma once

#include <cstdint>

#include "stoker/io/decoder.hpp"

namespace stoker::text {

// The codes of an integer's text as stored, and deflated (a zip's).
constexpr io::Codec kAsciiInt{2};
constexpr io::Codec kDeflateAsciiInt{3};

// The longest integer text a member may hold, whitespace included.
constexpr uint64_t kMaxIntText = 64;

// Registers both codes with the reader; again does nothing.
void register_decoders();

}  // namespace stoker::text
