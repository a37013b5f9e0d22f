#include "stoker/cuda/driver.hpp"

#include <unistd.h>

#include <cstdlib>
#include <mutex>
#include <vector>

#include "stoker/errors.hpp"
#include "stoker/util/dynamic_library.hpp"

namespace stoker::cuda {

namespace {

struct Loaded {
  DriverApi api{};
  DriverStatus status;
  pid_t owner = 0;
  std::mutex contexts_mutex;
  std::vector<CUcontext> contexts;  // the retained primary context of each device
};

std::string describe(const DriverApi& api, CUresult result) {
  const char* text = nullptr;
  if (api.GetErrorString == nullptr || api.GetErrorString(result, &text) != kSuccess ||
      text == nullptr) {
    return "CUDA error " + std::to_string(result);
  }
  return std::string(text) + " (CUDA error " + std::to_string(result) + ")";
}

Loaded& load() {
  // Leaked on purpose: entry points must stay valid for threads and
  // destructors that run during interpreter shutdown.
  static Loaded* loaded = [] {
    auto* l = new Loaded();
    l->owner = getpid();
    const char* env = std::getenv("STOKER_LIBCUDA");
    l->status.library = env != nullptr && *env != '\0' ? env : "libcuda.so.1";
    auto library = util::DynamicLibrary::open({l->status.library});
    if (!library.loaded()) {
      l->status.reason = "cannot load the CUDA driver: " + library.failures() +
                         " (no NVIDIA driver here, or set STOKER_LIBCUDA to its path)";
      return l;
    }
    DriverApi& a = l->api;
    library.bind("cuInit", a.Init);
    library.bind("cuDriverGetVersion", a.DriverGetVersion);
    library.bind("cuDeviceGetCount", a.DeviceGetCount);
    library.bind("cuDeviceGet", a.DeviceGet);
    library.bind("cuDevicePrimaryCtxRetain", a.DevicePrimaryCtxRetain);
    library.bind("cuCtxGetCurrent", a.CtxGetCurrent);
    library.bind("cuCtxSetCurrent", a.CtxSetCurrent);
    library.bind("cuGetErrorString", a.GetErrorString);
    library.bind("cuMemHostRegister_v2", a.MemHostRegister);
    library.bind("cuMemHostUnregister", a.MemHostUnregister);
    library.bind("cuMemHostAlloc", a.MemHostAlloc);
    library.bind("cuMemFreeHost", a.MemFreeHost);
    library.bind("cuStreamCreate", a.StreamCreate);
    library.bind("cuStreamDestroy_v2", a.StreamDestroy);
    library.bind("cuEventCreate", a.EventCreate);
    library.bind("cuEventDestroy_v2", a.EventDestroy);
    library.bind("cuEventRecord", a.EventRecord);
    library.bind("cuEventQuery", a.EventQuery);
    library.bind("cuEventSynchronize", a.EventSynchronize);
    library.bind("cuStreamWaitEvent", a.StreamWaitEvent);
    library.bind("cuMemcpyHtoDAsync_v2", a.MemcpyHtoDAsync);
    library.bind("cuMemcpyDtoDAsync_v2", a.MemcpyDtoDAsync);
    library.bind("cuMemcpy2DAsync_v2", a.Memcpy2DAsync);
    library.bind("cuStreamSynchronize", a.StreamSynchronize);
    if (!library.missing().empty()) {
      l->status.reason =
          l->status.library + " has no " + library.missing() + ": the driver is too old";
      return l;
    }
    CUresult result = a.Init(0);
    if (result != kSuccess) {
      l->status.reason = "cuInit failed: " + describe(a, result);
      return l;
    }
    a.DriverGetVersion(&l->status.version);
    a.DeviceGetCount(&l->status.devices);
    if (l->status.devices <= 0) {
      l->status.reason = "the CUDA driver reports no device";
      return l;
    }
    l->status.available = true;
    l->status.reason = "CUDA driver " + std::to_string(l->status.version / 1000) + "." +
                       std::to_string(l->status.version % 1000 / 10) + ", " +
                       std::to_string(l->status.devices) + " device(s)";
    l->contexts.assign(static_cast<size_t>(l->status.devices), nullptr);
    return l;
  }();
  return *loaded;
}

}  // namespace

DriverStatus driver_status() {
  Loaded& l = load();
  if (l.status.available && getpid() != l.owner) {
    DriverStatus forked = l.status;
    forked.available = false;
    forked.reason = "this process was forked from process " + std::to_string(l.owner) +
                    ", which had initialised CUDA; a forked child cannot use it";
    return forked;
  }
  return l.status;
}

const DriverApi& driver() {
  Loaded& l = load();
  if (!l.status.available) throw CudaError("CUDA is not usable: " + l.status.reason);
  if (getpid() != l.owner) {
    throw CudaError("CUDA was initialised in process " + std::to_string(l.owner) +
                    " and this process was forked from it; the CUDA driver does not survive a "
                    "fork. Use the GPU path in the parent only, or start workers with the "
                    "'spawn' method (torch DataLoader: multiprocessing_context='spawn')");
  }
  return l.api;
}

void check(CUresult result, const char* what) {
  if (result == kSuccess) return;
  throw CudaError(std::string(what) + " failed: " + error_text(result));
}

std::string error_text(CUresult result) { return describe(load().api, result); }

DeviceScope::DeviceScope(int device) {
  const DriverApi& api = driver();
  Loaded& l = load();
  if (device < 0 || device >= l.status.devices) {
    throw CudaError("CUDA device " + std::to_string(device) + " does not exist (" +
                    std::to_string(l.status.devices) + " device(s))");
  }
  CUcontext context;
  {
    std::lock_guard<std::mutex> lock(l.contexts_mutex);
    context = l.contexts[static_cast<size_t>(device)];
    if (context == nullptr) {
      CUdevice handle = 0;
      check(api.DeviceGet(&handle, device), "cuDeviceGet");
      check(api.DevicePrimaryCtxRetain(&context, handle), "cuDevicePrimaryCtxRetain");
      l.contexts[static_cast<size_t>(device)] = context;
    }
  }
  check(api.CtxGetCurrent(&previous_), "cuCtxGetCurrent");
  if (previous_ != context) {
    check(api.CtxSetCurrent(context), "cuCtxSetCurrent");
    switched_ = true;
  }
}

DeviceScope::~DeviceScope() {
  if (switched_) load().api.CtxSetCurrent(previous_);
}

pid_t driver_owner() { return load().owner; }

}  // namespace stoker::cuda
