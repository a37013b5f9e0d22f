// Runs of bytes scattered over files (the rows of patches of volumes) read
// with cuFile straight into device memory. cuFile is slow per call, and a
// patch has thousands of runs: so it reads whole spans of a file instead (runs
// closer than a gap merged, as the CPU reader merges them) into device scratch
// memory, and device-to-device copies put each run in its place. Runs of equal
// length at constant source and destination strides go in one 2-D copy, and
// spans are laid out in the scratch so that such a stride carries on from one
// span to the next: a 64^3 patch of a 256^3 volume costs one copy, not 4,096.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "stoker/cuda/copy_stream.hpp"
#include "stoker/cuda/cufile.hpp"
#include "stoker/cuda/driver.hpp"

namespace stoker::cuda {

// Run i is `lengths[i]` bytes at `offsets[i]` of file `file_ids[i]`, bound for
// byte `dest_offsets[i]` of the destination.
struct GatherRuns {
  const uint32_t* file_ids = nullptr;
  const uint64_t* offsets = nullptr;
  const uint64_t* lengths = nullptr;
  const uint64_t* dest_offsets = nullptr;
  size_t count = 0;
};

struct GatherOptions {
  size_t threads = 0;                      // cuFile reads at once; 0: one per core, at most 8
  uint64_t merge_gap = uint64_t{8} << 10;  // runs of a file closer than this: one span
  // Spans are read from and into multiples of this (O_DIRECT's and GPUDirect's
  // unit) where that does not break a 2-D copy into one per span; 0 or 1: never.
  uint64_t align = 4096;
};

struct GatherStats {
  uint64_t spans = 0;           // regions of files read
  uint64_t reads = 0;           // cuFileRead calls: spans, in pieces of at most 4 MiB
  uint64_t bytes_read = 0;      // the runs, the gaps merged between them, alignment
  uint64_t copies = 0;          // 1-D device-to-device copies
  uint64_t copies_2d = 0;       // 2-D copies
  uint64_t rounds = 0;          // times the scratch was filled
  std::shared_ptr<Event> done;  // recorded on the stream after the last copy
};

// Reads the runs from `files` (indexed by file id, each opened for `device`)
// into `dest` (`dest_bytes` of device memory) through `scratch_bytes` of
// device memory at `scratch`; the copies are queued on `stream`. Every run is
// checked to lie inside `dest` before anything is read.
//
// cuFile writes the scratch from the host, outside any stream: the caller makes
// sure no earlier copy out of it is still pending (done->wait() on the last
// gather's event). Inside one call, a full scratch is reused only after a
// cuStreamSynchronize of `stream`; if the call throws, no copy out of the
// scratch is pending when it returns. The destination is written by the copies
// on `stream` only, so work queued there later sees it.
//
// Throws CuFileError (naming the file and offset) when a read fails, CudaError
// when a copy cannot be queued, Error for runs outside `dest` or the files.
GatherStats gather_to_device(const std::vector<std::shared_ptr<CuFile>>& files, int device,
                             CUdeviceptr dest, uint64_t dest_bytes, CUdeviceptr scratch,
                             uint64_t scratch_bytes, const GatherRuns& runs, CUstream stream,
                             const GatherOptions& options = {});

}  // namespace stoker::cuda
