// Host-to-device copies for the pinned ring: a dedicated non-blocking stream
// per device, an event recorded after every copy, and that event as the
// copied slot's fence, so the ring hands the slot out again only once the
// copy has read it. The consumer's stream waits on the event on the device
// (cuStreamWaitEvent); nothing here waits on the host.
#pragma once

#include <cstddef>
#include <memory>

#include "stoker/cuda/driver.hpp"
#include "stoker/io/aligned_buffer.hpp"
#include "stoker/io/pinned_ring.hpp"

namespace stoker::cuda {

// Page-locks ring slots with cuMemHostRegister (portable: usable from every
// context, so one ring can feed any device).
class HostRegistrar : public io::HostPinner {
 public:
  explicit HostRegistrar(int device) : device_(device) {}
  void pin(void* data, size_t size) override;
  void unpin(void* data) noexcept override;

 private:
  int device_;
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
  std::shared_ptr<Event> copy_device(CUdeviceptr src, CUdeviceptr dst, size_t size,
                                     CUstream consumer);
  // An event recorded on this stream now: done once everything queued is.
  std::shared_ptr<Event> record();
  // Copies queued from now on start after the work queued on `producer` so far
  // (a wait on the device, not on the host).
  void wait_for(CUstream producer);

 private:
  void hand_to(CUstream consumer, const Event& event);

  int device_;
  CUstream stream_ = nullptr;
  pid_t owner_;
};

}  // namespace stoker::cuda
