// Page-aligned host memory: batch buffers and ring slots. Page alignment
// lets any dtype be viewed in place and lets CUDA pin the pages.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <utility>

namespace stoker::io {

// Work that still reads a buffer after its last reference went: an
// asynchronous copy to a device. The buffer is reused only once it is ready.
class Fence {
 public:
  virtual ~Fence() = default;
  virtual bool ready() = 0;
  virtual void wait() = 0;
};

// A buffer copied twice (to two devices, or in pieces) is free once both
// copies are.
class FencePair : public Fence {
 public:
  FencePair(std::shared_ptr<Fence> first, std::shared_ptr<Fence> second)
      : first_(std::move(first)), second_(std::move(second)) {}
  bool ready() override { return first_->ready() && second_->ready(); }
  void wait() override {
    first_->wait();
    second_->wait();
  }

 private:
  std::shared_ptr<Fence> first_;
  std::shared_ptr<Fence> second_;
};

// Page-locked host memory for a device (cuda::PinnedHostMemory implements it).
// Page-locked memory is taken from the whole machine: rings bound it.
class HostPinner {
 public:
  virtual ~HostPinner() = default;
  // `size` bytes (whole pages), page-aligned and page-locked.
  virtual uint8_t* allocate(size_t size) = 0;
  // Gives back what allocate() returned, once no copy reads it any more.
  virtual void release(uint8_t* data, size_t size) noexcept = 0;
};

class AlignedBuffer {
 public:
  static constexpr size_t kAlignment = 4096;

  // `capacity` (at least `size`; 0: `size`) is rounded up to whole pages. With
  // a pinner the memory is page-locked memory from it.
  explicit AlignedBuffer(size_t size, size_t capacity = 0,
                         std::shared_ptr<HostPinner> pinner = nullptr)
      : size_(size), capacity_(std::max(size, capacity)), pinner_(std::move(pinner)) {
    if (capacity_ > SIZE_MAX - kAlignment) throw std::bad_alloc();
    capacity_ =
        std::max<size_t>((capacity_ + kAlignment - 1) / kAlignment * kAlignment, kAlignment);
    data_ = pinner_ ? pinner_->allocate(capacity_)
                    : static_cast<uint8_t*>(std::aligned_alloc(kAlignment, capacity_));
    if (data_ == nullptr) throw std::bad_alloc();
  }
  ~AlignedBuffer() {
    if (pinner_) {
      pinner_->release(data_, capacity_);
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
  // Page-locked, for asynchronous device copies.
  bool pinned() const { return pinner_ != nullptr; }

  // The copies still reading this buffer; set while a caller holds it.
  std::shared_ptr<Fence> fence;

 private:
  uint8_t* data_;
  size_t size_;
  size_t capacity_;
  std::shared_ptr<HostPinner> pinner_;
};

}  // namespace stoker::io
