// A growable byte buffer whose growth leaves the new bytes as they are: decoded column
// chunks and array chunks are written whole by their decoder right after they are sized,
// so std::vector's zero fill (a memset of every byte, a tenth of a Parquet epoch) is
// wasted work.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <utility>
#include <vector>

namespace stoker::io {

template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>& other) noexcept : std::allocator<T>(other) {}

  // Value-initialization (resize, the size constructor) becomes default-initialization.
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

using ByteVector = std::vector<uint8_t, DefaultInitAllocator<uint8_t>>;

// Linux's value (asm-generic), for headers older than the kernels that have it (5.14).
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

// A copy of `size` bytes at `data` that a cache keeps. While a cache fills, its memory is
// fresh from the kernel, and faulting the pages in one at a time as the copy writes them
// costs twice what asking for all of them in one call does: for a 192 KiB slide tile,
// 110-150 us against 60 us on the development machine, where decoding the tile takes about
// 250 us. Memory the heap hands out again is already present; the call then costs 2 us.
inline std::shared_ptr<const ByteVector> kept_copy(const uint8_t* data, size_t size) {
  auto copy = std::make_shared<ByteVector>(size);
  constexpr uintptr_t kPage = 4096;
  const auto first = (reinterpret_cast<uintptr_t>(copy->data()) + kPage - 1) & ~(kPage - 1);
  const auto end = (reinterpret_cast<uintptr_t>(copy->data()) + size) & ~(kPage - 1);
  if (end > first + 8 * kPage) {  // an older kernel says EINVAL, and faults the pages in as before
    ::madvise(reinterpret_cast<void*>(first), end - first, MADV_POPULATE_WRITE);
  }
  if (size) std::memcpy(copy->data(), data, size);
  return copy;
}

// A buffer a thread keeps from one use to the next is given back once one large input
// made it grow past `keep` bytes, so that it does not hold that memory for good.
template <typename Buffer>
void give_back_if_larger(Buffer& buffer, size_t keep) {
  if (buffer.capacity() * sizeof(typename Buffer::value_type) > keep) Buffer().swap(buffer);
}

}  // namespace stoker::io
