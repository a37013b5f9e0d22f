// Index parsers: shard -> columnar numpy arrays of samples and members.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <cstring>

#include "bindings.hpp"
#include "numpy_util.hpp"
#include "stoker/errors.hpp"
#include "stoker/format/shard_index.hpp"
#include "stoker/format/sidecar.hpp"
#include "stoker/format/window_reader.hpp"
#include "stoker/io/thread_pool.hpp"

namespace py = pybind11;

namespace stoker::bindings {

namespace {

// Member names are bytes in the archive: not UTF-8 ones decode as Python's
// tarfile does, with surrogateescape, so every shard tarfile reads opens here.
py::list names_to_python(const std::vector<std::string>& names) {
  py::list out(names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    PyObject* s = PyUnicode_DecodeUTF8(names[i].data(), static_cast<Py_ssize_t>(names[i].size()),
                                       "surrogateescape");
    if (s == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), s);
  }
  return out;
}

py::dict index_to_dict(format::ShardIndex&& index) {
  py::dict out;
  out["format"] = index.format;
  out["file_size"] = index.file_size;
  out["identity"] =
      py::make_tuple(index.identity.inode, index.identity.size, index.identity.mtime_ns);
  if (index.format == "npy") {
    const format::NpyHeader& npy = index.npy;
    out["descr"] = npy.descr;
    out["fortran_order"] = npy.fortran_order;
    out["shape"] = py::tuple(py::cast(npy.shape));
    out["data_offset"] = npy.data_offset;
    out["itemsize"] = npy.itemsize;
    out["row_bytes"] = npy.row_bytes;
    return out;
  }
  out["key_runs"] = index.key_runs;
  out["sidecar"] = static_cast<format::SidecarState>(index.sidecar);
  out["keys"] = names_to_python(index.keys);
  out["field_names"] = names_to_python(index.field_names);
  out["sample_start"] = vector_to_numpy(std::move(index.sample_start));
  out["member_field"] = vector_to_numpy(std::move(index.member_field));
  out["member_offset"] = vector_to_numpy(std::move(index.member_offset));
  out["member_length"] = vector_to_numpy(std::move(index.member_length));
  out["member_out_length"] = vector_to_numpy(std::move(index.member_out_length));
  out["member_codec"] = vector_to_numpy(std::move(index.member_codec));
  out["member_crc"] = vector_to_numpy(std::move(index.member_crc));
  return out;
}

}  // namespace

void register_formats(py::module_& m) {
  m.def(
      "index_shards",
      [](const std::vector<std::string>& paths, const std::vector<std::string>& formats,
         size_t num_threads) {
        std::vector<format::ShardIndex> indexes;
        {
          py::gil_scoped_release release;
          indexes = format::index_shards(
              paths, formats, num_threads == 0 ? io::ThreadPool::default_size() : num_threads);
        }
        py::list out;
        for (auto& index : indexes) out.append(index_to_dict(std::move(index)));
        return out;
      },
      py::arg("paths"), py::arg("formats"), py::arg("num_threads") = 0,
      "Index shards (formats: 'tar', 'zip', 'npy') on a few threads; one dict per shard.");
  m.attr("SIDECAR_SUFFIX") = format::kSidecarSuffix;
  py::enum_<format::SidecarState>(m, "SidecarState",
                                  "What opening a shard found of its member index.")
      .value("NONE", format::SidecarState::kNone)
      .value("USED", format::SidecarState::kUsed)
      .value("STALE", format::SidecarState::kStale)
      .value("DAMAGED", format::SidecarState::kCorrupt);
  m.def(
      "write_member_index",
      [](const std::vector<std::string>& paths, const std::vector<std::string>& formats,
         size_t num_threads) {
        std::vector<std::string> failed(paths.size());
        {
          py::gil_scoped_release release;
          size_t threads = num_threads == 0 ? io::ThreadPool::default_size() : num_threads;
          auto indexes = format::index_shards(paths, formats, threads);
          io::parallel_for(paths.size(), threads, [&](size_t i) {
            try {
              format::write_sidecar(paths[i], indexes[i]);
            } catch (const Error& e) {
              failed[i] = e.what();
            }
          });
        }
        py::list out;
        for (const std::string& why : failed) {
          out.append(why.empty() ? py::object(py::none()) : py::object(message_of(why)));
        }
        return out;
      },
      py::arg("paths"), py::arg("formats"), py::arg("num_threads") = 0,
      "Write each tar or zip shard's member index beside it (SHARD.stoker-idx), so that "
      "opening it reads one small file instead of walking its headers. A shard that cannot "
      "be indexed raises; one whose index cannot be written (a read-only folder) is "
      "reported in the returned list (None where it was written).");
  m.def(
      "npy_header",
      [](const std::string& path) {
        format::NpyHeader header;
        {
          py::gil_scoped_release release;
          format::WindowReader in(path, 4096);
          header = format::read_npy_header(in, 0, in.size());
        }
        py::dict out;
        out["descr"] = header.descr;
        out["fortran_order"] = header.fortran_order;
        out["shape"] = py::tuple(py::cast(header.shape));
        out["data_offset"] = header.data_offset;
        out["itemsize"] = header.itemsize;
        out["data_bytes"] = header.data_bytes;
        return out;
      },
      py::arg("path"),
      "The header of the .npy file at `path`, checked against its size: descr, shape, "
      "fortran_order, data_offset, itemsize, data_bytes. The one .npy header reader.");
  m.def(
      "index_remote",
      [](const std::string& label, uint64_t size, const std::string& format, py::function read,
         uint64_t window) {
        // The GIL stays held: `read` is Python (a range request) and gives it up
        // while it waits on the network; the parsing in between is brief.
        format::WindowReader in(
            label, size,
            [&](uint8_t* dest, uint64_t length, uint64_t offset) {
              py::buffer got = read(offset, length);
              py::buffer_info info = got.request();
              auto bytes = static_cast<uint64_t>(info.size * info.itemsize);
              if (bytes != length) {
                throw ReadError(
                    label, offset, EIO,
                    "asked for " + std::to_string(length) + " bytes, got " + std::to_string(bytes));
              }
              std::memcpy(dest, info.ptr, length);
            },
            window);
        return index_to_dict(format::index_shard(in, format, /*locate_members=*/false));
      },
      py::arg("label"), py::arg("size"), py::arg("format"), py::arg("read"),
      py::arg("window") = 64 * 1024,
      "What samples a shard that is not local holds, read through read(offset, length) -> "
      "bytes (range requests). Member offsets of zip shards are not located (0).");
}

}  // namespace stoker::bindings
