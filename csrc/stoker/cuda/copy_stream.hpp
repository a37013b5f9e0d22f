// Host-to-device copies for the pinned ring: a dedicated non-blocking stream
// per device, an event recorded after every copy, and that event as the
// copied slot's fence, so the ring hands the slot out again only once the
// copy has read it. The consumer's stream waits on the event on the device
// (cuStreamWaitEvent); nothing here waits on the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>

#include "stoker/cuda/driver.hpp"
#include "stoker/io/aligned_buffer.hpp"
#include "stoker/io/pinned_ring.hpp"

namespace stoker::cuda {

// Page-locked memory for ring slots, usable from every context (portable), so
// one ring can feed any device. Each slot is a private mapping a forked child
// does not inherit (a parent's write after a fork must not move it off the
// pages the device copies from), registered with cuMemHostRegister; where the
// driver refuses registration (some sandboxes do), cuMemHostAlloc instead.
class PinnedHostMemory : public io::HostPinner {
 public:
  explicit PinnedHostMemory(int device) : device_(device) {}
  uint8_t* allocate(size_t size) override;
  void release(uint8_t* data, size_t size) noexcept override;

 private:
  int device_;
  std::mutex mutex_;
  std::unordered_set<uint8_t*> allocated_;  // from cuMemHostAlloc, not registered
  std::string register_refused_;            // why cuMemHostRegister is not used
};

// One recorded event. Destroying it is safe while it is pending: the driver
// releases it once it completes.
class Event : public io::Fence {
 public:
  Event(int device, CUstream stream);
  ~Event() override;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  bool ready() override;
  void wait() override;
  // Work queued on `stream` from now on starts after this event: a wait on the
  // device, not on the host.
  void make_wait(CUstream stream);
  CUevent handle() const { return event_; }

 private:
  int device_;
  CUevent event_ = nullptr;
  pid_t owner_;
};

class CopyStream {
 public:
  explicit CopyStream(int device);
  ~CopyStream();
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;

  int device() const { return device_; }
  CUstream handle() const { return stream_; }

  // Copies `size` bytes at `src`, inside the pinned `slot`, to device address
  // `dst`; fences the slot with the copy's event and makes `consumer` wait on it.
  std::shared_ptr<Event> copy_to_device(const std::shared_ptr<io::AlignedBuffer>& slot,
                                        const uint8_t* src, size_t size, CUdeviceptr dst,
                                        CUstream consumer);
  // An event recorded on this stream now: done once everything queued is.
  std::shared_ptr<Event> record();
  // Copies queued from now on start after the work queued on `producer` so far
  // (a wait on the device, not on the host).
  void wait_for(CUstream producer);

 private:
  int device_;
  CUstream stream_ = nullptr;
  pid_t owner_;
};

}  // namespace stoker::cuda
