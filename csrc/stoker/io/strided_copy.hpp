// A box of elements moved between two strided layouts as nested loops around
// contiguous blocks: the part of an array chunk a row or patch needs, or the patch a
// span read whole from a file holds.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "stoker/io/decoder.hpp"

namespace stoker::io {

struct StrideAxis {
  uint64_t extent, src_stride, dst_stride;  // strides in bytes
};

// Nested loops over `outer` (outermost first) around contiguous blocks of `block`
// bytes on both sides.
struct StridedBox {
  std::vector<StrideAxis> outer;
  uint64_t block = 0;
  uint64_t dst_start = 0;  // where the box starts in the destination
  uint64_t src_start = 0;  // where it starts in the source
};

// Fewer, longer copies: an axis of extent 1 moves nothing; an axis that steps over
// the whole of the next one on both sides is one axis with it; inner axes contiguous
// on both sides become part of the block.
void simplify(StridedBox& box);

// Copies the box from `src` into `dst` (neither offset by the box's starts); a null
// `src` writes `fill` (one element, repeated) into every element instead.
void copy_strided(const StridedBox& box, const uint8_t* src, uint8_t* dst,
                  const std::vector<uint8_t>& fill);

// The bytes the box reaches from its first element on, on each side (0 when empty).
uint64_t source_reach(const StridedBox& box);
uint64_t destination_reach(const StridedBox& box);

// Copies an array of `shape`, `src_strides` bytes apart along each axis in `src` (any
// order, negative strides too), into `dst` in C order: a batch of patches stored in a
// file's axis order (a NIfTI's is Fortran order) turned into the order the patch names.
// Cut into tiles along the destination's innermost axis and the source's, so that both
// sides move whole cache lines, and over up to `threads` threads along the outermost axis.
void permute_copy(const uint8_t* src, const std::vector<int64_t>& src_strides, uint8_t* dst,
                  const std::vector<uint64_t>& shape, uint64_t itemsize, size_t threads);

// A Codec::kSpanBox request's decoder: the request's bytes are a span of a file read
// whole, of which `box` (at its src_start) is copied to the request's place. So a patch
// of a volume stored in place is read a few long spans at a time, and the short gaps
// between its rows are dropped by the reader's threads.
std::shared_ptr<const FieldDecoder> span_box_decoder(StridedBox box, uint64_t span);

}  // namespace stoker::io
