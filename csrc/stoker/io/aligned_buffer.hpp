// Page-aligned host memory: batch buffers and ring slots. Page alignment
// lets any dtype be viewed in place and lets CUDA pin the pages.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>

namespace stoker::io {

// Work that still reads a buffer after its last reference went: an
// asynchronous copy to a device. The buffer is reused only once it is ready.
class Fence {
 public:
  virtual ~Fence() = default;
  virtual bool ready() = 0;
  virtual void wait() = 0;
};

class AlignedBuffer {
 public:
  static constexpr size_t kAlignment = 4096;

  // `capacity` (at least `size`; 0: `size` in whole pages) is rounded up to pages.
  // A `private_mapping` is its own anonymous mapping that a forked child does
  // not inherit (MADV_DONTFORK): for page-locked memory, where a parent's write
  // after a fork must not move it off the pages the device copies from.
  explicit AlignedBuffer(size_t size, size_t capacity = 0, bool private_mapping = false)
      : size_(size), capacity_(std::max(size, capacity)), mapped_(private_mapping) {
    if (capacity_ > SIZE_MAX - kAlignment) throw std::bad_alloc();
    capacity_ =
        std::max<size_t>((capacity_ + kAlignment - 1) / kAlignment * kAlignment, kAlignment);
    if (mapped_) {
      void* p =
          mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
      madvise(p, capacity_, MADV_DONTFORK);
      data_ = static_cast<uint8_t*>(p);
    } else {
      data_ = static_cast<uint8_t*>(std::aligned_alloc(kAlignment, capacity_));
      if (data_ == nullptr) throw std::bad_alloc();
    }
  }
  ~AlignedBuffer() {
    if (mapped_) {
      munmap(data_, capacity_);  // in a forked child, where it is not mapped: a no-op
    } else {
      std::free(data_);
    }
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  size_t capacity() const { return capacity_; }
  // Reuse for a batch of `size` bytes; size must not exceed capacity().
  void resize(size_t size) { size_ = size; }

  // Page-locked for device copies (set by the ring that pinned it).
  bool pinned = false;
  // The copies still reading this buffer; set while a caller holds it.
  std::shared_ptr<Fence> fence;

 private:
  uint8_t* data_;
  size_t size_;
  size_t capacity_;
  bool mapped_;
};

}  // namespace stoker::io
