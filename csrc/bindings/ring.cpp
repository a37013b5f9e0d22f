// PinnedRing: the reusable host slots batches are read into, usable on its own.
#include <pybind11/numpy.h>

#include "bindings.hpp"
#include "numpy_util.hpp"
#include "stoker/io/pinned_ring.hpp"

namespace py = pybind11;

namespace stoker::bindings {

void register_ring(py::module_& m) {
  py::class_<io::PinnedRing, std::shared_ptr<io::PinnedRing>>(
      m, "PinnedRing",
      "Reusable page-aligned host slots. acquire(size) hands out a uint8 array; its slot "
      "returns to the ring only when that array and every view of it (tensors included) are "
      "gone, so a slot in use is never handed out twice.")
      .def(py::init<size_t, size_t>(), py::arg("max_idle_slots") = 16,
           py::arg("max_idle_bytes") = size_t{256} << 20)
      .def(
          "acquire",
          [](io::PinnedRing& ring, size_t size) {
            std::shared_ptr<io::AlignedBuffer> slot = ring.acquire(size);
            return bytes_to_numpy(slot->data(), size, slot);
          },
          py::arg("size"), "A slot of `size` bytes: a recycled one when one fits.")
      .def("idle_slots", &io::PinnedRing::idle_slots, "Slots waiting to be reused.")
      .def_property_readonly(
          "pinned", [](const io::PinnedRing&) { return false; },
          "Whether the slots are page-locked for CUDA copies (not until the GPU path lands).");
}

}  // namespace stoker::bindings
