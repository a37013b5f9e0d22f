#include "stoker/plan/keyed_permutation.hpp"

namespace stoker::plan {

namespace {

uint64_t mixed(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

void keyed_permutation(uint64_t n, const uint64_t* keys, size_t rounds, const int64_t* positions,
                       size_t count, int64_t* out) {
  if (n == 0) return;  // (no position lies below it)
  unsigned bits = 1;
  while (bits < 64 && (uint64_t{1} << bits) < n) ++bits;
  const unsigned half = (bits + 1) / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  for (size_t i = 0; i < count; ++i) {
    uint64_t x = static_cast<uint64_t>(positions[i]);
    do {  // a value past n is walked on; it comes back inside, as every cycle holds x
      uint64_t left = x >> half, right = x & mask;
      for (size_t r = 0; r < rounds; ++r) {
        uint64_t next = left ^ (mixed(right ^ keys[r]) & mask);
        left = right;
        right = next;
      }
      x = (left << half) | right;
    } while (x >= n);
    out[i] = static_cast<int64_t>(x);
  }
}

}  // namespace stoker::plan
