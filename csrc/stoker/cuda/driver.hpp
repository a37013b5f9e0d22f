// The CUDA driver, opened with dlopen on first use and never linked: one build
// imports and reads on the CPU on machines with no CUDA at all. Only the entry
// points stoker calls are looked up; they live in one table. A missing library,
// a missing device or a forked child of a CUDA process is a status (and a
// CudaError when something needs the driver), never a crash at import.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <string>

namespace stoker::cuda {

// The driver's ABI types, declared here so no CUDA header is needed to build.
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;

constexpr CUresult kSuccess = 0;
constexpr CUresult kNotReady = 600;
constexpr unsigned kStreamNonBlocking = 1;
constexpr unsigned kEventBlockingSync = 1;
constexpr unsigned kEventDisableTiming = 2;
constexpr unsigned kHostRegisterPortable = 1;
constexpr unsigned kHostAllocPortable = 1;
constexpr int kMemoryTypeDevice = 2;  // CU_MEMORYTYPE_DEVICE

// cuda.h's CUDA_MEMCPY2D (the _v2 layout, size_t fields), field for field.
struct Memcpy2D {
  size_t srcXInBytes;
  size_t srcY;
  int srcMemoryType;  // CUmemorytype, an enum
  const void* srcHost;
  CUdeviceptr srcDevice;
  void* srcArray;  // CUarray
  size_t srcPitch;
  size_t dstXInBytes;
  size_t dstY;
  int dstMemoryType;
  void* dstHost;
  CUdeviceptr dstDevice;
  void* dstArray;
  size_t dstPitch;
  size_t WidthInBytes;
  size_t Height;
};
static_assert(sizeof(void*) != 8 || sizeof(Memcpy2D) == 128, "CUDA_MEMCPY2D is 128 bytes");

struct DriverApi {
  CUresult (*Init)(unsigned);
  CUresult (*DriverGetVersion)(int*);
  CUresult (*DeviceGetCount)(int*);
  CUresult (*DeviceGet)(CUdevice*, int);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*CtxGetCurrent)(CUcontext*);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*GetErrorString)(CUresult, const char**);
  CUresult (*MemHostRegister)(void*, size_t, unsigned);
  CUresult (*MemHostUnregister)(void*);
  CUresult (*MemHostAlloc)(void**, size_t, unsigned);
  CUresult (*MemFreeHost)(void*);
  CUresult (*StreamCreate)(CUstream*, unsigned);
  CUresult (*StreamDestroy)(CUstream);
  CUresult (*EventCreate)(CUevent*, unsigned);
  CUresult (*EventDestroy)(CUevent);
  CUresult (*EventRecord)(CUevent, CUstream);
  CUresult (*EventQuery)(CUevent);
  CUresult (*EventSynchronize)(CUevent);
  CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
  CUresult (*MemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*Memcpy2DAsync)(const Memcpy2D*, CUstream);
  CUresult (*StreamSynchronize)(CUstream);
};

struct DriverStatus {
  bool available = false;
  std::string reason;   // why not, or what was found
  std::string library;  // the path dlopen was given
  int version = 0;      // e.g. 12080 for CUDA 12.8
  int devices = 0;
};

// Loads the driver and calls cuInit on the first call in this process; later
// calls return what that found. Never throws.
DriverStatus driver_status();

// The entry points, for code about to use them. Throws CudaError when the
// driver is unusable, including in a forked child of the process that
// initialised it (the driver does not survive fork; using it would hang or
// fail obscurely).
const DriverApi& driver();

// Throws CudaError naming `what` and the driver's message unless r is success.
void check(CUresult result, const char* what);
// The driver's words for a result code.
std::string error_text(CUresult result);

// Makes `device`'s primary context (the one torch uses; retained once per
// process) current on the calling thread while it lives, then puts back the
// context that was current before: the caller's thread stays on the device
// torch had it on.
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  CUcontext previous_ = nullptr;
  bool switched_ = false;
};

// The process that loaded the driver; a different getpid() means a fork.
pid_t driver_owner();

}  // namespace stoker::cuda
