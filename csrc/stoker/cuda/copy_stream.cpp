#include "stoker/cuda/copy_stream.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <string>
#include <utility>

#include "stoker/errors.hpp"

namespace stoker::cuda {

uint8_t* PinnedHostMemory::allocate(size_t size) {
  const DriverApi& api = driver();
  DeviceScope scope(device_);
  std::lock_guard<std::mutex> lock(mutex_);
  if (register_refused_.empty()) {
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    madvise(p, size, MADV_DONTFORK);
    CUresult result = api.MemHostRegister(p, size, kHostRegisterPortable);
    if (result == kSuccess) return static_cast<uint8_t*>(p);
    munmap(p, size);
    register_refused_ = error_text(result);
  }
  void* p = nullptr;
  CUresult result = api.MemHostAlloc(&p, size, kHostAllocPortable);
  if (result != kSuccess) {
    throw CudaError("cannot page-lock " + std::to_string(size) +
                    " bytes of host memory: cuMemHostRegister failed (" + register_refused_ +
                    ") and cuMemHostAlloc failed (" + error_text(result) +
                    "); is the locked-memory limit (ulimit -l) too low?");
  }
  allocated_.insert(static_cast<uint8_t*>(p));
  return static_cast<uint8_t*>(p);
}

void PinnedHostMemory::release(uint8_t* data, size_t size) noexcept {
  if (getpid() != driver_owner()) {
    // A forked child: registered slots are not mapped here (MADV_DONTFORK);
    // driver allocations cannot be given back without the parent's driver.
    return;
  }
  bool from_driver;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    from_driver = allocated_.erase(data) > 0;
  }
  try {
    DeviceScope scope(device_);
    if (from_driver) {
      driver().MemFreeHost(data);
      return;
    }
    driver().MemHostUnregister(data);
  } catch (...) {  // nothing to do about a driver that fails while freeing
  }
  if (!from_driver) munmap(data, size);
}

Event::Event(int device, CUstream stream) : device_(device), owner_(getpid()) {
  const DriverApi& api = driver();
  DeviceScope scope(device_);
  // Blocking sync: a host that waits for a copy sleeps instead of spinning a core.
  check(api.EventCreate(&event_, kEventDisableTiming | kEventBlockingSync), "cuEventCreate");
  CUresult recorded = api.EventRecord(event_, stream);
  if (recorded != kSuccess) {
    api.EventDestroy(event_);
    check(recorded, "cuEventRecord");
  }
}

Event::~Event() {
  if (event_ != nullptr && getpid() == owner_) {
    try {
      DeviceScope scope(device_);
      driver().EventDestroy(event_);
    } catch (...) {
    }
  }
}

bool Event::ready() {
  const DriverApi& api = driver();
  DeviceScope scope(device_);
  CUresult result = api.EventQuery(event_);
  if (result == kNotReady) return false;
  check(result, "cuEventQuery");
  return true;
}

void Event::wait() {
  const DriverApi& api = driver();
  DeviceScope scope(device_);
  check(api.EventSynchronize(event_), "cuEventSynchronize");
}

void Event::make_wait(CUstream stream) {
  const DriverApi& api = driver();
  DeviceScope scope(device_);
  check(api.StreamWaitEvent(stream, event_, 0), "cuStreamWaitEvent");
}

CopyStream::CopyStream(int device) : device_(device), owner_(getpid()) {
  const DriverApi& api = driver();
  DeviceScope scope(device_);
  // Non-blocking: the copy stream must not serialise with the legacy default
  // stream that other libraries may be using.
  check(api.StreamCreate(&stream_, kStreamNonBlocking), "cuStreamCreate");
}

CopyStream::~CopyStream() {
  if (stream_ != nullptr && getpid() == owner_) {
    try {
      DeviceScope scope(device_);
      driver().StreamDestroy(stream_);  // queued work still completes
    } catch (...) {
    }
  }
}

void CopyStream::wait_for(CUstream producer) {
  DeviceScope scope(device_);
  Event done(device_, producer);
  check(driver().StreamWaitEvent(stream_, done.handle(), 0), "cuStreamWaitEvent");
}

std::shared_ptr<Event> CopyStream::copy_to_device(const std::shared_ptr<io::AlignedBuffer>& slot,
                                                  const uint8_t* src, size_t size, CUdeviceptr dst,
                                                  CUstream consumer) {
  if (!slot->pinned()) {
    throw Error(
        "a device copy needs a slot of a pinned ring (pageable memory would make the "
        "copy synchronous)");
  }
  if (src < slot->data() || size > slot->capacity() ||
      static_cast<size_t>(src - slot->data()) > slot->capacity() - size) {
    throw Error("the bytes to copy are not inside their slot");
  }
  const DriverApi& api = driver();
  DeviceScope scope(device_);
  check(api.MemcpyHtoDAsync(dst, src, size, stream_), "cuMemcpyHtoDAsync");
  auto event = std::make_shared<Event>(device_, stream_);
  // Fenced before anything else can fail: the copy is queued and reads the slot.
  if (slot->fence && !slot->fence->ready()) {
    slot->fence = std::make_shared<io::FencePair>(slot->fence, event);
  } else {
    slot->fence = event;
  }
  check(api.StreamWaitEvent(consumer, event->handle(), 0), "cuStreamWaitEvent");
  return event;
}

std::shared_ptr<Event> CopyStream::record() { return std::make_shared<Event>(device_, stream_); }

}  // namespace stoker::cuda
