// Handing C++ vectors and buffers to numpy without copying them.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <vector>

#include "stoker/io/aligned_buffer.hpp"

namespace stoker::bindings {

// A 1-D array argument of T, converted (copied) only when it is not one already.
template <typename T>
using Column = pybind11::array_t<T, pybind11::array::c_style | pybind11::array::forcecast>;

template <typename T>
pybind11::array_t<T> vector_to_numpy(std::vector<T>&& values) {
  auto* owned = new std::vector<T>(std::move(values));
  pybind11::capsule owner(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return pybind11::array_t<T>({owned->size()}, {sizeof(T)}, owned->data(), owner);
}

// A 1-D uint8 array over memory kept alive by `keep` (any shared_ptr).
template <typename Owner>
pybind11::array_t<uint8_t> bytes_to_numpy(uint8_t* data, size_t size, std::shared_ptr<Owner> keep) {
  auto* holder = new std::shared_ptr<Owner>(std::move(keep));
  pybind11::capsule owner(holder, [](void* p) { delete static_cast<std::shared_ptr<Owner>*>(p); });
  return pybind11::array_t<uint8_t>({size}, {size_t{1}}, data, owner);
}

// A ring slot as a 1-D uint8 array. Its capsule is named, so that a view of it
// can be traced back to its slot (slot_of) to fence the slot with a copy.
inline constexpr const char* kSlotCapsule = "stoker.slot";

inline pybind11::array_t<uint8_t> slot_to_numpy(std::shared_ptr<io::AlignedBuffer> slot) {
  auto* holder = new std::shared_ptr<io::AlignedBuffer>(std::move(slot));
  PyObject* capsule = PyCapsule_New(holder, kSlotCapsule, [](PyObject* o) {
    delete static_cast<std::shared_ptr<io::AlignedBuffer>*>(PyCapsule_GetPointer(o, kSlotCapsule));
  });
  if (capsule == nullptr) {
    delete holder;
    throw pybind11::error_already_set();
  }
  auto owner = pybind11::reinterpret_steal<pybind11::object>(capsule);
  io::AlignedBuffer& b = **holder;
  return pybind11::array_t<uint8_t>({b.size()}, {size_t{1}}, b.data(), owner);
}

// The slot an array (or any numpy view of it) lies in; null if none.
inline std::shared_ptr<io::AlignedBuffer> slot_of(const pybind11::array& array) {
  pybind11::object at = array;
  while (pybind11::isinstance<pybind11::array>(at)) {
    pybind11::object base = at.cast<pybind11::array>().base();
    if (base.is_none()) return nullptr;
    at = base;
  }
  if (!PyCapsule_IsValid(at.ptr(), kSlotCapsule)) return nullptr;
  return *static_cast<std::shared_ptr<io::AlignedBuffer>*>(
      PyCapsule_GetPointer(at.ptr(), kSlotCapsule));
}

}  // namespace stoker::bindings
