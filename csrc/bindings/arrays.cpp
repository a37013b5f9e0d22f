// Array sources: the layouts Python learns at open (ArrayLayout: HDF5, Zarr,
// TIFF tiles), the codecs' libraries, and a gzip file read as a stream (.nii.gz
// volumes).
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "numpy_util.hpp"
#include "stoker/io/array_layout.hpp"
#include "stoker/io/chunk_codec.hpp"
#include "stoker/io/inflate.hpp"
#include "stoker/io/label_counts.hpp"
#include "stoker/io/strided_copy.hpp"
#include "stoker/io/thread_pool.hpp"

namespace py = pybind11;

namespace stoker::bindings {

namespace {

template <typename T>
std::vector<T> to_vector(const Column<T>& column) {
  return std::vector<T>(column.data(), column.data() + column.size());
}

template <typename T>
Column<T> to_column(const std::vector<T>& values) {
  Column<T> out(values.size());
  std::copy(values.begin(), values.end(), out.mutable_data());
  return out;
}

using Steps = std::vector<std::pair<io::ChunkFilter, uint32_t>>;

std::shared_ptr<io::ArrayLayout> make_layout(
    std::string name, std::vector<uint64_t> shape, std::vector<uint64_t> chunk_shape,
    uint32_t itemsize, py::bytes fill, const Steps& steps, std::vector<std::string> paths,
    const Column<uint32_t>& chunk_file, const Column<uint64_t>& chunk_offset,
    const Column<uint64_t>& chunk_size, const Column<uint32_t>& chunk_mask,
    std::vector<uint32_t> order, bool byteswap, py::bytes jpeg_tables, bool clipped_edge) {
  auto a = std::make_shared<io::ArrayLayout>();
  a->id = io::next_layout_id();
  a->name = std::move(name);
  a->shape = std::move(shape);
  a->chunk_shape = std::move(chunk_shape);
  a->itemsize = itemsize;
  std::string fill_bytes = fill;
  a->fill.assign(fill_bytes.begin(), fill_bytes.end());
  for (const auto& [filter, param] : steps) a->steps.push_back({filter, param});
  a->paths = std::move(paths);
  a->chunk_file = to_vector(chunk_file);
  a->chunk_offset = to_vector(chunk_offset);
  a->chunk_size = to_vector(chunk_size);
  a->chunk_mask = to_vector(chunk_mask);
  a->order = std::move(order);
  a->byteswap = byteswap;
  a->clipped_edge = clipped_edge;
  std::string tables = jpeg_tables;
  a->jpeg_tables.assign(tables.begin(), tables.end());
  a->check();
  return a;
}

Steps steps_of(const io::ArrayLayout& a) {
  Steps out;
  for (const auto& step : a.steps) out.emplace_back(step.filter, step.param);
  return out;
}

py::bytes tables_of(const io::ArrayLayout& a) {
  return py::bytes(reinterpret_cast<const char*>(a.jpeg_tables.data()), a.jpeg_tables.size());
}

py::tuple state_of(const io::ArrayLayout& a) {
  return py::make_tuple(a.name, a.shape, a.chunk_shape, a.itemsize,
                        py::bytes(reinterpret_cast<const char*>(a.fill.data()), a.fill.size()),
                        steps_of(a), a.paths, to_column(a.chunk_file), to_column(a.chunk_offset),
                        to_column(a.chunk_size), to_column(a.chunk_mask), a.order, a.byteswap,
                        tables_of(a), a.clipped_edge);
}

}  // namespace

void register_arrays(py::module_& m) {
  py::enum_<io::ChunkFilter>(m, "ChunkFilter", "One step of an array chunk's filter pipeline.")
      .value("ZLIB", io::ChunkFilter::kZlib)
      .value("GZIP", io::ChunkFilter::kGzip)
      .value("ZSTD", io::ChunkFilter::kZstd)
      .value("BLOSC", io::ChunkFilter::kBlosc)
      .value("SHUFFLE", io::ChunkFilter::kShuffle)
      .value("FLETCHER32", io::ChunkFilter::kFletcher32)
      .value("CRC32C", io::ChunkFilter::kCrc32c)
      .value("JPEG", io::ChunkFilter::kJpeg)
      .value("HORIZONTAL_PREDICTOR", io::ChunkFilter::kHorizontalPredictor)
      .value("SNAPPY", io::ChunkFilter::kSnappy)
      .value("LZ4_RAW", io::ChunkFilter::kLz4Raw);
  m.attr("JPEG_YCBCR") = io::kJpegYCbCr;
  m.attr("JPEG_RGB") = io::kJpegRgb;

  py::class_<io::ArrayLayout, std::shared_ptr<io::ArrayLayout>>(
      m, "ArrayLayout",
      "Where the rows of one array (an HDF5 dataset, a Zarr array) lie: its chunk grid, each "
      "chunk's file, offset, size and filter mask (in C order over the grid; offset "
      "2**64-1 for a chunk never written), and the filters that encode them.")
      .def(py::init(&make_layout), py::arg("name"), py::arg("shape"), py::arg("chunk_shape"),
           py::arg("itemsize"), py::arg("fill"), py::arg("steps"), py::arg("paths"),
           py::arg("chunk_file"), py::arg("chunk_offset"), py::arg("chunk_size"),
           py::arg("chunk_mask"), py::arg("order") = std::vector<uint32_t>{},
           py::arg("byteswap") = false, py::arg("jpeg_tables") = py::bytes(),
           py::arg("clipped_edge") = false)
      .def_readonly("name", &io::ArrayLayout::name)
      .def_readonly("shape", &io::ArrayLayout::shape)
      .def_readonly("chunk_shape", &io::ArrayLayout::chunk_shape)
      .def_readonly("itemsize", &io::ArrayLayout::itemsize)
      .def_readonly("paths", &io::ArrayLayout::paths)
      .def_property_readonly("steps", &steps_of)
      .def_property_readonly("order", [](const io::ArrayLayout& a) { return a.order; })
      .def_property_readonly("byteswap", [](const io::ArrayLayout& a) { return a.byteswap; })
      .def_property_readonly("clipped_edge",
                             [](const io::ArrayLayout& a) { return a.clipped_edge; })
      .def_property_readonly("jpeg_tables", &tables_of)
      .def_property_readonly("row_bytes", &io::ArrayLayout::row_bytes)
      .def_property_readonly("chunk_bytes", &io::ArrayLayout::chunk_bytes)
      .def_property_readonly("chunks_per_row", &io::ArrayLayout::chunks_per_row)
      .def_property_readonly("num_chunks", &io::ArrayLayout::num_chunks)
      .def_property_readonly("stored_bytes",
                             [](const io::ArrayLayout& a) {
                               uint64_t total = 0;
                               for (size_t c = 0; c < a.chunk_size.size(); ++c) {
                                 if (a.chunk_offset[c] != io::kMissingChunk) {
                                   total += a.chunk_size[c];
                                 }
                               }
                               return total;
                             })
      .def(py::pickle(&state_of, [](py::tuple s) {
        return make_layout(s[0].cast<std::string>(), s[1].cast<std::vector<uint64_t>>(),
                           s[2].cast<std::vector<uint64_t>>(), s[3].cast<uint32_t>(),
                           s[4].cast<py::bytes>(), s[5].cast<Steps>(),
                           s[6].cast<std::vector<std::string>>(), s[7].cast<Column<uint32_t>>(),
                           s[8].cast<Column<uint64_t>>(), s[9].cast<Column<uint64_t>>(),
                           s[10].cast<Column<uint32_t>>(), s[11].cast<std::vector<uint32_t>>(),
                           s[12].cast<bool>(),
                           s.size() > 13 ? s[13].cast<py::bytes>() : py::bytes(),
                           s.size() > 14 && s[14].cast<bool>());
      }));

  m.def(
      "permute_into",
      [](const py::array& src, py::array dst) {
        if (!(dst.flags() & py::array::c_style) || !dst.writeable()) {
          throw py::value_error("permute_into needs a writable C-contiguous dst");
        }
        if (src.ndim() != dst.ndim() || src.itemsize() != dst.itemsize()) {
          throw py::value_error("permute_into: src and dst differ in rank or element size");
        }
        std::vector<uint64_t> shape(src.ndim());
        std::vector<int64_t> strides(src.ndim());
        for (py::ssize_t d = 0; d < src.ndim(); ++d) {
          if (src.shape(d) != dst.shape(d)) {
            throw py::value_error("permute_into: src and dst differ in shape");
          }
          shape[d] = static_cast<uint64_t>(src.shape(d));
          strides[d] = static_cast<int64_t>(src.strides(d));
        }
        const auto* from = static_cast<const uint8_t*>(src.data());
        auto* to = static_cast<uint8_t*>(dst.mutable_data());
        py::gil_scoped_release release;
        io::permute_copy(from, strides, to, shape, static_cast<uint64_t>(src.itemsize()),
                         io::ThreadPool::default_size());
      },
      py::arg("src"), py::arg("dst"),
      "Copy `src`, an array of any strides, into `dst`, a C-contiguous array of its shape "
      "and element size, in tiles over several threads (a faster np.copyto for a transposed "
      "view). The arrays must not overlap.");
  m.def(
      "label_block_counts",
      [](const py::array& labels, uint64_t block) {
        py::dtype dtype = labels.dtype();
        char kind = dtype.kind();
        if (!(labels.flags() & py::array::c_style) || (kind != 'u' && kind != 'i') ||
            labels.itemsize() > 2 || labels.ndim() == 0) {
          throw py::value_error(
              "label_block_counts needs a C-contiguous array of 1- or 2-byte integers");
        }
        std::vector<uint64_t> shape(labels.shape(), labels.shape() + labels.ndim());
        io::LabelBlockCounts result;
        {
          py::gil_scoped_release release;
          result =
              io::count_label_blocks(labels.data(), shape, static_cast<unsigned>(labels.itemsize()),
                                     kind == 'i', block, io::ThreadPool::default_size());
        }
        std::vector<py::ssize_t> counts_shape{static_cast<py::ssize_t>(result.values.size())};
        for (uint64_t g : result.grid) counts_shape.push_back(static_cast<py::ssize_t>(g));
        py::array counts = vector_to_numpy(std::move(result.counts)).reshape(counts_shape);
        return py::make_tuple(vector_to_numpy(std::move(result.values)), counts);
      },
      py::arg("labels"), py::arg("block"),
      "The values present in `labels` (ascending) and the voxels of each per block of "
      "`block` voxels a side: (values, counts of shape (len(values), *grid)).");
  m.def("set_codec_search_dirs", &io::set_codec_search_dirs, py::arg("dirs"),
        "Folders searched for libzstd, libblosc and liblz4 before the dynamic "
        "loader's path.");
  m.def("codec_library", &io::codec_library, py::arg("filter"),
        "The file `filter`'s library was loaded from ('' when none is needed or found).");
  m.def("codec_unavailable", &io::codec_unavailable, py::arg("filter"),
        "'' when `filter`'s library can be used, else why not and what to install.");
  m.def(
      "decompress",
      [](py::buffer data, uint64_t size, io::ChunkFilter filter, const std::string& path) {
        py::buffer_info info = data.request();
        auto out = std::make_shared<std::vector<uint8_t>>(size);
        {
          py::gil_scoped_release release;
          io::decompress_exact(filter, static_cast<const uint8_t*>(info.ptr),
                               static_cast<uint64_t>(info.size * info.itemsize), out->data(), size,
                               path, 0);
        }
        return bytes_to_numpy(out->data(), out->size(), out);
      },
      py::arg("data"), py::arg("size"), py::arg("filter"), py::arg("path"),
      "`data` (zlib, gzip, zstd, snappy or lz4: a ChunkFilter) decompressed into exactly `size` "
      "bytes, as a uint8 array (GIL released); a ShardFormatError naming `path` otherwise.");
  m.def(
      "crc32c",
      [](py::buffer data) {
        py::buffer_info info = data.request();
        return io::crc32c_of(static_cast<const uint8_t*>(info.ptr),
                             static_cast<uint64_t>(info.size * info.itemsize));
      },
      py::arg("data"), "CRC-32C (Castagnoli) of a contiguous buffer.");

  py::class_<io::GzipFile>(m, "GzipFile",
                           "A gzip file read from its start as a stream of inflated bytes.")
      .def(py::init<const std::string&>(), py::arg("path"))
      .def(
          "read_into",
          [](io::GzipFile& self, py::buffer dest) {
            py::buffer_info info = dest.request(true);
            if (!PyBuffer_IsContiguous(info.view(), 'C')) {
              throw py::value_error("read_into needs a C-contiguous buffer");
            }
            py::gil_scoped_release release;
            self.read(static_cast<uint8_t*>(info.ptr),
                      static_cast<uint64_t>(info.size * info.itemsize));
          },
          py::arg("dest"), "Inflate exactly len(dest) more bytes into `dest` (GIL released).")
      .def(
          "skip",
          [](io::GzipFile& self, uint64_t n) {
            py::gil_scoped_release release;
            self.read(nullptr, n);
          },
          py::arg("n"), "Inflate and discard `n` bytes.")
      .def(
          "finish",
          [](io::GzipFile& self, uint64_t max_trailing) {
            py::gil_scoped_release release;
            self.finish(max_trailing);
          },
          py::arg("max_trailing") = uint64_t{1} << 20,
          "Inflate and discard the rest of the stream, checking every member's CRC-32 and "
          "ISIZE; a FormatError if more than `max_trailing` inflated bytes remain, or the "
          "file ends inside a member (GIL released).")
      .def("at_end", &io::GzipFile::at_end, "Whether every member has been inflated.")
      .def_property_readonly("produced", &io::GzipFile::produced)
      .def_property_readonly("path", &io::GzipFile::path);
}

}  // namespace stoker::bindings
