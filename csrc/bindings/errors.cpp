// The exception hierarchy of stoker's contract. Types are made here, with
// Python's own bases (ValueError, OSError), so C++ errors arrive as them.
#include "stoker/errors.hpp"

#include <string>

#include "bindings.hpp"

namespace py = pybind11;

namespace stoker::bindings {

namespace {

// Owned by the module for the life of the interpreter.
PyObject* stoker_error = nullptr;
PyObject* shard_format_error = nullptr;
PyObject* read_error = nullptr;

PyObject* make_type(py::module_& m, const char* name, std::initializer_list<PyObject*> bases,
                    const char* doc) {
  py::tuple base_tuple(bases.size());
  size_t i = 0;
  for (PyObject* base : bases) base_tuple[i++] = py::reinterpret_borrow<py::object>(base);
  // Named as stoker.X: that is where users import them from, and where
  // pickle finds them again.
  std::string qualified = std::string("stoker.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, base_tuple.ptr(), nullptr);
  if (type == nullptr) throw py::error_already_set();
  m.add_object(name, py::reinterpret_borrow<py::object>(type));
  return type;
}

// Raises `instance` (of `type`) with `.path` and `.offset` set from the error.
void raise_located(PyObject* type, const Error& e, py::object instance) {
  instance.attr("path") = e.path().empty() ? py::none() : py::object(py::str(e.path()));
  instance.attr("offset") = e.offset();
  PyErr_SetObject(type, instance.ptr());
}

}  // namespace

void register_errors(py::module_& m) {
  stoker_error = make_type(m, "StokerError", {PyExc_Exception},
                           "Base of every error stoker raises; `.path` and `.offset` say where.");
  shard_format_error =
      make_type(m, "ShardFormatError", {stoker_error, PyExc_ValueError},
                "A shard's bytes are corrupt, truncated or in an unsupported form.");
  read_error = make_type(m, "ReadError", {stoker_error, PyExc_OSError},
                         "The operating system failed a read: a missing file, EIO, permissions.");
  PyObject* fetch_error = make_type(m, "FetchError", {stoker_error, PyExc_OSError},
                                    "A remote shard could not be fetched after retries.");
  make_type(m, "ChecksumError", {fetch_error},
            "Fetched bytes do not match the length or sha256 the manifest gives.");

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ReadError& e) {
      // Not OSError's three-argument form: its filename would repeat the path
      // the message already starts with.
      py::object instance = py::handle(read_error)(e.error_number(), e.what());
      raise_located(read_error, e, instance);
    } catch (const FormatError& e) {
      raise_located(shard_format_error, e, py::handle(shard_format_error)(e.what()));
    } catch (const Error& e) {
      raise_located(stoker_error, e, py::handle(stoker_error)(e.what()));
    }
  });
}

}  // namespace stoker::bindings
