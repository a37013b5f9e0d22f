// The exception hierarchy of stoker's contract. Types are made here, with
// Python's own bases (ValueError, OSError), so C++ errors arrive as them.
#include "stoker/errors.hpp"

#include <cstring>
#include <string>

#include "bindings.hpp"

namespace py = pybind11;

namespace stoker::bindings {

namespace {

// Owned by the module for the life of the interpreter.
PyObject* stoker_error = nullptr;
PyObject* shard_format_error = nullptr;
PyObject* read_error = nullptr;
PyObject* cuda_error = nullptr;
PyObject* cufile_error = nullptr;

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
  if (e.path().empty()) {
    instance.attr("path") = py::none();
  } else {  // as os.fsdecode gives it: a path that is not UTF-8 round-trips
    PyObject* path =
        PyUnicode_DecodeFSDefaultAndSize(e.path().data(), static_cast<Py_ssize_t>(e.path().size()));
    if (path == nullptr) throw py::error_already_set();
    instance.attr("path") = py::reinterpret_steal<py::object>(path);
  }
  instance.attr("offset") = e.offset();
  instance.attr("detail") = message_of(e.detail());  // the message less file and offset
  PyErr_SetObject(type, instance.ptr());
}

}  // namespace

// Messages quote bytes from shards (member names, header text) that need not
// be UTF-8: undecodable bytes are shown escaped, never turned into a
// UnicodeDecodeError that would hide the real error.
py::str message_of(const std::string& text) {
  PyObject* s =
      PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "backslashreplace");
  if (s == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(s);
}

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
  cuda_error = make_type(m, "CudaError", {stoker_error, PyExc_RuntimeError},
                         "CUDA is not usable here (no driver or device, a forked child of a "
                         "CUDA process), or a driver call failed.");
  cufile_error = make_type(m, "CuFileError", {cuda_error},
                           "A cuFile (GPUDirect Storage) call failed; stoker falls back to its "
                           "bounce path where it can.");

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ReadError& e) {
      // Not OSError's three-argument form: its filename would repeat the path
      // the message already starts with.
      py::object instance = py::handle(read_error)(e.error_number(), message_of(e.what()));
      raise_located(read_error, e, instance);
    } catch (const CuFileError& e) {
      raise_located(cufile_error, e, py::handle(cufile_error)(message_of(e.what())));
    } catch (const CudaError& e) {
      raise_located(cuda_error, e, py::handle(cuda_error)(message_of(e.what())));
    } catch (const FormatError& e) {
      raise_located(shard_format_error, e, py::handle(shard_format_error)(message_of(e.what())));
    } catch (const Error& e) {
      raise_located(stoker_error, e, py::handle(stoker_error)(message_of(e.what())));
    }
  });
}

}  // namespace stoker::bindings
