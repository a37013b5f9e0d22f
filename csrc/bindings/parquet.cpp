// Parquet's footer, offset index and column chunks, for tests, tools and the reader's
// Python side: plain dicts and numpy arrays, every parse and decode with the GIL released.
#include "stoker/format/parquet.hpp"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "numpy_util.hpp"
#include "stoker/errors.hpp"
#include "stoker/io/thread_pool.hpp"

namespace py = pybind11;

namespace stoker::bindings {

namespace {

namespace pq = format::parquet;

// Schema names and key-value metadata need not be UTF-8: they round-trip as
// os.fsdecode's names do.
py::str text_of(const std::string& s) {
  PyObject* out =
      PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "surrogateescape");
  if (out == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(out);
}

py::list texts_of(const std::vector<std::string>& names) {
  py::list out;
  for (const auto& name : names) out.append(text_of(name));
  return out;
}

std::string path_of(const py::object& path) {
  return py::module_::import("os").attr("fsencode")(path).cast<std::string>();
}

struct Bytes {
  py::buffer_info info;
  const uint8_t* data() const { return static_cast<const uint8_t*>(info.ptr); }
  uint64_t size() const { return static_cast<uint64_t>(info.size * info.itemsize); }
};

Bytes bytes_of(const py::buffer& buffer) { return Bytes{buffer.request()}; }

py::dict schema_element_dict(const pq::SchemaElement& e) {
  py::dict d;
  d["name"] = text_of(e.name);
  d["type"] = e.type;
  d["type_length"] = e.type_length;
  d["repetition"] = e.repetition;
  d["num_children"] = e.num_children;
  d["converted_type"] = e.converted_type;
  d["scale"] = e.scale;
  d["precision"] = e.precision;
  d["logical_type"] = e.logical_type;
  d["int_bit_width"] = e.int_bit_width;
  d["int_signed"] = e.int_signed;
  d["time_unit"] = e.time_unit;
  d["adjusted_to_utc"] = e.adjusted_to_utc;
  return d;
}

py::dict column_chunk_dict(const pq::ColumnChunkMeta& c) {
  py::dict d;
  d["path"] = texts_of(c.path);
  d["type"] = c.type;
  d["codec"] = static_cast<int>(c.codec);
  d["encodings"] = c.encodings;
  d["num_values"] = c.num_values;
  d["total_uncompressed_size"] = c.total_uncompressed_size;
  d["total_compressed_size"] = c.total_compressed_size;
  d["data_page_offset"] = c.data_page_offset;
  d["dictionary_page_offset"] = c.dictionary_page_offset;
  d["offset_index_offset"] = c.offset_index_offset;
  d["offset_index_length"] = c.offset_index_length;
  d["column_index_offset"] = c.column_index_offset;
  d["column_index_length"] = c.column_index_length;
  d["file_path"] = text_of(c.file_path);
  d["encrypted"] = c.encrypted;
  return d;
}

py::dict leaf_dict(const pq::LeafColumn& leaf) {
  py::dict d;
  d["path"] = texts_of(leaf.path);
  d["schema_index"] = leaf.schema_index;
  d["physical_type"] = static_cast<int>(leaf.spec.type);
  d["type_length"] = leaf.spec.type_length;
  d["max_definition"] = leaf.spec.max_definition;
  d["max_repetition"] = leaf.spec.max_repetition;
  d["repeated_definition"] = leaf.spec.repeated_definition;
  return d;
}

py::dict metadata_dict(const pq::FileMetaData& m, const std::vector<pq::LeafColumn>& leaves) {
  py::dict d;
  d["version"] = m.version;
  d["num_rows"] = m.num_rows;
  py::list schema, row_groups, key_value, leaf_list;
  for (const auto& e : m.schema) schema.append(schema_element_dict(e));
  for (const auto& g : m.row_groups) {
    py::dict group;
    group["num_rows"] = g.num_rows;
    group["total_byte_size"] = g.total_byte_size;
    py::list columns;
    for (const auto& c : g.columns) columns.append(column_chunk_dict(c));
    group["columns"] = columns;
    row_groups.append(group);
  }
  for (const auto& [key, value] : m.key_value) {
    key_value.append(py::make_tuple(text_of(key), text_of(value)));
  }
  for (const auto& leaf : leaves) leaf_list.append(leaf_dict(leaf));
  d["schema"] = schema;
  d["row_groups"] = row_groups;
  d["key_value"] = key_value;
  d["created_by"] = text_of(m.created_by);
  d["encrypted"] = m.encrypted;
  d["leaves"] = leaf_list;
  return d;
}

// A 1-D array of `count` Ts at `at`, inside the buffer `owner` keeps alive.
template <typename T>
py::array_t<T> view_of(const T* at, size_t count, const py::object& owner) {
  py::array_t<T> out({count}, {sizeof(T)}, at, owner);
  out.attr("setflags")(py::arg("write") = false);
  return out;
}

// Values left in place (in `stored`, the chunk decoded, or in the kept pages) are
// gathered, so that every way of decoding gives the same arrays.
py::tuple decoded_arrays(io::ByteVector&& decoded, const uint8_t* stored, uint64_t stored_size) {
  auto* owned = new io::ByteVector(std::move(decoded));
  py::capsule owner(owned, [](void* p) { delete static_cast<io::ByteVector*>(p); });
  pq::DecodedView v = pq::view_decoded(*owned);
  py::object nulls = py::none();
  if (v.nulls != nullptr) nulls = view_of(v.nulls, v.rows, owner);
  py::object data;
  if (v.starts == nullptr) {
    data = view_of(v.data, v.offsets[v.rows], owner);
  } else {
    py::array_t<uint8_t> values(static_cast<py::ssize_t>(v.offsets[v.rows]));
    const uint8_t* from = v.data != nullptr ? v.data : stored;
    const uint64_t within = v.data != nullptr ? v.data_size : stored_size;
    for (uint64_t r = 0; r < v.rows; ++r) {
      const uint64_t length = v.offsets[r + 1] - v.offsets[r];
      if (v.offsets[r + 1] < v.offsets[r] || v.offsets[r + 1] > v.offsets[v.rows] ||
          v.starts[r] > within || length > within - v.starts[r]) {
        throw Error("decode_parquet_chunk: row " + std::to_string(r) +
                    " lies outside the bytes it was left in");
      }
      if (length) std::memcpy(values.mutable_data() + v.offsets[r], from + v.starts[r], length);
    }
    values.attr("setflags")(py::arg("write") = false);
    data = values;
  }
  return py::make_tuple(view_of(v.offsets, v.rows + 1, owner), nulls, data);
}

uint8_t small_enum(int64_t value, const char* what) {
  if (value < 0 || value > 255) throw Error(std::string(what) + " must be 0 to 255");
  return static_cast<uint8_t>(value);
}

}  // namespace

void register_parquet(py::module_& m) {
  m.def(
      "parquet_footer",
      [](const py::buffer& tail, uint64_t file_size, const py::object& path) {
        Bytes t = bytes_of(tail);
        std::string p = path_of(path);
        pq::FooterSpan span;
        {
          py::gil_scoped_release release;
          span = pq::locate_footer(t.data(), t.size(), file_size, p);
        }
        return py::make_tuple(span.offset, span.size);
      },
      py::arg("tail"), py::arg("file_size"), py::arg("path"),
      "(offset, size) of the FileMetaData of a Parquet file of `file_size` bytes, from its "
      "last bytes `tail` (the whole file: its leading PAR1 is checked too); ShardFormatError "
      "for a file that is not Parquet, is cut off, or has an encrypted footer");
  m.def(
      "parquet_summaries",
      [](const std::vector<std::string>& paths, size_t num_threads) {
        std::vector<pq::FileSummary> found(paths.size());
        std::vector<std::exception_ptr> failed(paths.size());
        {
          py::gil_scoped_release release;
          // Reads of a few kilobytes each: latency, not CPU, on a network mount.
          size_t threads = num_threads == 0
                               ? std::min<size_t>(32, io::ThreadPool::default_size() * 4)
                               : num_threads;
          io::parallel_for(paths.size(), threads, [&](size_t i) {
            try {
              found[i] = pq::summarize_file(paths[i]);
            } catch (...) {
              failed[i] = std::current_exception();
            }
          });
        }
        for (const auto& e : failed) {
          if (e) std::rethrow_exception(e);  // the first file's, as reading in order would
        }
        std::vector<int64_t> rows(paths.size());
        std::vector<uint64_t> keys(paths.size());
        py::array_t<int64_t> identities({static_cast<py::ssize_t>(paths.size()), py::ssize_t{3}});
        auto id = identities.mutable_unchecked<2>();
        py::list groups;
        for (size_t i = 0; i < paths.size(); ++i) {
          rows[i] = found[i].rows;
          keys[i] = found[i].columns_key;
          id(i, 0) = static_cast<int64_t>(found[i].identity.inode);
          id(i, 1) = static_cast<int64_t>(found[i].identity.size);
          id(i, 2) = found[i].identity.mtime_ns;
          groups.append(vector_to_numpy(std::move(found[i].group_rows)));
        }
        return py::make_tuple(vector_to_numpy(std::move(rows)), groups, identities,
                              vector_to_numpy(std::move(keys)));
      },
      py::arg("paths"), py::arg("num_threads") = 0,
      "(rows, groups, identities, keys) of Parquet files, each from its footer alone, read "
      "on num_threads threads: int64 rows per file, each file's row groups' rows, an (n, 3) "
      "int64 array of (inode, size, mtime_ns), and a uint64 key equal for files whose "
      "columns read alike (schema, codecs, encodings). Raises the first file's error.");
  m.def(
      "parquet_metadata",
      [](const py::buffer& data, const py::object& path, uint64_t offset) {
        Bytes b = bytes_of(data);
        std::string p = path_of(path);
        pq::FileMetaData metadata;
        std::vector<pq::LeafColumn> leaves;
        {
          py::gil_scoped_release release;
          metadata = pq::parse_file_metadata(b.data(), b.size(), p, offset);
          leaves = pq::leaf_columns(metadata, p, offset);
        }
        return metadata_dict(metadata, leaves);
      },
      py::arg("data"), py::arg("path"), py::arg("offset"),
      "The FileMetaData in `data` (which lies at file offset `offset`) as plain dicts and "
      "lists, with 'leaves': each leaf column's path, physical type and levels");
  m.def(
      "parquet_offset_index",
      [](const py::buffer& data, const py::object& path, uint64_t offset) {
        Bytes b = bytes_of(data);
        std::string p = path_of(path);
        std::vector<pq::PageLocation> pages;
        {
          py::gil_scoped_release release;
          pages = pq::parse_offset_index(b.data(), b.size(), p, offset);
        }
        py::array_t<int64_t> offsets(pages.size()), first_rows(pages.size());
        py::array_t<int32_t> sizes(pages.size());
        for (size_t i = 0; i < pages.size(); ++i) {
          offsets.mutable_at(i) = pages[i].offset;
          sizes.mutable_at(i) = pages[i].compressed_page_size;
          first_rows.mutable_at(i) = pages[i].first_row_index;
        }
        py::dict out;
        out["offset"] = offsets;
        out["compressed_page_size"] = sizes;
        out["first_row_index"] = first_rows;
        return out;
      },
      py::arg("data"), py::arg("path"), py::arg("offset"),
      "A column chunk's offset index: its pages' file offsets, compressed sizes and first "
      "rows, as numpy arrays");
  m.def(
      "decode_parquet_chunk",
      [](const py::buffer& data, uint64_t file_offset, uint64_t rows, int64_t physical_type,
         int32_t type_length, int16_t max_definition, int16_t max_repetition, int64_t codec,
         const std::string& name, const py::object& path, int16_t repeated_definition,
         uint64_t max_decoded_bytes, const std::string& values_left,
         uint64_t least_bytes_in_pages) {
        Bytes b = bytes_of(data);
        std::string p = path_of(path);
        pq::ColumnSpec spec;
        spec.type = static_cast<pq::PhysicalType>(small_enum(physical_type, "physical_type"));
        spec.type_length = type_length;
        spec.max_definition = max_definition;
        spec.max_repetition = max_repetition;
        spec.repeated_definition = repeated_definition;
        spec.codec = static_cast<pq::Compression>(small_enum(codec, "codec"));
        spec.name = name;
        spec.max_decoded_bytes = max_decoded_bytes;
        spec.least_bytes_in_pages = least_bytes_in_pages;
        io::ValuesLeft left = values_left == "pages"    ? io::ValuesLeft::kInPages
                              : values_left == "stored" ? io::ValuesLeft::kInStored
                                                        : io::ValuesLeft::kCopied;
        if (left == io::ValuesLeft::kCopied && values_left != "copied") {
          throw Error("values_left is 'copied', 'pages' or 'stored', not '" + values_left + "'");
        }
        io::ByteVector decoded;
        {
          py::gil_scoped_release release;
          decoded = pq::decode_column_chunk(b.data(), b.size(), file_offset, spec, rows, p, left);
        }
        return decoded_arrays(std::move(decoded), b.data(), b.size());
      },
      py::arg("data"), py::arg("file_offset"), py::arg("rows"), py::arg("physical_type"),
      py::arg("type_length"), py::arg("max_definition"), py::arg("max_repetition"),
      py::arg("codec"), py::arg("name"), py::arg("path"), py::arg("repeated_definition") = -1,
      py::arg("max_decoded_bytes") = pq::kMaxDecodedBytes, py::arg("values_left") = "copied",
      py::arg("least_bytes_in_pages") = pq::kLeastBytesInPages,
      "A whole column chunk (`data`, from file offset `file_offset`: an optional dictionary "
      "page, then data pages) of `rows` rows decoded: (offsets uint64[rows + 1], nulls "
      "uint8[rows] or None when no row is null, data uint8); row r is data[offsets[r]:"
      "offsets[r + 1]]. Read-only arrays. `values_left` ('copied', 'pages', 'stored': "
      "io::ValuesLeft) picks how byte strings are decoded, as the reader does; the values are "
      "gathered back to back whatever it is.");
}

}  // namespace stoker::bindings
