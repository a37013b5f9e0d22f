// The ring of reusable host slots that batches are read into. A slot goes
// back to the ring only when the last reference to it goes (the tensors that
// view it are freed), so a batch a user keeps is never overwritten, and a
// user keeping many never blocks the reader: a slot is then simply new.
// Reuse matters: a fresh multi-megabyte buffer per batch costs page faults to
// fill it and an munmap (a TLB shootdown on every core) to free it. Slots are
// plain page-aligned memory for now; the CUDA path will page-lock them.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "stoker/io/aligned_buffer.hpp"

namespace stoker::io {

class PinnedRing : public std::enable_shared_from_this<PinnedRing> {
 public:
  // Keeps at most `max_buffers` idle slots and `max_bytes` in them.
  PinnedRing(size_t max_buffers, size_t max_bytes)
      : max_buffers_(max_buffers), max_bytes_(max_bytes) {}

  // A slot of at least `size` bytes (its size() is `size`), handed back to
  // the ring when the last reference to it goes.
  std::shared_ptr<AlignedBuffer> acquire(size_t size);
  size_t idle_slots() const;

 private:
  void put(AlignedBuffer* buffer);

  size_t max_buffers_;
  size_t max_bytes_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<AlignedBuffer>> idle_;
  size_t idle_bytes_ = 0;
};

}  // namespace stoker::io
