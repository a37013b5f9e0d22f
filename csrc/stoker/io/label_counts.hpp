// The voxels of each label value per block of a label volume: the occupancy grid a
// label-balanced patch sampler draws its centres from. Counted in two passes over the
// labels (which values are present, then each block's share of every value but the
// commonest), on several threads, without an index array of the volume's size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace stoker::io {

struct LabelBlockCounts {
  std::vector<int64_t> values;  // the values present, ascending
  std::vector<uint64_t> grid;   // blocks along each axis
  std::vector<int64_t> counts;  // values.size() x grid, C order: counts[v][block]
};

// `labels` is a C-contiguous array of `shape` whose elements are 1- or 2-byte integers
// (`is_signed` says whether they are read as signed). A block is `block` voxels along
// each axis (shorter at the far edges).
LabelBlockCounts count_label_blocks(const void* labels, const std::vector<uint64_t>& shape,
                                    unsigned itemsize, bool is_signed, uint64_t block,
                                    size_t threads);

}  // namespace stoker::io
