// A pseudo-random permutation of [0, n) worked out position by position, for the sampler's
// large segments (stoker/loader/sample_orders.py): a balanced Feistel network over the
// smallest even number of bits that holds n, its round function a splitmix64 finalizer of
// the half and the round's key, walked again from any value past n until it lands inside.
#pragma once

#include <cstddef>
#include <cstdint>

namespace stoker::plan {

// Where each of `count` positions (each below n) goes; `keys`: one per round.
void keyed_permutation(uint64_t n, const uint64_t* keys, size_t rounds, const int64_t* positions,
                       size_t count, int64_t* out);

}  // namespace stoker::plan
