// Recycles batch buffers. A fresh multi-megabyte buffer per batch costs page
// faults to fill it and an munmap (a TLB shootdown on every core) to free it;
// reusing a few recently freed ones costs neither.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "stoker/io/aligned_buffer.hpp"

namespace stoker::io {

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  // Keeps at most `max_buffers` idle buffers and `max_bytes` in them.
  BufferPool(size_t max_buffers, size_t max_bytes)
      : max_buffers_(max_buffers), max_bytes_(max_bytes) {}

  // A buffer of at least `size` bytes (its size() is `size`), handed back to
  // the pool when the last reference to it goes.
  std::shared_ptr<AlignedBuffer> get(size_t size);
  size_t idle_buffers() const;

 private:
  void put(AlignedBuffer* buffer);

  size_t max_buffers_;
  size_t max_bytes_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<AlignedBuffer>> idle_;
  size_t idle_bytes_ = 0;
};

}  // namespace stoker::io
