#pragma once

#include <cstdint>
#include <string>

namespace stoker::io {

// Inflates a raw deflate stream into exactly `dest_length` bytes. A stream
// that would produce more (a decompression bomb, or a lying header) stops at
// the limit and is refused, so memory stays bounded by what the index says.
// `path` and `offset` only name the member in errors.
void inflate_exact(const uint8_t* src, uint64_t src_length, uint8_t* dest, uint64_t dest_length,
                   const std::string& path, uint64_t offset);

uint32_t crc32_of(const uint8_t* data, uint64_t length);

}  // namespace stoker::io
