// ShardReader, its file tables and its pending reads. Submitting holds the
// GIL (planning is cheap, and it keeps submits from racing a fork); waiting
// releases it and checks for Ctrl-C between short slices.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <chrono>
#include <optional>

#include "bindings.hpp"
#include "numpy_util.hpp"
#include "pending.hpp"
#include "stoker/errors.hpp"
#include "stoker/io/column_rows.hpp"
#include "stoker/io/shard_reader.hpp"
#include "stoker/io/strided_copy.hpp"

namespace py = pybind11;

namespace stoker::bindings {

namespace {

template <typename T>
using OptionalColumn = std::optional<Column<T>>;

std::vector<io::ReadRequest> make_requests(
    const Column<uint32_t>& file_ids, const Column<uint64_t>& offsets,
    const Column<uint64_t>& lengths, const Column<uint64_t>& dest_offsets,
    const OptionalColumn<uint64_t>& out_lengths, const OptionalColumn<uint8_t>& codecs,
    const OptionalColumn<uint32_t>& crcs, const OptionalColumn<bool>& check_crc,
    const OptionalColumn<uint32_t>& arrays) {
  py::ssize_t n = file_ids.size();
  auto same_length = [n](py::ssize_t size, const char* name) {
    if (size != n) {
      throw py::value_error(std::string(name) + " has " + std::to_string(size) +
                            " entries but file_ids has " + std::to_string(n));
    }
  };
  same_length(offsets.size(), "offsets");
  same_length(lengths.size(), "lengths");
  same_length(dest_offsets.size(), "dest_offsets");
  if (out_lengths) same_length(out_lengths->size(), "out_lengths");
  if (codecs) same_length(codecs->size(), "codecs");
  if (crcs) same_length(crcs->size(), "crcs");
  if (check_crc) same_length(check_crc->size(), "check_crc");
  if (arrays) same_length(arrays->size(), "arrays");
  if (check_crc && !crcs) throw py::value_error("check_crc needs crcs");

  std::vector<io::ReadRequest> requests(n);
  const uint32_t* f = file_ids.data();
  const uint64_t* o = offsets.data();
  const uint64_t* l = lengths.data();
  const uint64_t* d = dest_offsets.data();
  for (py::ssize_t i = 0; i < n; ++i) {
    io::ReadRequest& r = requests[i];
    r.file = f[i];
    r.offset = o[i];
    r.length = l[i];
    r.dest_offset = d[i];
    r.out_length = out_lengths ? out_lengths->data()[i] : l[i];
    r.codec = codecs ? static_cast<io::Codec>(codecs->data()[i]) : io::Codec::kStored;
    if (arrays) r.array = arrays->data()[i];
    if (crcs && r.codec != io::Codec::kArrayRow) {
      r.crc32 = crcs->data()[i];
      // By default only decoded members are checked: inflating touches every
      // byte anyway, while stored ones are served as they are on disk.
      r.check_crc = check_crc ? check_crc->data()[i] : r.codec != io::Codec::kStored;
    }
  }
  return requests;
}

// One (n, rank) table of a box argument, as unsigned values; `n` rows of one rank.
using Table = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

std::vector<io::ReadRequest> make_box_requests(const Column<uint32_t>& arrays, const Table& starts,
                                               const Table& extents,
                                               const Column<int64_t>& dest_offsets,
                                               const Table& dest_strides) {
  const py::ssize_t n = arrays.size();
  if (dest_offsets.size() != n) {
    throw py::value_error("dest_offsets has " + std::to_string(dest_offsets.size()) +
                          " entries but arrays has " + std::to_string(n));
  }
  if (n == 0) return {};
  if (starts.ndim() != 2 || starts.shape(0) != n) {
    throw py::value_error("starts must have shape (len(arrays), rank)");
  }
  const py::ssize_t rank = starts.shape(1);
  for (const auto& [table, name] : {std::pair<const Table*, const char*>{&extents, "extents"},
                                    {&dest_strides, "dest_strides"}}) {
    if (table->ndim() != 2 || table->shape(0) != n || table->shape(1) != rank) {
      throw py::value_error(std::string(name) + " must have the shape of starts, (" +
                            std::to_string(n) + ", " + std::to_string(rank) + ")");
    }
  }
  auto unsigned_of = [](const Table& table, py::ssize_t i, py::ssize_t d, const char* name) {
    int64_t v = table.data()[i * table.shape(1) + d];
    if (v < 0) throw py::value_error(std::string(name) + " may not be negative");
    return static_cast<uint64_t>(v);
  };
  std::vector<io::ReadRequest> requests(n);
  for (py::ssize_t i = 0; i < n; ++i) {
    io::ReadRequest& r = requests[i];
    r.codec = io::Codec::kArrayBox;
    r.array = arrays.data()[i];
    if (dest_offsets.data()[i] < 0) throw py::value_error("dest_offsets may not be negative");
    r.dest_offset = static_cast<uint64_t>(dest_offsets.data()[i]);
    auto box = std::make_shared<io::ArrayBox>();
    for (py::ssize_t d = 0; d < rank; ++d) {
      box->start.push_back(unsigned_of(starts, i, d, "starts"));
      box->extent.push_back(unsigned_of(extents, i, d, "extents"));
      box->dest_strides.push_back(unsigned_of(dest_strides, i, d, "dest_strides"));
    }
    r.box = std::move(box);
  }
  return requests;
}

// Span i is lengths[i] bytes at offsets[i] of files.paths[file_ids[i]], read whole; box
// box_ids[i] of it lands at dest_offsets[i]. A box is (extents, src_strides,
// dest_strides) along its axes, in bytes, around elements of itemsizes bytes.
std::vector<io::ReadRequest> make_span_requests(
    const Column<uint32_t>& file_ids, const Column<uint64_t>& offsets,
    const Column<uint64_t>& lengths, const Column<uint64_t>& dest_offsets,
    const Column<uint32_t>& box_ids, const Table& extents, const Table& src_strides,
    const Table& dest_strides, const Column<uint64_t>& itemsizes) {
  const py::ssize_t n = file_ids.size(), m = itemsizes.size();
  for (const auto& [size, name] : {std::pair<py::ssize_t, const char*>{offsets.size(), "offsets"},
                                   {lengths.size(), "lengths"},
                                   {dest_offsets.size(), "dest_offsets"},
                                   {box_ids.size(), "box_ids"}}) {
    if (size != n) {
      throw py::value_error(std::string(name) + " has " + std::to_string(size) +
                            " entries but file_ids has " + std::to_string(n));
    }
  }
  const py::ssize_t rank = extents.ndim() == 2 ? extents.shape(1) : 0;
  for (const auto& [table, name] : {std::pair<const Table*, const char*>{&extents, "extents"},
                                    {&src_strides, "src_strides"},
                                    {&dest_strides, "dest_strides"}}) {
    if (table->ndim() != 2 || table->shape(0) != m || table->shape(1) != rank) {
      throw py::value_error(std::string(name) + " must have shape (len(itemsizes), rank)");
    }
  }
  std::vector<io::StridedBox> boxes(m);
  for (py::ssize_t b = 0; b < m; ++b) {
    io::StridedBox& box = boxes[b];
    box.block = itemsizes.data()[b];
    if (box.block == 0) throw py::value_error("itemsizes must be positive");
    for (py::ssize_t d = 0; d < rank; ++d) {
      int64_t e = extents.data()[b * rank + d], s = src_strides.data()[b * rank + d],
              t = dest_strides.data()[b * rank + d];
      if (e <= 0 || s < 0 || t < 0) {
        throw py::value_error("extents must be positive and strides not negative");
      }
      box.outer.push_back(
          {static_cast<uint64_t>(e), static_cast<uint64_t>(s), static_cast<uint64_t>(t)});
    }
    io::simplify(box);
  }
  // One decoder per box and span length: the spans of one patch share theirs.
  std::vector<std::shared_ptr<const io::FieldDecoder>> decoders(m);
  std::vector<uint64_t> decoder_span(m, 0);
  std::vector<io::ReadRequest> requests(n);
  for (py::ssize_t i = 0; i < n; ++i) {
    const uint32_t b = box_ids.data()[i];
    if (b >= static_cast<uint64_t>(m)) {
      throw py::value_error("box_ids[" + std::to_string(i) + "] is " + std::to_string(b) +
                            " but there are " + std::to_string(m) + " boxes");
    }
    const uint64_t span = lengths.data()[i];
    if (!decoders[b] || decoder_span[b] != span) {
      decoders[b] = io::span_box_decoder(boxes[b], span);
      decoder_span[b] = span;
    }
    io::ReadRequest& r = requests[i];
    r.file = file_ids.data()[i];
    r.offset = offsets.data()[i];
    r.length = span;
    r.dest_offset = dest_offsets.data()[i];
    r.codec = io::Codec::kSpanBox;
    r.decoder = decoders[b];
    r.out_length = r.decoder->output_bytes();
  }
  return requests;
}

using Arrays = std::vector<std::shared_ptr<io::ArrayLayout>>;
using Columns = std::vector<std::shared_ptr<io::ColumnLayout>>;

template <typename T>
std::vector<std::shared_ptr<T>> unconst(const std::vector<std::shared_ptr<const T>>& held) {
  std::vector<std::shared_ptr<T>> out;
  out.reserve(held.size());
  for (const auto& a : held) out.push_back(std::const_pointer_cast<T>(a));
  return out;
}

// Each of `columns` names one of a table's `files` files.
void check_column_files(const Columns& columns, size_t files) {
  for (const auto& c : columns) {
    if (c->file >= files) {
      throw py::value_error(c->name + ": names file " + std::to_string(c->file) +
                            " but the table has " + std::to_string(files));
    }
  }
}

std::shared_ptr<io::FileTable> make_file_table(std::vector<std::string> paths,
                                               const std::optional<Column<int64_t>>& identities,
                                               const Arrays& arrays, const Columns& columns) {
  auto table = std::make_shared<io::FileTable>();
  table->arrays.assign(arrays.begin(), arrays.end());
  check_column_files(columns, paths.size());
  table->columns.assign(columns.begin(), columns.end());
  if (identities && identities->size() > 0) {
    if (identities->ndim() != 2 || identities->shape(1) != 3 ||
        identities->shape(0) != static_cast<py::ssize_t>(paths.size())) {
      throw py::value_error("identities must have shape (len(paths), 3)");
    }
    auto v = identities->unchecked<2>();
    for (py::ssize_t i = 0; i < v.shape(0); ++i) {
      table->identities.push_back(io::FileIdentity{static_cast<uint64_t>(v(i, 0)),
                                                   static_cast<uint64_t>(v(i, 1)), v(i, 2)});
    }
  }
  table->paths = std::move(paths);
  return table;
}

py::array_t<int64_t> identities_array(const io::FileTable& t) {
  py::array_t<int64_t> out({static_cast<py::ssize_t>(t.identities.size()), py::ssize_t{3}});
  auto v = out.mutable_unchecked<2>();
  for (size_t i = 0; i < t.identities.size(); ++i) {
    v(i, 0) = static_cast<int64_t>(t.identities[i].inode);
    v(i, 1) = static_cast<int64_t>(t.identities[i].size);
    v(i, 2) = t.identities[i].mtime_ns;
  }
  return out;
}

}  // namespace

void register_reader(py::module_& m) {
  py::class_<io::FileTable, std::shared_ptr<io::FileTable>>(
      m, "FileTable", "The files a dataset's read requests refer to by index.")
      .def(py::init([](std::vector<std::string> paths, std::optional<Column<int64_t>> identities,
                       const Arrays& arrays, const Columns& columns) {
             return make_file_table(std::move(paths), identities, arrays, columns);
           }),
           py::arg("paths"), py::arg("identities") = py::none(), py::arg("arrays") = Arrays{},
           py::arg("columns") = Columns{},
           "identities: optional (n, 3) int64 array of (inode, size, mtime_ns) as indexed; "
           "reads of a file that no longer matches fail instead of reading other bytes. "
           "arrays: the ArrayLayouts that ARRAY_ROW requests name by index; columns: the "
           "ColumnLayouts that COLUMN_VALUE requests name by index.")
      .def(
          "extended",
          [](const io::FileTable& t, const Arrays& arrays, const Columns& columns) {
            check_column_files(columns, t.paths.size());
            auto out = std::make_shared<io::FileTable>(t);
            out->arrays.insert(out->arrays.end(), arrays.begin(), arrays.end());
            out->columns.insert(out->columns.end(), columns.begin(), columns.end());
            return out;
          },
          py::arg("arrays"), py::arg("columns"),
          "A table of the same files (their paths shared, not copied) with `arrays` and "
          "`columns` after its own: what appending them to the lists it was made from and "
          "making it again gives, without the copy of every path.")
      .def("__len__", [](const io::FileTable& t) { return t.paths.size(); })
      .def("__getitem__",
           [](const io::FileTable& t, size_t i) {
             if (i >= t.paths.size()) throw py::index_error();
             return t.paths[i];
           })
      .def_property_readonly("paths", [](const io::FileTable& t) { return t.paths.all(); })
      .def_property_readonly("identities", identities_array)
      .def_property_readonly("arrays", [](const io::FileTable& t) { return unconst(t.arrays); })
      .def_property_readonly("columns", [](const io::FileTable& t) { return unconst(t.columns); })
      .def(py::pickle(
          [](const io::FileTable& t) {
            return py::make_tuple(t.paths.all(), identities_array(t), unconst(t.arrays),
                                  unconst(t.columns));
          },
          [](py::tuple state) {
            return make_file_table(state[0].cast<std::vector<std::string>>(),
                                   state[1].cast<Column<int64_t>>(), state[2].cast<Arrays>(),
                                   state[3].cast<Columns>());
          }));

  py::class_<PyPendingRead>(m, "PendingRead", "A batch being read; wait() returns its buffer.")
      .def("wait", &PyPendingRead::wait, py::arg("timeout") = py::none(),
           "Block (GIL released, Ctrl-C honoured) until the batch is read; return its buffer. "
           "Raises the batch's error, or TimeoutError after `timeout` seconds.")
      .def("done", &PyPendingRead::done)
      .def("busy_seconds", &PyPendingRead::busy_seconds,
           "Thread time spent reading and decoding this batch, summed over threads.")
      .def("unsized_bytes", &PyPendingRead::unsized_bytes,
           "Bytes of the values handed out where the reader left them, for which the batch's "
           "buffer had no room (table values whose sizes were not known before the read).")
      .def("bytes_read", &PyPendingRead::bytes_read,
           "Bytes read from files for this batch so far (merged gaps included; array chunks "
           "the chunk cache served count nothing).")
      .def(
          "blanked", [](const PyPendingRead& self) { return vector_to_numpy(self.blanked()); },
          "The requests whose image did not decode and were filled with zeros.")
      .def("cancel", &PyPendingRead::cancel,
           "Skip the chunks not yet started; wait() then raises StokerError.");

  py::class_<io::ShardReader, std::shared_ptr<io::ShardReader>>(
      m, "ShardReader",
      "Reads whole batches of (file, offset, length) ranges into one buffer on a thread pool.")
      .def(py::init<size_t, size_t>(), py::arg("num_threads") = 0, py::arg("max_open_files") = 256)
      .def_property_readonly("num_threads", &io::ShardReader::num_threads)
      .def_property_readonly("max_open_files", &io::ShardReader::max_open_files)
      .def("open_files", &io::ShardReader::open_files)
      .def_property("chunk_cache_bytes", &io::ShardReader::chunk_cache_bytes,
                    &io::ShardReader::set_chunk_cache_bytes,
                    "Bytes of decoded array chunks kept across batches, per process (0: none).")
      .def("forget", &io::ShardReader::forget, py::arg("path"),
           "Close the cached descriptor of `path`, if any (reads in flight keep theirs).")
      .def(
          "batch_buffer",
          [](io::ShardReader& reader, uint64_t size) {
            return slot_to_numpy(reader.batch_buffer(size));
          },
          py::arg("size"),
          "A page-aligned uint8 array of `size` bytes (contents undefined) from the ring "
          "the reader's batches come from: a recycled buffer, its pages present, when one "
          "of about that size was let go of. It returns to the ring once the array and "
          "every view of it (tensors included) are gone.")
      .def(
          "read",
          [](io::ShardReader& reader, std::shared_ptr<io::FileTable> files,
             const Column<uint32_t>& file_ids, const Column<uint64_t>& offsets,
             const Column<uint64_t>& lengths, const Column<uint64_t>& dest_offsets, uint64_t size,
             const OptionalColumn<uint64_t>& out_lengths, const OptionalColumn<uint8_t>& codecs,
             const OptionalColumn<uint32_t>& crcs, const OptionalColumn<bool>& check_crc,
             const OptionalColumn<uint32_t>& arrays) {
            auto requests = make_requests(file_ids, offsets, lengths, dest_offsets, out_lengths,
                                          codecs, crcs, check_crc, arrays);
            auto pending = reader.submit(std::move(files), std::move(requests), size);
            const auto& buffer = pending->buffer();
            py::object array = bytes_to_numpy(buffer->data(), size, buffer);
            return PyPendingRead(std::move(pending), std::move(array));
          },
          py::arg("files"), py::arg("file_ids"), py::arg("offsets"), py::arg("lengths"),
          py::arg("dest_offsets"), py::arg("size"), py::arg("out_lengths") = py::none(),
          py::arg("codecs") = py::none(), py::arg("crcs") = py::none(),
          py::arg("check_crc") = py::none(), py::arg("arrays") = py::none(),
          "Read the pieces into a new page-aligned buffer of `size` bytes; piece i lands at "
          "dest_offsets[i].")
      .def(
          "read_into",
          [](io::ShardReader& reader, py::buffer dest, std::shared_ptr<io::FileTable> files,
             const Column<uint32_t>& file_ids, const Column<uint64_t>& offsets,
             const Column<uint64_t>& lengths, const Column<uint64_t>& dest_offsets,
             const OptionalColumn<uint64_t>& out_lengths, const OptionalColumn<uint8_t>& codecs,
             const OptionalColumn<uint32_t>& crcs, const OptionalColumn<bool>& check_crc,
             const OptionalColumn<uint32_t>& arrays) {
            auto info = std::make_unique<py::buffer_info>(dest.request(true));
            if (!PyBuffer_IsContiguous(info->view(), 'C')) {
              throw py::value_error("read_into needs a C-contiguous buffer");
            }
            auto requests = make_requests(file_ids, offsets, lengths, dest_offsets, out_lengths,
                                          codecs, crcs, check_crc, arrays);
            auto pending = reader.submit(std::move(files), std::move(requests),
                                         static_cast<uint8_t*>(info->ptr),
                                         static_cast<uint64_t>(info->size * info->itemsize));
            return PyPendingRead(std::move(pending), dest, std::move(info));
          },
          py::arg("dest"), py::arg("files"), py::arg("file_ids"), py::arg("offsets"),
          py::arg("lengths"), py::arg("dest_offsets"), py::arg("out_lengths") = py::none(),
          py::arg("codecs") = py::none(), py::arg("crcs") = py::none(),
          py::arg("check_crc") = py::none(), py::arg("arrays") = py::none(),
          "Read the pieces into `dest` (a writable C-contiguous buffer kept alive until done). "
          "If the read fails, `dest` may hold some of the pieces.")
      .def(
          "read_value_sizes",
          [](io::ShardReader& reader, std::shared_ptr<io::FileTable> files,
             const Column<uint32_t>& columns, const Column<uint64_t>& rows) {
            if (columns.size() != rows.size()) {
              throw py::value_error("columns and rows differ in length");
            }
            const py::ssize_t n = rows.size();
            std::vector<io::ReadRequest> requests(n);
            auto sizes = io::value_size_decoder();
            for (py::ssize_t i = 0; i < n; ++i) {
              io::ReadRequest& r = requests[i];
              r.codec = io::Codec::kColumnValue;
              r.array = columns.data()[i];
              r.offset = rows.data()[i];
              r.dest_offset = static_cast<uint64_t>(i) * sizeof(uint64_t);
              r.out_length = sizeof(uint64_t);
              r.decoder = sizes;
            }
            const uint64_t size = static_cast<uint64_t>(n) * sizeof(uint64_t);
            auto pending = reader.submit(std::move(files), std::move(requests), size);
            const auto& buffer = pending->buffer();
            py::object array = bytes_to_numpy(buffer->data(), size, buffer);
            return PyPendingRead(std::move(pending), std::move(array));
          },
          py::arg("files"), py::arg("columns"), py::arg("rows"),
          "Read the size in bytes of row rows[i] of column files.columns[columns[i]], as "
          "uint64 i of the buffer (2**64 - 1: the value is null). Each unit the rows lie in is "
          "decoded once, and kept for the reads of the values themselves.")
      .def(
          "read_boxes_into",
          [](io::ShardReader& reader, py::buffer dest, std::shared_ptr<io::FileTable> files,
             const Column<uint32_t>& arrays, const Table& starts, const Table& extents,
             const Column<int64_t>& dest_offsets, const Table& dest_strides) {
            auto info = std::make_unique<py::buffer_info>(dest.request(true));
            if (!PyBuffer_IsContiguous(info->view(), 'C')) {
              throw py::value_error("read_boxes_into needs a C-contiguous buffer");
            }
            auto requests = make_box_requests(arrays, starts, extents, dest_offsets, dest_strides);
            auto pending = reader.submit(std::move(files), std::move(requests),
                                         static_cast<uint8_t*>(info->ptr),
                                         static_cast<uint64_t>(info->size * info->itemsize));
            return PyPendingRead(std::move(pending), dest, std::move(info));
          },
          py::arg("dest"), py::arg("files"), py::arg("arrays"), py::arg("starts"),
          py::arg("extents"), py::arg("dest_offsets"), py::arg("dest_strides"),
          "Read boxes of array layouts into `dest` (a writable C-contiguous buffer kept alive "
          "until done): box i is [starts[i], starts[i] + extents[i]) of files.arrays[arrays[i]], "
          "its element (j0, j1, ...) at byte dest_offsets[i] + sum(j_d * dest_strides[i, d]). "
          "Each chunk the boxes touch is read and decoded once.")
      .def(
          "foresee_boxes",
          [](io::ShardReader& reader, const io::FileTable& files, const Column<uint32_t>& arrays,
             const Table& starts, const Table& extents, const Column<int64_t>& batches,
             bool fresh) {
            if (batches.size() != arrays.size()) {
              throw py::value_error("batches has " + std::to_string(batches.size()) +
                                    " entries but arrays has " + std::to_string(arrays.size()));
            }
            // (where the boxes would land does not matter here)
            Column<int64_t> nowhere(arrays.size());
            std::fill_n(nowhere.mutable_data(), nowhere.size(), 0);
            Table unstrided(std::vector<py::ssize_t>{starts.ndim() == 2 ? starts.shape(0) : 0,
                                                     starts.ndim() == 2 ? starts.shape(1) : 0});
            std::fill_n(unstrided.mutable_data(), unstrided.size(), 0);
            auto boxes = make_box_requests(arrays, starts, extents, nowhere, unstrided);
            std::vector<int64_t> numbers(batches.data(), batches.data() + batches.size());
            // Under the GIL, as set_chunk_cache_bytes is, which replaces the cache this
            // fills (a window's counting takes about a millisecond, and never waits).
            reader.foresee(files, boxes, numbers, fresh);
          },
          py::arg("files"), py::arg("arrays"), py::arg("starts"), py::arg("extents"),
          py::arg("batches"), py::arg("fresh"),
          "Say which boxes the batches ahead will read (box i by batch batches[i], a "
          "batch's boxes one after another, in read_boxes_into's form): a JPEG tile several "
          "batches want is then decoded once, only the part they take, and kept until the "
          "last of them, where that costs less. fresh: forget what was foreseen for the "
          "table's arrays before (a new epoch).")
      .def(
          "read_spans_into",
          [](io::ShardReader& reader, py::buffer dest, std::shared_ptr<io::FileTable> files,
             const Column<uint32_t>& file_ids, const Column<uint64_t>& offsets,
             const Column<uint64_t>& lengths, const Column<uint64_t>& dest_offsets,
             const Column<uint32_t>& box_ids, const Table& extents, const Table& src_strides,
             const Table& dest_strides, const Column<uint64_t>& itemsizes) {
            auto info = std::make_unique<py::buffer_info>(dest.request(true));
            if (!PyBuffer_IsContiguous(info->view(), 'C')) {
              throw py::value_error("read_spans_into needs a C-contiguous buffer");
            }
            auto requests = make_span_requests(file_ids, offsets, lengths, dest_offsets, box_ids,
                                               extents, src_strides, dest_strides, itemsizes);
            auto pending = reader.submit(std::move(files), std::move(requests),
                                         static_cast<uint8_t*>(info->ptr),
                                         static_cast<uint64_t>(info->size * info->itemsize));
            return PyPendingRead(std::move(pending), dest, std::move(info));
          },
          py::arg("dest"), py::arg("files"), py::arg("file_ids"), py::arg("offsets"),
          py::arg("lengths"), py::arg("dest_offsets"), py::arg("box_ids"), py::arg("extents"),
          py::arg("src_strides"), py::arg("dest_strides"), py::arg("itemsizes"),
          "Read spans whole and keep a strided box of each: span i is lengths[i] bytes at "
          "offsets[i] of files.paths[file_ids[i]]; element (j0, j1, ...) of box b = "
          "box_ids[i], at byte sum(j_d * src_strides[b, d]) of the span, lands at byte "
          "dest_offsets[i] + sum(j_d * dest_strides[b, d]) of `dest`.");

  m.def(
      "bench_pread",
      [](const io::FileTable& files, const Column<uint32_t>& file_ids,
         const Column<uint64_t>& offsets, const Column<uint64_t>& lengths, size_t num_threads) {
        Column<uint64_t> dest(offsets.size());
        std::fill_n(dest.mutable_data(), dest.size(), 0);
        auto requests = make_requests(file_ids, offsets, lengths, dest, std::nullopt, std::nullopt,
                                      std::nullopt, std::nullopt, std::nullopt);
        py::gil_scoped_release release;
        return io::bench_pread(files, requests, num_threads);
      },
      py::arg("files"), py::arg("file_ids"), py::arg("offsets"), py::arg("lengths"),
      py::arg("num_threads") = 0,
      "Benchmarks only: the same reads as bare preads on num_threads threads, no batching. "
      "Returns seconds.");
  m.def("default_num_threads", &io::ThreadPool::default_size);
  m.def(
      "stat_files",
      [](const std::vector<std::string>& paths, size_t num_threads) {
        std::vector<io::FileIdentity> identities;
        std::vector<int> errors;
        {
          py::gil_scoped_release release;
          // Stats are latency, not CPU: on a network mount more threads help.
          size_t threads = num_threads == 0
                               ? std::min<size_t>(64, io::ThreadPool::default_size() * 4)
                               : num_threads;
          io::stat_files(paths, threads, identities, errors);
        }
        io::FileTable table{{}, std::move(identities)};
        return py::make_tuple(identities_array(table), vector_to_numpy(std::move(errors)));
      },
      py::arg("paths"), py::arg("num_threads") = 0,
      "(identities, errors) of many files, stat'ed in parallel: an (n, 3) int64 array of "
      "(inode, size, mtime_ns), and the errno of each failed stat (0 where it worked).");
}

}  // namespace stoker::bindings
