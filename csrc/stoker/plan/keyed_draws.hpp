// Uniform draws keyed by a tuple of integers, equal to numpy's
// `default_rng(key).random(count)` (SeedSequence, then PCG64), for many keys in one call:
// PatchLoader draws each patch's position from a generator keyed by (seed, epoch, subject,
// index), so that a position depends on nothing else, and making a numpy generator per
// patch costs ten times the draw.
#pragma once

#include <cstddef>
#include <cstdint>

namespace stoker::plan {

// For each of `n` keys, `count` doubles in [0, 1) into `out` (n x count). A key's 32-bit
// words, as SeedSequence splits its integers, are `prefix` followed by that key's row of
// `tails` (n x tail_words).
void keyed_uniforms(const uint32_t* prefix, size_t prefix_words, const uint32_t* tails,
                    size_t tail_words, size_t n, size_t count, double* out);

}  // namespace stoker::plan
