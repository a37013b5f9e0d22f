#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "stoker/image/codec.hpp"

namespace stoker::image::detail {

namespace {

// Weights are fixed-point with this many fraction bits: 255 times their sum
// (1.0) still fits an int32 accumulator.
constexpr int kFractionBits = 22;

// For each output pixel, the first input pixel it reads, how many, and their
// weights (ksize slots per output pixel).
struct Taps {
  std::vector<int32_t> first, count, weights;
  int ksize = 0;
};

double triangle(double x) {
  x = std::fabs(x);
  return x < 1.0 ? 1.0 - x : 0.0;
}

// The filter is centred on each output pixel's centre mapped into [in0, in1);
// when shrinking it is widened by the scale factor so every input pixel counts
// (that is the antialiasing). Taps are clipped to [0, in_size).
Taps make_taps(double in0, double in1, uint32_t in_size, uint32_t out_size) {
  double scale = (in1 - in0) / out_size;
  double widen = std::max(scale, 1.0);
  double support = widen;  // the triangle reaches 1.0 either side
  Taps taps;
  taps.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  taps.first.resize(out_size);
  taps.count.resize(out_size);
  taps.weights.assign(size_t(out_size) * taps.ksize, 0);
  std::vector<double> w(taps.ksize);
  for (uint32_t o = 0; o < out_size; ++o) {
    double centre = in0 + (o + 0.5) * scale;
    int lo = std::max(static_cast<int>(centre - support + 0.5), 0);
    int hi = std::min(static_cast<int>(centre + support + 0.5), static_cast<int>(in_size));
    int n = std::max(hi - lo, 0);
    n = std::min(n, taps.ksize);
    double total = 0;
    for (int k = 0; k < n; ++k) {
      w[k] = triangle((k + lo - centre + 0.5) / widen);
      total += w[k];
    }
    int32_t* out = &taps.weights[size_t(o) * taps.ksize];
    for (int k = 0; k < n; ++k) {
      double v = total != 0.0 ? w[k] / total : 0.0;
      out[k] = static_cast<int32_t>(std::lround(v * (1 << kFractionBits)));
    }
    taps.first[o] = lo;
    taps.count[o] = n;
  }
  return taps;
}

inline uint8_t to_byte(int32_t acc) {
  acc >>= kFractionBits;
  return static_cast<uint8_t>(acc < 0 ? 0 : (acc > 255 ? 255 : acc));
}

// An edge left as it is (same size, whole pixels) is copied, not filtered.
bool untouched(double in0, double in1, uint32_t in_size, uint32_t out_size) {
  return out_size == in_size && in0 == 0.0 && in1 == static_cast<double>(in_size);
}

// Filters down the columns: each output row is a weighted sum of whole input
// rows, so the inner loop runs along memory and the compiler vectorises it.
// x86-64's baseline (SSE2) has no 32-bit multiply across lanes; an AVX2 copy is
// built beside it and picked at load time where the CPU has AVX2. Not under
// ThreadSanitizer: the loader runs the picking function before TSan has started.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("avx2", "default")))
#endif
void filter_rows(const uint8_t* src, size_t src_stride, const Taps& taps, uint32_t out_rows,
                 size_t row_bytes, uint8_t* dst, size_t dst_stride) {
  thread_local std::vector<int32_t> sums;
  sums.resize(row_bytes);
  int32_t* acc = sums.data();  // not the thread-local itself: its address costs a call
  for (uint32_t o = 0; o < out_rows; ++o) {
    std::fill(acc, acc + row_bytes, 1 << (kFractionBits - 1));
    const int32_t* w = &taps.weights[size_t(o) * taps.ksize];
    for (int k = 0; k < taps.count[o]; ++k) {
      const uint8_t* in = src + size_t(taps.first[o] + k) * src_stride;
      const int32_t wk = w[k];
      for (size_t i = 0; i < row_bytes; ++i) acc[i] += in[i] * wk;
    }
    uint8_t* out = dst + size_t(o) * dst_stride;
    for (size_t i = 0; i < row_bytes; ++i) out[i] = to_byte(acc[i]);
  }
  give_back_if_large(sums);
}

// Swaps rows and columns of an image of 3-byte pixels.
void transpose(const uint8_t* src, uint32_t rows, uint32_t cols, uint8_t* dst) {
  constexpr uint32_t kBlock = 32;  // a tile of both stays in the L1 cache
  for (uint32_t r0 = 0; r0 < rows; r0 += kBlock) {
    for (uint32_t c0 = 0; c0 < cols; c0 += kBlock) {
      uint32_t r1 = std::min(rows, r0 + kBlock), c1 = std::min(cols, c0 + kBlock);
      for (uint32_t r = r0; r < r1; ++r) {
        const uint8_t* in = src + size_t(r) * cols * 3;
        // Four bytes at a time where the fourth is harmless: it is the next pixel's
        // first byte in the source row, and in the destination row it is pixel r + 1's,
        // which is written after this one.
        const uint32_t wide_end = (r + 1 < rows) ? std::min(c1, cols - 1) : c0;
        uint32_t c = c0;
        for (; c < wide_end; ++c) {
          std::memcpy(dst + (size_t(c) * rows + r) * 3, in + size_t(c) * 3, 4);
        }
        for (; c < c1; ++c) {
          std::memcpy(dst + (size_t(c) * rows + r) * 3, in + size_t(c) * 3, 3);
        }
      }
    }
  }
}

}  // namespace

void resample(const uint8_t* src, uint32_t cols, uint32_t rows, double x0, double y0, double x1,
              double y1, uint32_t out_width, uint32_t out_height, bool flip, bool channels_last,
              uint8_t* dest) {
  // Columns first (fewer rows for the second pass when shrinking), then the rows
  // as columns of the transposed image, so that both passes are row filters.
  thread_local std::vector<uint8_t> down, across, result;
  const size_t stride = size_t(cols) * 3;
  const uint8_t* tall = src;  // out_height rows of cols pixels
  if (!untouched(y0, y1, rows, out_height)) {
    Taps vertical = make_taps(y0, y1, rows, out_height);
    down.resize(size_t(out_height) * stride);
    filter_rows(src, stride, vertical, out_height, stride, down.data(), stride);
    tall = down.data();
  }
  across.resize(size_t(cols) * out_height * 3);
  transpose(tall, out_height, cols, across.data());  // cols rows of out_height pixels
  const uint8_t* wide = across.data();               // out_width rows of out_height pixels
  if (!untouched(x0, x1, cols, out_width)) {
    Taps horizontal = make_taps(x0, x1, cols, out_width);
    result.resize(size_t(out_width) * out_height * 3);
    const size_t row = size_t(out_height) * 3;
    filter_rows(across.data(), row, horizontal, out_width, row, result.data(), row);
    wide = result.data();
  }
  // wide[x][y] is the output's pixel (x, y): written out transposed, in tiles
  // so that the rows of each plane being written stay in the cache.
  const size_t plane = size_t(out_width) * out_height;
  constexpr uint32_t kTile = 32;
  for (uint32_t ty = 0; ty < out_height; ty += kTile) {
    const uint32_t y_end = std::min(out_height, ty + kTile);
    for (uint32_t x = 0; x < out_width; ++x) {
      const uint8_t* column = wide + size_t(x) * out_height * 3;
      const uint32_t to = flip ? out_width - 1 - x : x;
      if (channels_last) {
        for (uint32_t y = ty; y < y_end; ++y) {
          std::memcpy(dest + (size_t(y) * out_width + to) * 3, column + size_t(y) * 3, 3);
        }
      } else {
        for (uint32_t y = ty; y < y_end; ++y) {
          const size_t at = size_t(y) * out_width + to;
          dest[at] = column[3 * y];
          dest[plane + at] = column[3 * y + 1];
          dest[2 * plane + at] = column[3 * y + 2];
        }
      }
    }
  }
  give_back_if_large(down);
  give_back_if_large(across);
  give_back_if_large(result);
}

}  // namespace stoker::image::detail
