#include "stoker/cuda/cufile.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "stoker/errors.hpp"
#include "stoker/util/dynamic_library.hpp"

namespace stoker::cuda {

namespace {

// cufile.h's ABI, declared here so no header is needed to build.
struct CUfileError {
  int err;
  CUresult cu_err;
};
struct CUfileDrvProps {
  struct {
    unsigned major_version;
    unsigned minor_version;
    size_t poll_thresh_size;
    size_t max_direct_io_size;
    unsigned dstatusflags;
    unsigned dcontrolflags;
  } nvfs;
  unsigned fflags;
  unsigned max_device_cache_size;
  unsigned per_buffer_cache_size;
  unsigned max_device_pinned_mem_size;
  unsigned max_batch_io_size;
  unsigned max_batch_io_timeout_msecs;
};
struct CUfileDescr {
  int type;  // 1: a Linux file descriptor
  union {
    int fd;
    void* handle;
  } handle;
  const void* fs_ops;
};

constexpr int kHandleTypeFd = 1;
constexpr int kErrorBase = 5000;
constexpr int kCudaDriverError = kErrorBase + 11;
constexpr unsigned kNvmeP2pBit = 11;

struct CuFileApi {
  CUfileError (*DriverOpen)();
  CUfileError (*DriverGetProperties)(CUfileDrvProps*);
  CUfileError (*GetVersion)(int*);  // optional: cuFile 1.9 and later
  CUfileError (*HandleRegister)(void**, CUfileDescr*);
  void (*HandleDeregister)(void*);
  ssize_t (*Read)(void*, void*, size_t, off_t, off_t);
};

struct Loaded {
  CuFileApi api{};
  CuFileStatus status;
  pid_t owner = 0;
};

std::string cufile_error_text(int code) {
  switch (code) {
    case kErrorBase + 1:
      return "the nvidia-fs driver is not loaded and compatibility mode is off";
    case kErrorBase + 7:
      return "GPUDirect Storage is not supported on this platform";
    case kErrorBase + 8:
      return "GPUDirect Storage is not supported for this file";
    case kErrorBase + 9:
      return "GPUDirect Storage is not supported on this GPU";
    case kErrorBase + 19:
      return "unsupported open flags";
    case kErrorBase + 20:
      return "the file is not opened with O_DIRECT";
    case kErrorBase + 25:
      return "permission denied";
    default:
      return "cuFile error " + std::to_string(code);
  }
}

std::string status_text(CUfileError e) {
  if (e.err == kCudaDriverError) return "CUDA driver error " + std::to_string(e.cu_err);
  return cufile_error_text(e.err);
}

const char* filesystem_names[] = {"lustre", "wekafs",   "nfs",       "gpfs",   "nvme",
                                  "nvmeof", "scsi",     "scaleflux", "nvmesh", "beegfs",
                                  nullptr,  "nvme-p2p", "scatefs"};

Loaded& load(const std::vector<std::string>& candidates) {
  static Loaded* loaded = [&candidates] {
    auto* l = new Loaded();  // leaked: see the driver's
    l->owner = getpid();
    DriverStatus cuda = driver_status();
    if (!cuda.available) {
      l->status.reason = "cuFile needs the CUDA driver: " + cuda.reason;
      return l;
    }
    std::vector<std::string> paths;
    const char* env = std::getenv("STOKER_LIBCUFILE");
    if (env != nullptr && *env != '\0') {
      paths.push_back(env);
    } else {
      paths = candidates;
      paths.push_back("libcufile.so.0");
    }
    auto library = util::DynamicLibrary::open(paths);
    if (!library.loaded()) {
      l->status.reason = "cannot load cuFile (" + library.failures() +
                         "); install the nvidia-cufile wheel or set STOKER_LIBCUFILE";
      return l;
    }
    l->status.library = library.candidate();
    CuFileApi& a = l->api;
    library.bind("cuFileDriverOpen", a.DriverOpen);
    library.bind("cuFileDriverGetProperties", a.DriverGetProperties);
    library.bind("cuFileHandleRegister", a.HandleRegister);
    library.bind("cuFileHandleDeregister", a.HandleDeregister);
    library.bind("cuFileRead", a.Read);
    if (!library.missing().empty()) {
      l->status.reason = l->status.library + " has no " + library.missing();
      return l;
    }
    // cuFileGetVersion came with cuFile 1.9: without it, version 0.
    library.bind_optional("cuFileGetVersion", a.GetVersion);
    CUfileError opened = a.DriverOpen();
    if (opened.err != 0) {
      l->status.reason = "cuFileDriverOpen failed: " + status_text(opened);
      return l;
    }
    if (a.GetVersion != nullptr) a.GetVersion(&l->status.version);
    CUfileDrvProps props{};
    CUfileError queried = a.DriverGetProperties(&props);
    if (queried.err != 0) {
      l->status.reason = "cuFileDriverGetProperties failed: " + status_text(queried);
      return l;
    }
    l->status.available = true;
    l->status.nvfs = props.nvfs.major_version > 0;
    l->status.p2p = (props.nvfs.dstatusflags >> kNvmeP2pBit) & 1U;
    for (unsigned bit = 0; bit < sizeof(filesystem_names) / sizeof(*filesystem_names); ++bit) {
      if (filesystem_names[bit] != nullptr && ((props.nvfs.dstatusflags >> bit) & 1U)) {
        l->status.filesystems.push_back(filesystem_names[bit]);
      }
    }
    if (l->status.nvfs) {
      l->status.reason = "nvidia-fs " + std::to_string(props.nvfs.major_version) + "." +
                         std::to_string(props.nvfs.minor_version) + " is loaded";
    } else if (l->status.p2p) {
      l->status.reason = "NVMe reads through PCI P2PDMA";
    } else {
      l->status.reason =
          "neither the nvidia-fs driver nor PCI P2PDMA is available: cuFile would only "
          "read through its POSIX compatibility mode";
    }
    return l;
  }();
  return *loaded;
}

const CuFileApi& cufile() {
  Loaded& l = load({});
  if (!l.status.available) throw CuFileError("cuFile is not usable: " + l.status.reason);
  if (getpid() != l.owner) {
    throw CuFileError("cuFile was opened in process " + std::to_string(l.owner) +
                      " and this process was forked from it; a forked child cannot use it");
  }
  return l.api;
}

}  // namespace

CuFileStatus cufile_status(const std::vector<std::string>& candidates) {
  return load(candidates).status;
}

CuFile::CuFile(std::string path, int device)
    : path_(std::move(path)), device_(device), owner_(getpid()) {
  const CuFileApi& api = cufile();
  DeviceScope scope(device_);
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  direct_ = fd_ >= 0;
  if (fd_ < 0 && errno == EINVAL) {  // tmpfs and some others refuse O_DIRECT
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  }
  if (fd_ < 0) {
    int err = errno;
    throw ReadError(path_, 0, err, std::string("cannot open: ") + std::strerror(err));
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    int err = errno;
    ::close(fd_);
    fd_ = -1;
    throw ReadError(path_, 0, err, std::string("cannot stat: ") + std::strerror(err));
  }
  size_ = static_cast<uint64_t>(st.st_size);
  CUfileDescr descr{};
  descr.type = kHandleTypeFd;
  descr.handle.fd = fd_;
  CUfileError registered = api.HandleRegister(&handle_, &descr);
  if (registered.err != 0) {
    ::close(fd_);
    fd_ = -1;
    handle_ = nullptr;
    throw CuFileError(path_, 0, "cuFileHandleRegister failed: " + status_text(registered));
  }
}

CuFile::~CuFile() { close(); }

void CuFile::close() {
  if (getpid() != owner_) return;  // a forked child: neither handle is ours to release
  if (handle_ != nullptr) {
    try {
      cufile().HandleDeregister(handle_);
    } catch (...) {
    }
    handle_ = nullptr;
  }
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

void CuFile::read(CUdeviceptr dst, size_t size, off_t offset, size_t num_threads,
                  size_t chunk_bytes) {
  const CuFileApi& api = cufile();
  if (handle_ == nullptr) throw CuFileError(path_, static_cast<uint64_t>(offset), "file is closed");
  if (chunk_bytes == 0) chunk_bytes = size_t{16} << 20;
  size_t chunks = (size + chunk_bytes - 1) / chunk_bytes;
  if (chunks == 0) return;
  // More threads than this only queue up in cuFile and the NVMe queues.
  if (num_threads == 0) num_threads = std::clamp(std::thread::hardware_concurrency(), 1U, 8U);
  num_threads = std::min(num_threads, chunks);
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::exception_ptr error;
  auto work = [&] {
    try {
      DeviceScope scope(device_);  // cuFile reads on the calling thread's context
      for (size_t i = next++; i < chunks && !failed; i = next++) {
        size_t done = i * chunk_bytes;
        size_t end = std::min(size, done + chunk_bytes);
        while (done < end) {
          off_t at = offset + static_cast<off_t>(done);
          ssize_t got = api.Read(handle_, reinterpret_cast<void*>(dst), end - done, at,
                                 static_cast<off_t>(done));
          if (got < 0) {
            // -1 with errno, a negated errno, or a negated cuFile status (5000 and up).
            int code = got == -1 ? errno : static_cast<int>(-got);
            std::string why = code < kErrorBase ? std::strerror(code) : cufile_error_text(code);
            throw CuFileError(path_, static_cast<uint64_t>(at), "cuFileRead failed: " + why);
          }
          if (got == 0) {
            throw CuFileError(path_, static_cast<uint64_t>(at),
                              "cuFileRead: the file ends before the " + std::to_string(size) +
                                  " bytes asked for");
          }
          done += static_cast<size_t>(got);
        }
      }
    } catch (...) {
      failed = true;
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  for (size_t t = 1; t < num_threads; ++t) threads.emplace_back(work);
  work();
  for (auto& thread : threads) thread.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace stoker::cuda
