// Table sources' columns: the ColumnLayouts Python learns from a Parquet footer
// at open, which COLUMN_VALUE read requests name by index.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "numpy_util.hpp"
#include "stoker/format/parquet_column.hpp"
#include "stoker/io/array_layout.hpp"
#include "stoker/io/column_layout.hpp"

namespace py = pybind11;

namespace stoker::bindings {

namespace {

using Units = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
namespace pq = format::parquet;

// The Parquet decoding a column's units need: what its footer and schema say.
struct ParquetSpec {
  int physical_type, type_length, max_definition, max_repetition, repeated_definition, codec;
};

std::shared_ptr<io::ColumnLayout> make_column(std::string name, uint32_t file, uint64_t rows,
                                              uint32_t width, int integer, const Units& units,
                                              const ParquetSpec& p) {
  if (units.ndim() != 2 || units.shape(1) != 7) {
    throw py::value_error(
        "units must have shape (n, 7): first row, rows, offset, size, "
        "dictionary offset, dictionary size, row group");
  }
  if (integer < 0 || integer > 2) throw py::value_error("integer must be 0, 1 or 2");
  auto c = std::make_shared<io::ColumnLayout>();
  c->id = io::next_layout_id();
  c->name = name;
  c->file = file;
  c->rows = rows;
  c->width = width;
  c->integer = static_cast<io::ColumnInteger>(integer);
  auto u = units.unchecked<2>();
  for (py::ssize_t i = 0; i < u.shape(0); ++i) {
    c->units.push_back({u(i, 0), u(i, 1), u(i, 2), u(i, 3), u(i, 4), u(i, 5), u(i, 6)});
  }
  pq::ColumnSpec spec;
  spec.type = static_cast<pq::PhysicalType>(p.physical_type);
  spec.type_length = p.type_length;
  spec.max_definition = static_cast<int16_t>(p.max_definition);
  spec.max_repetition = static_cast<int16_t>(p.max_repetition);
  spec.repeated_definition = static_cast<int16_t>(p.repeated_definition);
  spec.codec = static_cast<pq::Compression>(p.codec);
  spec.name = std::move(name);
  c->decoder = std::make_shared<const pq::ParquetColumnDecoder>(std::move(spec));
  c->check();
  return c;
}

const pq::ColumnSpec& spec_of(const io::ColumnLayout& c) {
  return static_cast<const pq::ParquetColumnDecoder&>(*c.decoder).spec();
}

Units units_of(const io::ColumnLayout& c) {
  Units out({static_cast<py::ssize_t>(c.units.size()), py::ssize_t{7}});
  auto v = out.mutable_unchecked<2>();
  for (size_t i = 0; i < c.units.size(); ++i) {
    const io::ColumnUnit& u = c.units[i];
    uint64_t row[7] = {u.first_row,       u.rows,     u.offset, u.size, u.dictionary_offset,
                       u.dictionary_size, u.row_group};
    for (py::ssize_t k = 0; k < 7; ++k) v(i, k) = row[k];
  }
  return out;
}

py::tuple state_of(const io::ColumnLayout& c) {
  const pq::ColumnSpec& s = spec_of(c);
  return py::make_tuple(c.name, c.file, c.rows, c.width, static_cast<int>(c.integer), units_of(c),
                        static_cast<int>(s.type), s.type_length, s.max_definition, s.max_repetition,
                        s.repeated_definition, static_cast<int>(s.codec));
}

}  // namespace

void register_columns(py::module_& m) {
  py::class_<io::ColumnLayout, std::shared_ptr<io::ColumnLayout>>(
      m, "ColumnLayout",
      "Where the values of one Parquet leaf column of one file lie: its units (column "
      "chunks, or runs of their pages), each read and decoded whole by the reader.")
      .def(py::init([](std::string name, uint32_t file, uint64_t rows, uint32_t width, int integer,
                       const Units& units, int physical_type, int type_length, int max_definition,
                       int max_repetition, int repeated_definition, int codec) {
             return make_column(std::move(name), file, rows, width, integer, units,
                                {physical_type, type_length, max_definition, max_repetition,
                                 repeated_definition, codec});
           }),
           py::arg("name"), py::arg("file"), py::arg("rows"), py::arg("width"), py::arg("integer"),
           py::arg("units"), py::arg("physical_type"), py::arg("type_length"),
           py::arg("max_definition"), py::arg("max_repetition"), py::arg("repeated_definition"),
           py::arg("codec"),
           "file: the column's file in the FileTable; width: bytes of each value (0: they "
           "vary); integer: 1 signed, 2 unsigned integers (Int() widens them), else 0; units: "
           "(n, 7) uint64 rows of (first row, rows, offset, size, dictionary offset, "
           "dictionary size, row group); repeated_definition: for a list, the definition level at "
           "which "
           "it holds an element (-1: max_definition - 1).")
      .def_property_readonly("name", [](const io::ColumnLayout& c) { return c.name; })
      .def_property_readonly("file", [](const io::ColumnLayout& c) { return c.file; })
      .def_property_readonly("rows", [](const io::ColumnLayout& c) { return c.rows; })
      .def_property_readonly("width", [](const io::ColumnLayout& c) { return c.width; })
      .def_property_readonly("units", units_of)
      .def_property_readonly("stored_bytes",
                             [](const io::ColumnLayout& c) {
                               uint64_t n = 0;
                               for (const auto& u : c.units) n += u.size + u.dictionary_size;
                               return n;
                             })
      .def(py::pickle(&state_of, [](py::tuple s) {
        return make_column(s[0].cast<std::string>(), s[1].cast<uint32_t>(), s[2].cast<uint64_t>(),
                           s[3].cast<uint32_t>(), s[4].cast<int>(), s[5].cast<Units>(),
                           {s[6].cast<int>(), s[7].cast<int>(), s[8].cast<int>(), s[9].cast<int>(),
                            s[10].cast<int>(), s[11].cast<int>()});
      }));
}

}  // namespace stoker::bindings
