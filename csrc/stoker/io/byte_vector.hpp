// A growable byte buffer whose growth leaves the new bytes as they are: decoded column
// chunks and array chunks are written whole by their decoder right after they are sized,
// so std::vector's zero fill (a memset of every byte, a tenth of a Parquet epoch) is
// wasted work.
#pragma once

#include <cstddef>
#include <cstdint>
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

// A buffer a thread keeps from one use to the next is given back once one large input
// made it grow past `keep` bytes, so that it does not hold that memory for good.
template <typename Buffer>
void give_back_if_larger(Buffer& buffer, size_t keep) {
  if (buffer.capacity() * sizeof(typename Buffer::value_type) > keep) Buffer().swap(buffer);
}

}  // namespace stoker::io
