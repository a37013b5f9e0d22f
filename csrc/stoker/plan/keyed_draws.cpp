#include "stoker/plan/keyed_draws.hpp"

#include <algorithm>
#include <utility>
#include <vector>

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

// numpy's PCG64 (XSL-RR output of a 128-bit LCG), seeded as SeedSequence(words) seeds it,
// with its draws: 64 bits, 32 bits (half of a 64-bit draw, the other half kept for the
// next), and 53-bit doubles.
class Pcg64 {
 public:
  Pcg64(const uint32_t* words, size_t count) {
    // The entropy mixed into the pool.
    uint32_t pool[kPool];
    uint32_t multiplier = kInitA;
    for (size_t i = 0; i < kPool; ++i) pool[i] = hash_word(i < count ? words[i] : 0, multiplier);
    for (size_t src = 0; src < kPool; ++src) {
      for (size_t dst = 0; dst < kPool; ++dst) {
        if (src != dst) pool[dst] = mix(pool[dst], hash_word(pool[src], multiplier));
      }
    }
    for (size_t src = kPool; src < count; ++src) {
      for (size_t dst = 0; dst < kPool; ++dst) {
        pool[dst] = mix(pool[dst], hash_word(words[src], multiplier));
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
    increment_ = (((u128(seed[2]) << 64) | seed[3]) << 1) | 1;
    state_ = increment_;  // one step from zero
    state_ += initial;
    state_ = state_ * kPcgMultiplier + increment_;
  }

  uint64_t next64() {
    state_ = state_ * kPcgMultiplier + increment_;
    const uint64_t folded = uint64_t(state_ >> 64) ^ uint64_t(state_);
    const unsigned rotation = unsigned(state_ >> 122);
    return (folded >> rotation) | (folded << ((64 - rotation) & 63));
  }

  uint32_t next32() {
    if (has_half_) {
      has_half_ = false;
      return half_;
    }
    const uint64_t bits = next64();
    has_half_ = true;
    half_ = uint32_t(bits >> 32);
    return uint32_t(bits);
  }

  double next_double() { return double(next64() >> 11) * 0x1.0p-53; }

  // A value in [0, max], as numpy's bounded int64 draws take it (Lemire's multiply and
  // reject: on 32-bit draws where max fits them, the spare half of a 64-bit draw first).
  uint64_t bounded(uint64_t max) {
    if (max == 0) return 0;
    if (max == UINT64_MAX) return next64();
    if (max == 0xffffffffULL) return next32();
    if (max < 0xffffffffULL) {
      const uint64_t span = max + 1;
      uint64_t product = uint64_t(next32()) * span;
      if (uint32_t(product) < span) {
        const uint32_t threshold = uint32_t((0xffffffffULL - max) % span);
        while (uint32_t(product) < threshold) product = uint64_t(next32()) * span;
      }
      return product >> 32;
    }
    const uint64_t span = max + 1;
    u128 product = u128(next64()) * span;
    if (uint64_t(product) < span) {
      const uint64_t threshold = (UINT64_MAX - max) % span;
      while (uint64_t(product) < threshold) product = u128(next64()) * span;
    }
    return uint64_t(product >> 64);
  }

  void save(uint64_t* words) const {
    words[0] = uint64_t(state_ >> 64);
    words[1] = uint64_t(state_);
    words[2] = uint64_t(increment_ >> 64);
    words[3] = uint64_t(increment_);
    words[4] = has_half_ ? (uint64_t(1) << 32) | half_ : 0;
  }

  static Pcg64 load(const uint64_t* words) {
    Pcg64 g;
    g.state_ = (u128(words[0]) << 64) | words[1];
    g.increment_ = (u128(words[2]) << 64) | words[3];
    g.has_half_ = (words[4] >> 32) & 1;
    g.half_ = uint32_t(words[4]);
    return g;
  }

  // A value in [0, max], as numpy's random_interval draws it: masked draws until one fits.
  uint64_t interval(uint64_t max) {
    if (max == 0) return 0;
    uint64_t mask = max;
    for (unsigned shift = 1; shift < 64; shift <<= 1) mask |= mask >> shift;
    uint64_t value;
    if (max <= 0xffffffffULL) {
      while ((value = (next32() & mask)) > max) {
      }
    } else {
      while ((value = (next64() & mask)) > max) {
      }
    }
    return value;
  }

 private:
  Pcg64() = default;
  u128 state_ = 0, increment_ = 0;
  bool has_half_ = false;
  uint32_t half_ = 0;
};

}  // namespace

void keyed_generators(const uint32_t* prefix, size_t prefix_words, const uint32_t* tails,
                      size_t tail_words, size_t n, uint64_t* states) {
  std::vector<uint32_t> words(prefix, prefix + prefix_words);
  words.resize(prefix_words + tail_words);
  for (size_t item = 0; item < n; ++item) {
    std::copy_n(tails + item * tail_words, tail_words, words.begin() + prefix_words);
    Pcg64(words.data(), words.size()).save(states + item * kGeneratorWords);
  }
}

void generator_uniforms(uint64_t* states, size_t n, size_t count, double* out) {
  for (size_t item = 0; item < n; ++item) {
    Pcg64 draws = Pcg64::load(states + item * kGeneratorWords);
    for (size_t c = 0; c < count; ++c) out[item * count + c] = draws.next_double();
    draws.save(states + item * kGeneratorWords);
  }
}

void generator_integers(uint64_t* states, size_t n, const uint64_t* highs, int64_t* out) {
  for (size_t item = 0; item < n; ++item) {
    Pcg64 draws = Pcg64::load(states + item * kGeneratorWords);
    out[item] = int64_t(draws.bounded(highs[item] - 1));
    draws.save(states + item * kGeneratorWords);
  }
}

void keyed_shuffle(const uint32_t* words, size_t word_count, uint64_t n, int64_t* out) {
  for (uint64_t i = 0; i < n; ++i) out[i] = int64_t(i);
  Pcg64 draws(words, word_count);
  // numpy's shuffle: Fisher-Yates from the last place down to the second.
  for (uint64_t i = n; i-- > 1;) std::swap(out[i], out[draws.interval(i)]);
}

}  // namespace stoker::plan
