// TIFF / BigTIFF directories: where each tile (strip) of each image lies.
#include "stoker/format/tiff.hpp"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <string>

#include "bindings.hpp"

namespace py = pybind11;

namespace stoker::bindings {

namespace {

using format::TiffDirectory;

// A read-only view of one of the directory's columns; the array keeps the
// directory (and so the whole file's list) alive, and copies nothing.
py::array_t<uint64_t> column_of(py::object self, std::vector<uint64_t> TiffDirectory::*member) {
  const std::vector<uint64_t>& values = self.cast<const TiffDirectory&>().*member;
  py::array_t<uint64_t> out({values.size()}, {sizeof(uint64_t)}, values.data(), self);
  out.attr("setflags")(py::arg("write") = false);
  return out;
}

std::string repr(const TiffDirectory& d) {
  std::string out = "TiffDirectory(offset=" + std::to_string(d.offset) + ", " +
                    std::to_string(d.width) + " x " + std::to_string(d.length);
  if (d.tiled()) {
    out += ", " + std::to_string(d.offsets.size()) + " tiles of " + std::to_string(d.tile_width) +
           " x " + std::to_string(d.tile_length);
  } else {
    out += ", " + std::to_string(d.offsets.size()) + " strips of " +
           std::to_string(d.rows_per_strip) + " rows";
  }
  out += ", compression=" + std::to_string(d.compression);
  if (!d.sub_directories.empty()) {
    out += ", " + std::to_string(d.sub_directories.size()) + " sub-directories";
  }
  return out + ")";
}

}  // namespace

void register_tiff(py::module_& m) {
  py::class_<TiffDirectory>(m, "TiffDirectory",
                            "One TIFF image directory (IFD): its image, and where each of its "
                            "tiles (or strips) lies in the file")
      .def_readonly("offset", &TiffDirectory::offset)
      .def_readonly("big_endian", &TiffDirectory::big_endian)
      .def_readonly("big_tiff", &TiffDirectory::big_tiff)
      .def_readonly("width", &TiffDirectory::width)
      .def_readonly("length", &TiffDirectory::length)
      .def_readonly("tile_width", &TiffDirectory::tile_width)
      .def_readonly("tile_length", &TiffDirectory::tile_length)
      .def_readonly("rows_per_strip", &TiffDirectory::rows_per_strip)
      .def_readonly("samples_per_pixel", &TiffDirectory::samples_per_pixel)
      .def_property_readonly(
          "bits_per_sample",
          [](const TiffDirectory& d) { return py::cast(d.bits_per_sample).cast<py::list>(); })
      .def_readonly("sample_format", &TiffDirectory::sample_format)
      .def_readonly("compression", &TiffDirectory::compression)
      .def_readonly("photometric", &TiffDirectory::photometric)
      .def_readonly("planar_config", &TiffDirectory::planar_config)
      .def_readonly("predictor", &TiffDirectory::predictor)
      .def_readonly("new_subfile_type", &TiffDirectory::new_subfile_type)
      .def_property_readonly("jpeg_tables",
                             [](const TiffDirectory& d) {
                               return py::bytes(reinterpret_cast<const char*>(d.jpeg_tables.data()),
                                                d.jpeg_tables.size());
                             })
      .def_property_readonly("ycbcr_subsampling",
                             [](const TiffDirectory& d) {
                               return py::make_tuple(d.ycbcr_subsampling[0],
                                                     d.ycbcr_subsampling[1]);
                             })
      .def_property_readonly("description",
                             [](const TiffDirectory& d) {
                               // As member names are: bytes that are not UTF-8 round-trip.
                               PyObject* s = PyUnicode_DecodeUTF8(
                                   d.description.data(),
                                   static_cast<Py_ssize_t>(d.description.size()),
                                   "surrogateescape");
                               if (s == nullptr) throw py::error_already_set();
                               return py::reinterpret_steal<py::str>(s);
                             })
      .def_property_readonly(
          "offsets", [](py::object self) { return column_of(self, &TiffDirectory::offsets); })
      .def_property_readonly(
          "byte_counts",
          [](py::object self) { return column_of(self, &TiffDirectory::byte_counts); })
      .def_property_readonly(
          "sub_directories",
          [](py::object self) {
            const auto& d = self.cast<const TiffDirectory&>();
            py::list out;
            for (const TiffDirectory& sub : d.sub_directories) {
              out.append(py::cast(&sub, py::return_value_policy::reference_internal, self));
            }
            return out;
          })
      .def_property_readonly("tiled", &TiffDirectory::tiled)
      .def("__repr__", &repr);

  m.def(
      "read_tiff",
      [](const py::object& path) {
        // os.fsencode: str, bytes and os.PathLike, names that are not UTF-8 included.
        std::string p = py::module_::import("os").attr("fsencode")(path).cast<std::string>();
        std::vector<TiffDirectory> directories;
        {
          py::gil_scoped_release release;
          directories = format::read_tiff(p);
        }
        return directories;
      },
      py::arg("path"),
      "The directories of a TIFF or BigTIFF file's main IFD chain, in order, each with its "
      "SubIFDs; ShardFormatError (naming the file and offset) for anything malformed");
}

}  // namespace stoker::bindings
