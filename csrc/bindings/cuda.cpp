// The CUDA shim's Python face: status queries, the copy stream and its events,
// and cuFile handles. Nothing here runs at import: the driver is loaded by the
// first call that needs it.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <optional>

#include "bindings.hpp"
#include "numpy_util.hpp"
#include "stoker/cuda/copy_stream.hpp"
#include "stoker/cuda/cufile.hpp"
#include "stoker/cuda/driver.hpp"
#include "stoker/cuda/gather.hpp"
#include "stoker/errors.hpp"

namespace py = pybind11;

namespace stoker::bindings {

namespace {

cuda::CUstream as_stream(uintptr_t handle) { return reinterpret_cast<cuda::CUstream>(handle); }

}  // namespace

void register_cuda(py::module_& m) {
  m.def(
      "cuda_driver_status",
      [] {
        cuda::DriverStatus s;
        {
          py::gil_scoped_release release;  // cuInit can take seconds
          s = cuda::driver_status();
        }
        py::dict out;
        out["available"] = s.available;
        out["reason"] = s.reason;
        out["library"] = s.library;
        out["version"] = s.version;
        out["devices"] = s.devices;
        return out;
      },
      "Load the CUDA driver (once) and say whether it is usable, and why not.");
  m.def(
      "cufile_status",
      [](const std::vector<std::string>& candidates) {
        cuda::CuFileStatus s;
        {
          py::gil_scoped_release release;
          s = cuda::cufile_status(candidates);
        }
        py::dict out;
        out["available"] = s.available;
        out["reason"] = s.reason;
        out["library"] = s.library;
        out["version"] = s.version;
        out["nvfs"] = s.nvfs;
        out["p2p"] = s.p2p;
        out["filesystems"] = s.filesystems;
        return out;
      },
      py::arg("candidates") = std::vector<std::string>{},
      "Load cuFile (once: $STOKER_LIBCUFILE, else each candidate, else libcufile.so.0), open "
      "its driver and report what its properties say GPUDirect can do.");

  py::class_<cuda::Event, std::shared_ptr<cuda::Event>>(
      m, "Event", "A CUDA event recorded after a copy: done once the copy is.")
      .def("query", &cuda::Event::ready, "Whether the work before it has completed.")
      .def("wait", &cuda::Event::wait, py::call_guard<py::gil_scoped_release>(),
           "Block (GIL released) until the work before it has completed.")
      .def(
          "make_wait", [](cuda::Event& e, uintptr_t stream) { e.make_wait(as_stream(stream)); },
          py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
          "Work queued on `stream` (a CUstream handle) from now on starts after this event: a "
          "wait on the device, not on the host.");

  py::class_<cuda::CopyStream, std::shared_ptr<cuda::CopyStream>>(
      m, "CopyStream",
      "A non-blocking CUDA stream for host-to-device copies out of pinned ring slots.")
      .def(py::init([](int device) {
             py::gil_scoped_release release;
             return std::make_shared<cuda::CopyStream>(device);
           }),
           py::arg("device"))
      .def_property_readonly("device", &cuda::CopyStream::device)
      .def_property_readonly(
          "handle",
          [](const cuda::CopyStream& s) { return reinterpret_cast<uintptr_t>(s.handle()); },
          "The CUstream as an integer (torch.cuda.ExternalStream takes it).")
      .def(
          "copy",
          [](cuda::CopyStream& stream, const py::array& src, uintptr_t dst, uintptr_t consumer) {
            std::shared_ptr<io::AlignedBuffer> slot = slot_of(src);
            if (!slot) {
              throw Error(
                  "copy() takes a view of a slot of a pinned PinnedRing; pageable "
                  "memory would make the copy synchronous");
            }
            if (!(src.flags() & py::array::c_style)) throw Error("copy() needs a contiguous view");
            const auto* data = static_cast<const uint8_t*>(src.data());
            auto size = static_cast<size_t>(src.nbytes());
            py::gil_scoped_release release;
            return stream.copy_to_device(slot, data, size, dst, as_stream(consumer));
          },
          py::arg("src"), py::arg("dst"), py::arg("consumer_stream"),
          "Copy the bytes of `src` (a view of a pinned slot) to device address `dst` "
          "asynchronously; the slot is not reused before the copy completes, and work queued on "
          "`consumer_stream` afterwards sees the bytes. Returns the copy's Event.")
      .def(
          "wait_for",
          [](cuda::CopyStream& s, uintptr_t producer) { s.wait_for(as_stream(producer)); },
          py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
          "Copies queued from now on start after the work queued on `stream` (a CUstream "
          "handle) so far: a wait on the device, not on the host.")
      .def(
          "record",
          [](cuda::CopyStream& s, std::optional<uintptr_t> stream) {
            if (!stream) return s.record();
            return std::make_shared<cuda::Event>(s.device(), as_stream(*stream));
          },
          py::arg("stream") = py::none(),
          "An Event recorded now on `stream` (a CUstream handle; this copy stream by default): "
          "done once everything queued there so far is.");

  py::class_<cuda::CuFile, std::shared_ptr<cuda::CuFile>>(
      m, "CuFile", "A file registered with cuFile: reads go straight into device memory.")
      .def(py::init([](std::string path, int device) {
             py::gil_scoped_release release;  // opening and registering can wait on I/O
             return std::make_shared<cuda::CuFile>(std::move(path), device);
           }),
           py::arg("path"), py::arg("device"))
      .def_property_readonly("path", &cuda::CuFile::path)
      .def_property_readonly("direct", &cuda::CuFile::direct,
                             "Whether it was opened with O_DIRECT (tmpfs refuses it).")
      .def(
          "read",
          [](cuda::CuFile& file, uintptr_t dst, size_t size, int64_t offset, size_t num_threads,
             size_t chunk_bytes) {
            if (offset < 0) throw Error(file.path(), 0, "negative offset");
            file.read(dst, size, static_cast<off_t>(offset), num_threads, chunk_bytes);
          },
          py::arg("dst"), py::arg("size"), py::arg("file_offset"), py::arg("num_threads") = 0,
          py::arg("chunk_bytes") = size_t{16} << 20, py::call_guard<py::gil_scoped_release>(),
          "Read `size` bytes at `file_offset` into device address `dst`, in chunks read by "
          "several threads at once. Blocks until the bytes are on the device.")
      .def("close", &cuda::CuFile::close);

  m.def(
      "gather_to_device",
      [](const std::vector<std::shared_ptr<cuda::CuFile>>& files, int device, uintptr_t dest,
         uint64_t dest_bytes, uintptr_t scratch, uint64_t scratch_bytes,
         const Column<uint32_t>& file_ids, const Column<uint64_t>& offsets,
         const Column<uint64_t>& lengths, const Column<uint64_t>& dest_offsets, uintptr_t stream,
         std::optional<uintptr_t> consumer, size_t threads, uint64_t merge_gap, uint64_t align) {
        auto n = static_cast<size_t>(file_ids.size());
        if (file_ids.ndim() != 1 || offsets.ndim() != 1 || lengths.ndim() != 1 ||
            dest_offsets.ndim() != 1 || static_cast<size_t>(offsets.size()) != n ||
            static_cast<size_t>(lengths.size()) != n ||
            static_cast<size_t>(dest_offsets.size()) != n) {
          throw Error(
              "gather_to_device: file_ids, offsets, lengths and dest_offsets must be 1-D "
              "and of one length");
        }
        cuda::GatherRuns runs{file_ids.data(), offsets.data(), lengths.data(), dest_offsets.data(),
                              n};
        cuda::GatherOptions options{threads, merge_gap, align};
        cuda::GatherStats s;
        {
          py::gil_scoped_release release;  // reads wait on storage, copies on the driver
          s = cuda::gather_to_device(files, device, dest, dest_bytes, scratch, scratch_bytes, runs,
                                     as_stream(stream), options);
          if (consumer && *consumer != stream) s.done->make_wait(as_stream(*consumer));
        }
        py::dict out;
        out["spans"] = s.spans;
        out["reads"] = s.reads;
        out["bytes_read"] = s.bytes_read;
        out["copies"] = s.copies;
        out["copies_2d"] = s.copies_2d;
        out["rounds"] = s.rounds;
        out["event"] = s.done;
        return out;
      },
      py::arg("files"), py::arg("device"), py::arg("dest"), py::arg("dest_bytes"),
      py::arg("scratch"), py::arg("scratch_bytes"), py::arg("file_ids"), py::arg("offsets"),
      py::arg("lengths"), py::arg("dest_offsets"), py::arg("stream"),
      py::arg("consumer_stream") = py::none(), py::arg("threads") = 0,
      py::arg("merge_gap") = uint64_t{8} << 10, py::arg("align") = 4096,
      "Read runs of bytes of `files` (CuFile handles, by file id; None for files no run names) "
      "into device memory [dest, dest + dest_bytes): each span of a file (runs closer than "
      "`merge_gap` merged) read by cuFile into the device scratch memory, then each run copied "
      "to dest + dest_offsets[i] on `stream`, runs of one length at constant strides in one 2-D "
      "copy. No copy out of the scratch may be pending when it is called (wait for the last "
      "call's event). With `consumer_stream`, work queued there afterwards waits for the "
      "copies. Returns counts (spans, reads, bytes_read, copies, copies_2d, rounds) and the "
      "'event' recorded after the last copy.");
}

}  // namespace stoker::bindings
