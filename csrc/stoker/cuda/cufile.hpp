// cuFile (GPUDirect Storage), opened with dlopen like the driver. Whether
// reads really go disk-to-GPU is decided from the driver's properties, not
// from a handle registering: cuFile registers a handle on any file and then
// quietly falls back to POSIX reads (its compatibility mode) when the
// nvidia-fs kernel driver, or PCI P2PDMA, is not there.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "stoker/cuda/driver.hpp"

namespace stoker::cuda {

struct CuFileStatus {
  bool available = false;  // the library loaded and cuFileDriverOpen succeeded
  std::string reason;
  std::string library;
  int version = 0;
  bool nvfs = false;                     // the nvidia-fs kernel driver answered
  bool p2p = false;                      // NVMe through PCI P2PDMA, no nvidia-fs needed
  std::vector<std::string> filesystems;  // what the driver can read directly
};

// Loads libcufile ($STOKER_LIBCUFILE, else each of `candidates`, else
// libcufile.so.0) and opens its driver on the first call. Never throws.
CuFileStatus cufile_status(const std::vector<std::string>& candidates);

// A file opened (O_DIRECT where the file system allows it) and registered
// with cuFile once; reads go straight into device memory.
class CuFile {
 public:
  CuFile(std::string path, int device);
  ~CuFile();
  CuFile(const CuFile&) = delete;
  CuFile& operator=(const CuFile&) = delete;

  const std::string& path() const { return path_; }
  int device() const { return device_; }
  bool direct() const { return direct_; }
  // The file's size when it was opened.
  uint64_t size() const { return size_; }
  // Reads [offset, offset + size) into device address `dst`, in pieces of
  // `chunk_bytes` read concurrently by `num_threads` threads.
  void read(CUdeviceptr dst, size_t size, off_t offset, size_t num_threads, size_t chunk_bytes);
  void close();

 private:
  std::string path_;
  int device_;
  int fd_ = -1;
  void* handle_ = nullptr;
  bool direct_ = false;
  uint64_t size_ = 0;
  pid_t owner_;
};

}  // namespace stoker::cuda
