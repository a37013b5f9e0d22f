// Handing C++ vectors and buffers to numpy without copying them.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <vector>

namespace stoker::bindings {

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

}  // namespace stoker::bindings
