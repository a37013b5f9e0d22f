// The ring of reusable host slots that batches are read into. A slot goes
// back to the ring only when the last reference to it goes (the tensors that
// view it are freed), so a batch a user keeps is never overwritten.
// Reuse matters: a fresh multi-megabyte buffer per batch costs page faults to
// fill it and an munmap (a TLB shootdown on every core) to free it.
//
// Two kinds of ring:
// - plain (no pinner): slots are page-aligned memory; a user keeping many
//   never blocks the reader (a slot is then simply new); only idle slots are
//   bounded.
// - pinned: every slot is page-locked once, when made, so copies to a device
//   are truly asynchronous; page-locked memory is taken from the whole
//   machine, so the bounds hold for all slots, live or idle, and acquire()
//   waits for one to come back. A returned slot that a device copy still reads
//   (its fence) is handed out again only once that copy has completed.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "stoker/io/aligned_buffer.hpp"

namespace stoker::io {

class PinnedRing : public std::enable_shared_from_this<PinnedRing> {
 public:
  using Clock = std::chrono::steady_clock;

  // Keeps at most `max_buffers` slots and `max_bytes` in them: idle ones for a
  // plain ring, all of them for a pinned one.
  PinnedRing(size_t max_buffers, size_t max_bytes, std::shared_ptr<HostPinner> pinner = nullptr);
  ~PinnedRing();

  // A slot of at least `size` bytes (its size() is `size`), handed back to
  // the ring when the last reference to it goes. A pinned ring waits until
  // `deadline` for a slot to come back and returns null if none did.
  std::shared_ptr<AlignedBuffer> acquire(size_t size,
                                         Clock::time_point deadline = Clock::time_point::max());
  size_t idle_slots() const;
  bool pinned() const { return pinner_ != nullptr; }
  size_t slots() const;         // slots in existence: idle and handed out
  size_t pinned_bytes() const;  // bytes page-locked now

 private:
  std::shared_ptr<AlignedBuffer> hand_out(std::unique_ptr<AlignedBuffer> buffer, size_t size);
  std::unique_ptr<AlignedBuffer> take_pinned(size_t size, Clock::time_point deadline);
  void put(AlignedBuffer* buffer);
  static void destroy(std::unique_ptr<AlignedBuffer> buffer);  // once no copy reads it

  size_t max_buffers_;
  size_t max_bytes_;
  std::shared_ptr<HostPinner> pinner_;
  mutable std::mutex mutex_;
  std::condition_variable returned_;
  std::vector<std::unique_ptr<AlignedBuffer>> idle_;
  size_t idle_bytes_ = 0;
  size_t slots_ = 0;       // pinned ring: every slot made and not destroyed
  size_t slot_bytes_ = 0;  // pinned ring: their capacity
};

}  // namespace stoker::io
