#include "stoker/plan/keyed_draws.hpp"

namespace stoker::plan {

namespace {

// SeedSequence's hash constants and its pool of four 32-bit words.
constexpr uint32_t kInitA = 0x43b0d7e5, kMultA = 0x931e8875;
constexpr uint32_t kInitB = 0x8b51f9dd, kMultB = 0x58f38ded;
constexpr uint32_t kMixLeft = 0xca01f9dd, kMixRight = 0x4973f715;
constexpr int kShift = 16;
constexpr size_t kPool = 4;

uint32_t hash_word(uint32_t value, uint32_t& multiplier) {
  value ^= multiplier;
  multiplier *= kMultA;
  value *= multiplier;
  return value ^ (value >> kShift);
}

uint32_t mix(uint32_t x, uint32_t y) {
  uint32_t r = kMixLeft * x - kMixRight * y;
  return r ^ (r >> kShift);
}

using u128 = unsigned __int128;
// PCG64's 128-bit LCG multiplier.
constexpr u128 kPcgMultiplier = (u128(0x2360ed051fc65da4ULL) << 64) | 0x4385df649fccf645ULL;

}  // namespace

void keyed_uniforms(const uint32_t* prefix, size_t prefix_words, const uint32_t* tails,
                    size_t tail_words, size_t n, size_t count, double* out) {
  const size_t words = prefix_words + tail_words;
  for (size_t item = 0; item < n; ++item) {
    const uint32_t* tail = tails + item * tail_words;
    auto word = [&](size_t j) { return j < prefix_words ? prefix[j] : tail[j - prefix_words]; };
    // The entropy mixed into the pool.
    uint32_t pool[kPool];
    uint32_t multiplier = kInitA;
    for (size_t i = 0; i < kPool; ++i) pool[i] = hash_word(i < words ? word(i) : 0, multiplier);
    for (size_t src = 0; src < kPool; ++src) {
      for (size_t dst = 0; dst < kPool; ++dst) {
        if (src != dst) pool[dst] = mix(pool[dst], hash_word(pool[src], multiplier));
      }
    }
    for (size_t src = kPool; src < words; ++src) {
      for (size_t dst = 0; dst < kPool; ++dst) {
        pool[dst] = mix(pool[dst], hash_word(word(src), multiplier));
      }
    }
    // Four 64-bit words of state (eight 32-bit ones, low word first) seed PCG64.
    uint32_t state_words[8];
    uint32_t state_multiplier = kInitB;
    for (size_t i = 0; i < 8; ++i) {
      uint32_t v = pool[i % kPool] ^ state_multiplier;
      state_multiplier *= kMultB;
      v *= state_multiplier;
      state_words[i] = v ^ (v >> kShift);
    }
    uint64_t seed[4];
    for (size_t i = 0; i < 4; ++i) {
      seed[i] = state_words[2 * i] | (uint64_t(state_words[2 * i + 1]) << 32);
    }
    const u128 initial = (u128(seed[0]) << 64) | seed[1];
    const u128 increment = (((u128(seed[2]) << 64) | seed[3]) << 1) | 1;
    u128 state = increment;  // one step from zero
    state += initial;
    state = state * kPcgMultiplier + increment;
    for (size_t c = 0; c < count; ++c) {
      state = state * kPcgMultiplier + increment;
      const uint64_t folded = uint64_t(state >> 64) ^ uint64_t(state);
      const unsigned rotation = unsigned(state >> 122);
      const uint64_t bits = (folded >> rotation) | (folded << ((64 - rotation) & 63));
      out[item * count + c] = double(bits >> 11) * 0x1.0p-53;
    }
  }
}

}  // namespace stoker::plan
