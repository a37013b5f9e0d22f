#include "stoker/io/strided_copy.hpp"

#include <cstring>
#include <string>

#include "stoker/errors.hpp"

namespace stoker::io {

void simplify(StridedBox& box) {
  std::vector<StrideAxis> kept;
  for (const StrideAxis& axis : box.outer) {
    if (axis.extent == 1) continue;
    if (!kept.empty() && kept.back().src_stride == axis.src_stride * axis.extent &&
        kept.back().dst_stride == axis.dst_stride * axis.extent) {
      kept.back() = {kept.back().extent * axis.extent, axis.src_stride, axis.dst_stride};
      continue;
    }
    kept.push_back(axis);
  }
  while (!kept.empty() && kept.back().src_stride == box.block &&
         kept.back().dst_stride == box.block) {
    box.block *= kept.back().extent;
    kept.pop_back();
  }
  box.outer = std::move(kept);
}

void copy_strided(const StridedBox& box, const uint8_t* src, uint8_t* dst,
                  const std::vector<uint8_t>& fill) {
  auto put = [&](const uint8_t* from, uint8_t* to) {
    if (from != nullptr) {
      std::memcpy(to, from, box.block);
    } else if (fill.size() == 1) {
      std::memset(to, fill[0], box.block);
    } else {
      for (uint64_t at = 0; at < box.block; at += fill.size()) {
        std::memcpy(to + at, fill.data(), fill.size());
      }
    }
  };
  const size_t depth = box.outer.size();
  if (depth == 0) {
    put(src, dst);
    return;
  }
  for (const StrideAxis& axis : box.outer) {
    if (axis.extent == 0) return;
  }
  std::vector<uint64_t> index(depth, 0);
  const StrideAxis& inner = box.outer.back();
  for (;;) {
    uint64_t s = 0, d = 0;
    for (size_t k = 0; k + 1 < depth; ++k) {
      s += index[k] * box.outer[k].src_stride;
      d += index[k] * box.outer[k].dst_stride;
    }
    // The innermost axis as a plain loop: a patch's rows are short (128 bytes), so the
    // index arithmetic above is paid once per row of blocks, not per block.
    for (uint64_t i = 0; i < inner.extent; ++i) {
      put(src ? src + s + i * inner.src_stride : nullptr, dst + d + i * inner.dst_stride);
    }
    size_t k = depth - 1;
    while (k > 0 && ++index[k - 1] == box.outer[k - 1].extent) index[--k] = 0;
    if (k == 0) return;
  }
}

namespace {

uint64_t reach(const StridedBox& box, bool source) {
  uint64_t last = 0;
  for (const StrideAxis& axis : box.outer) {
    if (axis.extent == 0) return 0;
    last += (axis.extent - 1) * (source ? axis.src_stride : axis.dst_stride);
  }
  return box.block == 0 ? 0 : last + box.block;
}

class SpanBoxDecoder final : public FieldDecoder {
 public:
  SpanBoxDecoder(StridedBox box, uint64_t span) : box_(std::move(box)), span_(span) {
    if (box_.src_start + source_reach(box_) > span_) {
      throw Error("a span box reaches " + std::to_string(box_.src_start + source_reach(box_)) +
                  " bytes into a span of " + std::to_string(span_));
    }
  }
  uint64_t output_bytes() const override { return destination_reach(box_); }
  uint64_t max_input_bytes() const override { return span_; }
  const char* input_name() const override { return "a span of a volume"; }

  void decode(const uint8_t* src, uint64_t size, uint64_t /*seed*/, uint8_t* dest,
              const std::string& path, uint64_t offset) const override {
    if (size != span_) {
      throw Error(path, offset,
                  "a span of " + std::to_string(size) + " bytes, not " + std::to_string(span_));
    }
    copy_strided(box_, src + box_.src_start, dest, {});
  }

 private:
  StridedBox box_;
  uint64_t span_;
};

}  // namespace

uint64_t source_reach(const StridedBox& box) { return reach(box, true); }
uint64_t destination_reach(const StridedBox& box) { return reach(box, false); }

std::shared_ptr<const FieldDecoder> span_box_decoder(StridedBox box, uint64_t span) {
  return std::make_shared<const SpanBoxDecoder>(std::move(box), span);
}

}  // namespace stoker::io
