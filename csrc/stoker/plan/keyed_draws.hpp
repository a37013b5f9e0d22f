// Draws keyed by a tuple of integers, equal to numpy's `default_rng(key)`'s `random`,
// `integers` and `permutation` (SeedSequence, then PCG64). PatchLoader draws each
// patch's position from a generator keyed by (seed, epoch, subject, index), and the
// Loader's sampler permutes each group and bucket of an epoch with one keyed by (seed,
// epoch, tag, ...), so that a draw depends on nothing else; making a numpy generator costs
// ten times the draw, several times a batch.
#pragma once

#include <cstddef>
#include <cstdint>

namespace stoker::plan {

// numpy's PCG64 as five words a generator, so that its draws can be taken in turns across
// calls: the 128-bit state and increment (high word first), then the spare half of a
// 64-bit draw that the next 32-bit draw takes (bit 32 set while there is one).
constexpr size_t kGeneratorWords = 5;

// The generator numpy's default_rng(key) makes for each of `n` keys, into `states`
// (n x kGeneratorWords). A key's 32-bit words, as SeedSequence splits its integers, are
// `prefix` followed by that key's row of `tails` (n x tail_words).
void keyed_generators(const uint32_t* prefix, size_t prefix_words, const uint32_t* tails,
                      size_t tail_words, size_t n, uint64_t* states);

// `count` doubles in [0, 1) from each of the `n` generators `states` into `out` (n x
// count), as Generator.random(count) draws them; the states are advanced.
void generator_uniforms(uint64_t* states, size_t n, size_t count, double* out);

// One integer in [0, highs[i]) from generator i (highs[i] at least 1), as
// Generator.integers(highs[i]) draws an int64; the states are advanced.
void generator_integers(uint64_t* states, size_t n, const uint64_t* highs, int64_t* out);

// The permutation of [0, n) that numpy's default_rng(key).permutation(n) makes, into
// `out` (n values); the key's 32-bit words as above.
void keyed_shuffle(const uint32_t* words, size_t word_count, uint64_t n, int64_t* out);

}  // namespace stoker::plan
