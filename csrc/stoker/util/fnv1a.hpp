// FNV-1a, 64 bits: a quick key for telling things apart that are usually equal or
// usually different (Parquet files' layouts, JPEG tiles' Huffman tables), never a defence
// against anyone.
#pragma once

#include <cstddef>
#include <cstdint>

namespace stoker::util {

class Fnv1a {
 public:
  void add(const void* data, size_t size) {
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < size; ++i) {
      hash_ ^= p[i];
      hash_ *= 0x100000001b3ull;
    }
  }
  uint64_t value() const { return hash_; }

 private:
  uint64_t hash_ = 0xcbf29ce484222325ull;
};

}  // namespace stoker::util
