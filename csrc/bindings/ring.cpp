// PinnedRing: the reusable host slots batches are read into, usable on its own.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <optional>

#include "bindings.hpp"
#include "numpy_util.hpp"
#include "stoker/cuda/copy_stream.hpp"
#include "stoker/io/pinned_ring.hpp"

namespace py = pybind11;

namespace stoker::bindings {

namespace {

constexpr auto kWaitSlice = std::chrono::milliseconds(50);

// Waits for a slot in short slices with the GIL released, so Ctrl-C works.
py::array_t<uint8_t> acquire(io::PinnedRing& ring, size_t size, std::optional<double> timeout) {
  using Clock = io::PinnedRing::Clock;
  if (!ring.pinned()) return slot_to_numpy(ring.acquire(size));
  bool forever = !timeout || !(*timeout < 365.0 * 24 * 3600);
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(forever ? 0.0 : *timeout));
  for (;;) {
    auto slice = Clock::now() + kWaitSlice;
    std::shared_ptr<io::AlignedBuffer> slot;
    {
      py::gil_scoped_release release;
      slot = ring.acquire(size, forever ? slice : std::min(slice, deadline));
    }
    if (slot) return slot_to_numpy(std::move(slot));
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (!forever && Clock::now() >= deadline) {
      PyErr_SetString(PyExc_TimeoutError,
                      "no pinned slot came back in time: every slot is still held");
      throw py::error_already_set();
    }
  }
}

}  // namespace

void register_ring(py::module_& m) {
  py::class_<io::PinnedRing, std::shared_ptr<io::PinnedRing>>(
      m, "PinnedRing",
      "Reusable page-aligned host slots. acquire(size) hands out a uint8 array; its slot "
      "returns to the ring only when that array and every view of it (tensors included) are "
      "gone, so a slot in use is never handed out twice. With device=N the slots are "
      "page-locked for asynchronous copies to that device, the bounds hold for every slot "
      "(acquire waits for one to come back), and a slot a copy still reads is reused only "
      "once that copy has completed.")
      .def(py::init([](size_t max_slots, size_t max_bytes, std::optional<int> device) {
             std::shared_ptr<io::HostPinner> pinner;
             if (device) pinner = std::make_shared<cuda::PinnedHostMemory>(*device);
             return std::make_shared<io::PinnedRing>(max_slots, max_bytes, std::move(pinner));
           }),
           py::arg("max_idle_slots") = 16, py::arg("max_idle_bytes") = size_t{256} << 20,
           py::kw_only(), py::arg("device") = py::none())
      .def("acquire", &acquire, py::arg("size"), py::arg("timeout") = py::none(),
           "A slot of `size` bytes: a recycled one when one fits. A pinned ring waits (GIL "
           "released) for a slot to come back; TimeoutError after `timeout` seconds.")
      .def("idle_slots", &io::PinnedRing::idle_slots, "Slots waiting to be reused.")
      .def_property_readonly("pinned", &io::PinnedRing::pinned,
                             "Whether the slots are page-locked for device copies.")
      .def_property_readonly("slots", &io::PinnedRing::slots,
                             "Slots in existence (a plain ring counts its idle ones).")
      .def_property_readonly("pinned_bytes", &io::PinnedRing::pinned_bytes,
                             "Bytes of host memory page-locked by this ring now.");
}

}  // namespace stoker::bindings
