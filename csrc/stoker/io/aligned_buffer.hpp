// Page-aligned host memory: batch buffers and ring slots. Page alignment
// lets any dtype be viewed in place and lets CUDA pin the pages.
#pragma once

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

  explicit AlignedBuffer(size_t size)
      : size_(size),
        capacity_(
            size > SIZE_MAX - kAlignment ? 0 : (size + kAlignment - 1) / kAlignment * kAlignment) {
    if (size > SIZE_MAX - kAlignment) throw std::bad_alloc();
    if (capacity_ == 0) capacity_ = kAlignment;
    data_ = static_cast<uint8_t*>(std::aligned_alloc(kAlignment, capacity_));
    if (data_ == nullptr) throw std::bad_alloc();
  }
  ~AlignedBuffer() { std::free(data_); }
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
};

}  // namespace stoker::io
