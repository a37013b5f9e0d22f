#include "stoker/io/pinned_ring.hpp"

#include <unistd.h>

#include <algorithm>
#include <string>
#include <thread>

#include "stoker/errors.hpp"

namespace stoker::io {

namespace {

// A pinned slot's capacity: whole pages, and within 1/8 of a power of two, so
// batches whose sizes vary a little (variable-length fields) reuse a slot
// instead of unpinning it and pinning a bigger one (both are slow).
// Whole pages only when that rounding would not fit the budget. Sizes are at
// most half of SIZE_MAX here, so nothing wraps.
size_t slot_capacity(size_t size, size_t budget) {
  size_t page = AlignedBuffer::kAlignment;
  size_t step = page;
  while (step < size / 8) step *= 2;
  size_t loose = std::max((size + step - 1) / step * step, page);
  return loose <= budget ? loose : std::max((size + page - 1) / page * page, page);
}

bool is_ready(const std::unique_ptr<AlignedBuffer>& buffer) {
  return buffer->fence == nullptr || buffer->fence->ready();
}

// Memory a copy still reads must not be unpinned or freed under it.
void wait_for_copies(AlignedBuffer& buffer) {
  if (buffer.fence) {
    try {
      buffer.fence->wait();
    } catch (...) {  // the driver failed: nothing left to wait for
    }
  }
}

}  // namespace

PinnedRing::PinnedRing(size_t max_buffers, size_t max_bytes, std::shared_ptr<HostPinner> pinner)
    : max_buffers_(max_buffers), max_bytes_(max_bytes), pinner_(std::move(pinner)) {
  if (pinner_ && max_buffers_ == 0) throw Error("a pinned ring needs at least one slot");
}

PinnedRing::~PinnedRing() {
  for (auto& buffer : idle_) destroy(std::move(buffer));
}

std::shared_ptr<AlignedBuffer> PinnedRing::acquire(size_t size, Clock::time_point deadline) {
  std::unique_ptr<AlignedBuffer> buffer;
  if (pinner_) {
    buffer = take_pinned(size, deadline);
    if (!buffer) return nullptr;
  } else {
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
  if (!buffer) buffer = std::make_unique<AlignedBuffer>(size);
  return hand_out(std::move(buffer), size);
}

std::unique_ptr<AlignedBuffer> PinnedRing::take_pinned(size_t size, Clock::time_point deadline) {
  // A size near SIZE_MAX would wrap when rounded up to whole pages.
  if (size > max_bytes_ || size > SIZE_MAX / 2 || slot_capacity(size, max_bytes_) > max_bytes_) {
    throw Error("a pinned slot of " + std::to_string(size) + " bytes is more than the ring's " +
                std::to_string(max_bytes_) + " bytes of page-locked memory; raise its budget");
  }
  size_t need = slot_capacity(size, max_bytes_);
  std::unique_lock<std::mutex> lock(mutex_);
  auto take = [this](size_t i) {
    std::unique_ptr<AlignedBuffer> b = std::move(idle_[i]);
    idle_.erase(idle_.begin() + static_cast<std::ptrdiff_t>(i));
    idle_bytes_ -= b->capacity();
    return b;
  };
  bool timed_out = false;
  for (;;) {
    // 1. The smallest idle slot that fits and that no copy still reads.
    size_t best = idle_.size();
    for (size_t i = 0; i < idle_.size(); ++i) {
      size_t capacity = idle_[i]->capacity();
      if (capacity >= size && (best == idle_.size() || capacity < idle_[best]->capacity()) &&
          is_ready(idle_[i])) {
        best = i;
      }
    }
    if (best < idle_.size()) {
      auto b = take(best);
      b->fence.reset();
      return b;
    }
    // 2. Room for a new slot: page-locking is slow, so it happens unlocked.
    if (slots_ < max_buffers_ && slot_bytes_ + need <= max_bytes_) {
      ++slots_;
      slot_bytes_ += need;
      lock.unlock();
      try {
        return std::make_unique<AlignedBuffer>(size, need, pinner_);
      } catch (...) {
        lock.lock();
        --slots_;
        slot_bytes_ -= need;
        returned_.notify_all();  // the budget it held is free again
        throw;
      }
    }
    // 3. Make room by letting go of an idle slot too small for this request. Its
    // budget stays taken until it is unpinned, so the bounds hold meanwhile.
    size_t spare = idle_.size();
    for (size_t i = 0; i < idle_.size() && spare == idle_.size(); ++i) {
      if (is_ready(idle_[i])) spare = i;
    }
    if (spare < idle_.size()) {
      auto b = take(spare);
      size_t capacity = b->capacity();
      lock.unlock();
      destroy(std::move(b));
      lock.lock();
      --slots_;
      slot_bytes_ -= capacity;
      returned_.notify_all();
      continue;
    }
    if (timed_out) return nullptr;  // looked once more after the deadline: nothing
    // 4. Every idle slot is still being copied from: wait for the oldest copy
    // (polling when there is a deadline: an event wait cannot time out).
    if (!idle_.empty()) {
      std::shared_ptr<Fence> fence = idle_.front()->fence;
      lock.unlock();
      if (deadline == Clock::time_point::max()) {
        fence->wait();
      } else {
        while (!fence->ready() && Clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
        timed_out = Clock::now() >= deadline;
      }
      lock.lock();
      continue;
    }
    // 5. Every slot is handed out: wait for one to come back, then look again
    // (also after the deadline: a slot may have come back just then).
    timed_out = returned_.wait_until(lock, deadline) == std::cv_status::timeout;
  }
}

std::shared_ptr<AlignedBuffer> PinnedRing::hand_out(std::unique_ptr<AlignedBuffer> buffer,
                                                    size_t size) {
  buffer->resize(size);
  std::weak_ptr<PinnedRing> pool = weak_from_this();
  pid_t owner = getpid();
  return std::shared_ptr<AlignedBuffer>(buffer.release(), [pool, owner](AlignedBuffer* b) {
    // In a forked child the pool's lock may be held by a parent thread that
    // is not here, and the driver is gone: just free the memory.
    if (getpid() == owner) {
      if (auto alive = pool.lock()) {
        alive->put(b);
        return;
      }
      wait_for_copies(*b);
    }
    delete b;
  });
}

void PinnedRing::put(AlignedBuffer* raw) {
  std::unique_ptr<AlignedBuffer> buffer(raw);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!pinner_ && (idle_.size() >= max_buffers_ || idle_bytes_ + buffer->capacity() > max_bytes_)) {
    return;
  }
  idle_bytes_ += buffer->capacity();
  idle_.push_back(std::move(buffer));
  // All waiters: the one woken might want a bigger slot than this one.
  returned_.notify_all();
}

void PinnedRing::destroy(std::unique_ptr<AlignedBuffer> buffer) { wait_for_copies(*buffer); }

size_t PinnedRing::idle_slots() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return idle_.size();
}

size_t PinnedRing::slots() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pinner_ ? slots_ : idle_.size();
}

size_t PinnedRing::pinned_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return slot_bytes_;
}

}  // namespace stoker::io
