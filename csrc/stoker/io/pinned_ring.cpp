#include "stoker/io/pinned_ring.hpp"

#include <unistd.h>

namespace stoker::io {

std::shared_ptr<AlignedBuffer> PinnedRing::acquire(size_t size) {
  std::unique_ptr<AlignedBuffer> buffer;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Take the smallest idle buffer that fits, unless it would waste more
    // than half of itself.
    size_t best = idle_.size();
    for (size_t i = 0; i < idle_.size(); ++i) {
      size_t capacity = idle_[i]->capacity();
      if (capacity >= size && capacity / 2 <= size &&
          (best == idle_.size() || capacity < idle_[best]->capacity())) {
        best = i;
      }
    }
    if (best < idle_.size()) {
      buffer = std::move(idle_[best]);
      idle_.erase(idle_.begin() + static_cast<std::ptrdiff_t>(best));
      idle_bytes_ -= buffer->capacity();
    }
  }
  if (buffer) {
    buffer->resize(size);
  } else {
    buffer = std::make_unique<AlignedBuffer>(size);
  }
  std::weak_ptr<PinnedRing> pool = weak_from_this();
  pid_t owner = getpid();
  return std::shared_ptr<AlignedBuffer>(buffer.release(), [pool, owner](AlignedBuffer* b) {
    // In a forked child the pool's lock may be held by a parent thread that
    // is not here: free the buffer instead of returning it.
    if (auto alive = getpid() == owner ? pool.lock() : nullptr) {
      alive->put(b);
    } else {
      delete b;
    }
  });
}

void PinnedRing::put(AlignedBuffer* raw) {
  std::unique_ptr<AlignedBuffer> buffer(raw);
  std::lock_guard<std::mutex> lock(mutex_);
  if (idle_.size() >= max_buffers_ || idle_bytes_ + buffer->capacity() > max_bytes_) return;
  idle_bytes_ += buffer->capacity();
  idle_.push_back(std::move(buffer));
}

size_t PinnedRing::idle_slots() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return idle_.size();
}

}  // namespace stoker::io
