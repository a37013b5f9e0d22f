// Draws keyed by a tuple of integers, equal to numpy's: `default_rng(key).random(count)`
// and `default_rng(key).permutation(n)` (SeedSequence, then PCG64). PatchLoader draws each
// patch's position from a generator keyed by (seed, epoch, subject, index), and the
// Loader's sampler permutes each group and bucket of an epoch with one keyed by (seed,
// epoch, tag, ...), so that a draw depends on nothing else; making a numpy generator costs
// ten times the draw, several times a batch.
#pragma once

#include <cstddef>
#include <cstdint>

namespace stoker::plan {

// For each of `n` keys, `count` doubles in [0, 1) into `out` (n x count). A key's 32-bit
// words, as SeedSequence splits its integers, are `prefix` followed by that key's row of
// `tails` (n x tail_words).
void keyed_uniforms(const uint32_t* prefix, size_t prefix_words, const uint32_t* tails,
                    size_t tail_words, size_t n, size_t count, double* out);

// The permutation of [0, n) that numpy's default_rng(key).permutation(n) makes, into
// `out` (n values); the key's 32-bit words as above.
void keyed_shuffle(const uint32_t* words, size_t word_count, uint64_t n, int64_t* out);

}  // namespace stoker::plan
