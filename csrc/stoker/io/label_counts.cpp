#include "stoker/io/label_counts.hpp"

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "stoker/io/thread_pool.hpp"

namespace stoker::io {
namespace {

// Elements counted into one set of 32-bit histograms before they are added up: far
// below 2^32, so no bin can overflow.
constexpr uint64_t kHistogramPiece = uint64_t{1} << 28;

uint64_t blocks_along(uint64_t extent, uint64_t block) { return (extent + block - 1) / block; }

// Four histograms filled in turn, so that runs of one value (a label's background)
// do not wait on one bin's previous increment.
template <typename T>
void histogram(const T* data, uint64_t n, std::vector<uint64_t>& bins) {
  constexpr size_t kBins = size_t{1} << (8 * sizeof(T));
  std::vector<uint32_t> part(4 * kBins);
  for (uint64_t at = 0; at < n; at += kHistogramPiece) {
    uint64_t end = std::min(n, at + kHistogramPiece);
    std::fill(part.begin(), part.end(), 0);
    uint64_t i = at;
    for (; i + 4 <= end; i += 4) {
      ++part[data[i]];
      ++part[kBins + data[i + 1]];
      ++part[2 * kBins + data[i + 2]];
      ++part[3 * kBins + data[i + 3]];
    }
    for (; i < end; ++i) ++part[data[i]];
    for (size_t b = 0; b < kBins; ++b) {
      bins[b] += uint64_t{part[b]} + part[kBins + b] + part[2 * kBins + b] + part[3 * kBins + b];
    }
  }
}

struct Geometry {
  uint64_t planes;          // extent of axis 0
  uint64_t rows_per_plane;  // product of the middle axes' extents
  uint64_t row;             // extent of the last axis
  uint64_t block;
  uint64_t slabs;                   // blocks along axis 0
  uint64_t middle_blocks;           // blocks in one slab, across the middle axes
  uint64_t row_blocks;              // blocks along the last axis
  uint64_t column_ones;             // most voxels one column sum of a slab adds up
  std::vector<uint32_t> row_block;  // each row of a plane: its block among the middle ones
};

Geometry geometry_of(const std::vector<uint64_t>& shape, uint64_t block) {
  // Seen as (axis 0, middle axes, last axis); one axis is its own last axis.
  std::vector<uint64_t> s = shape;
  if (s.size() == 1) s.insert(s.begin(), 1);
  Geometry g;
  g.block = block;
  g.planes = s.front();
  g.row = s.back();
  g.slabs = blocks_along(g.planes, block);
  g.row_blocks = blocks_along(g.row, block);
  g.rows_per_plane = 1;
  g.middle_blocks = 1;
  g.column_ones = std::min(block, g.planes);
  for (size_t d = 1; d + 1 < s.size(); ++d) {
    g.rows_per_plane *= s[d];
    g.middle_blocks *= blocks_along(s[d], block);
    g.column_ones *= std::min(block, s[d]);
  }
  g.row_block.resize(g.rows_per_plane);
  // Rows in C order over the middle axes; a row's block is the C-order index of its
  // coordinates' blocks.
  std::vector<uint64_t> coord(s.size(), 0);
  for (uint64_t r = 0; r < g.rows_per_plane; ++r) {
    uint64_t index = 0;
    for (size_t d = 1; d + 1 < s.size(); ++d) {
      index = index * blocks_along(s[d], block) + coord[d] / block;
    }
    g.row_block[r] = static_cast<uint32_t>(index);
    for (size_t d = s.size() - 2; d >= 1; --d) {
      if (++coord[d] < s[d]) break;
      coord[d] = 0;
    }
  }
  return g;
}

// One slab (`block` planes of axis 0): every counted value's voxels summed per column
// of each middle block, the rows of a plane compared against all values while in
// cache, then each column sum added into its block along the row.
template <typename T, typename Sum>
void count_slab(const T* data, const Geometry& g, uint64_t slab, const std::vector<T>& counted,
                const std::vector<size_t>& counted_index, uint64_t grid_blocks, int64_t* counts) {
  const size_t k_count = counted.size();
  const uint64_t row = g.row;
  const uint64_t sums_per_value = g.middle_blocks * row;
  std::vector<Sum> sums(k_count * sums_per_value, 0);
  uint64_t first = slab * g.block, last = std::min(g.planes, first + g.block);
  for (uint64_t p = first; p < last; ++p) {
    for (uint64_t r = 0; r < g.rows_per_plane; ++r) {
      const T* line = data + (p * g.rows_per_plane + r) * row;
      for (size_t k = 0; k < k_count; ++k) {
        Sum* sum = sums.data() + k * sums_per_value + uint64_t{g.row_block[r]} * row;
        const T value = counted[k];
        for (uint64_t x = 0; x < row; ++x) sum[x] += static_cast<Sum>(line[x] == value);
      }
    }
  }
  for (size_t k = 0; k < k_count; ++k) {
    int64_t* out = counts + counted_index[k] * grid_blocks + slab * g.middle_blocks * g.row_blocks;
    const Sum* sum = sums.data() + k * sums_per_value;
    for (uint64_t m = 0; m < g.middle_blocks; ++m) {
      for (uint64_t x = 0; x < row; ++x) out[m * g.row_blocks + x / g.block] += sum[m * row + x];
    }
  }
}

template <typename T>
LabelBlockCounts count_typed(const T* data, const std::vector<uint64_t>& shape, bool is_signed,
                             uint64_t block, size_t threads) {
  constexpr size_t kBins = size_t{1} << (8 * sizeof(T));
  uint64_t n = 1;
  for (uint64_t s : shape) n *= s;
  Geometry g = geometry_of(shape, block);

  // Pass 1: which values are present, each thread a stretch of the elements.
  size_t pieces = std::max<size_t>(1, std::min<uint64_t>(threads, n / (1 << 20) + 1));
  std::vector<std::vector<uint64_t>> partial(pieces, std::vector<uint64_t>(kBins, 0));
  parallel_for(pieces, pieces, [&](size_t t) {
    uint64_t begin = n * t / pieces, end = n * (t + 1) / pieces;
    histogram(data + begin, end - begin, partial[t]);
  });
  std::vector<uint64_t> bins(kBins, 0);
  for (const auto& part : partial) {
    for (size_t b = 0; b < kBins; ++b) bins[b] += part[b];
  }
  // Bins in ascending order of the values they stand for (signed: the negative half first).
  std::vector<size_t> order(kBins);
  for (size_t b = 0; b < kBins; ++b) order[b] = is_signed ? (b + kBins / 2) % kBins : b;

  LabelBlockCounts result;
  std::vector<size_t> present;
  for (size_t b : order) {
    if (bins[b] == 0) continue;
    present.push_back(b);
    int64_t value = static_cast<int64_t>(b);
    if (is_signed && b >= kBins / 2) value -= static_cast<int64_t>(kBins);
    result.values.push_back(value);
  }
  for (uint64_t s : shape) result.grid.push_back(blocks_along(s, block));
  const std::vector<uint64_t>& grid = result.grid;
  uint64_t grid_blocks = 1;
  for (uint64_t b : grid) grid_blocks *= b;
  result.counts.assign(present.size() * grid_blocks, 0);
  if (present.empty()) return result;

  // Pass 2: every value but the commonest (mostly the background), whose count is what
  // each block's voxels leave; a binary label is one comparison per voxel.
  size_t commonest = 0;
  for (size_t k = 1; k < present.size(); ++k) {
    if (bins[present[k]] > bins[present[commonest]]) commonest = k;
  }
  std::vector<T> counted;
  std::vector<size_t> counted_index;
  for (size_t k = 0; k < present.size(); ++k) {
    if (k == commonest) continue;
    counted.push_back(static_cast<T>(present[k]));
    counted_index.push_back(k);
  }
  int64_t* counts = result.counts.data();
  if (!counted.empty()) {
    bool narrow = g.column_ones <= std::numeric_limits<uint16_t>::max();
    parallel_for(g.slabs, threads, [&](size_t slab) {
      if (narrow) {
        count_slab<T, uint16_t>(data, g, slab, counted, counted_index, grid_blocks, counts);
      } else {
        count_slab<T, uint32_t>(data, g, slab, counted, counted_index, grid_blocks, counts);
      }
    });
  }
  // The commonest value: each block's voxels less the others'.
  int64_t* common = counts + commonest * grid_blocks;
  std::vector<uint64_t> index(grid.size(), 0);
  for (uint64_t b = 0; b < grid_blocks; ++b) {
    int64_t voxels = 1;
    for (size_t d = 0; d < grid.size(); ++d) {
      voxels *= static_cast<int64_t>(std::min(block, shape[d] - index[d] * block));
    }
    for (size_t k = 0; k < present.size(); ++k) {
      if (k != commonest) voxels -= counts[k * grid_blocks + b];
    }
    common[b] = voxels;
    for (size_t d = grid.size(); d-- > 0;) {
      if (++index[d] < grid[d]) break;
      index[d] = 0;
    }
  }
  return result;
}

}  // namespace

LabelBlockCounts count_label_blocks(const void* labels, const std::vector<uint64_t>& shape,
                                    unsigned itemsize, bool is_signed, uint64_t block,
                                    size_t threads) {
  if (block == 0) throw std::invalid_argument("count_label_blocks: a block of 0 voxels");
  if (shape.empty()) throw std::invalid_argument("count_label_blocks: a label of no axes");
  for (uint64_t s : shape) {
    if (s == 0) {
      LabelBlockCounts empty;
      for (uint64_t e : shape) empty.grid.push_back(blocks_along(e, block));
      return empty;
    }
  }
  if (itemsize == 1) {
    return count_typed(static_cast<const uint8_t*>(labels), shape, is_signed, block, threads);
  }
  if (itemsize == 2) {
    return count_typed(static_cast<const uint16_t*>(labels), shape, is_signed, block, threads);
  }
  throw std::invalid_argument("count_label_blocks: labels of 1 or 2 bytes an element");
}

}  // namespace stoker::io
