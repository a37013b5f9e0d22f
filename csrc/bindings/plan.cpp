// The fields= plan: made once per Loader, asked once per batch. Planning holds
// the GIL (it is a few microseconds, and a message may need a sample's key from
// Python); reading releases it, as every read does.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "bindings.hpp"
#include "numpy_util.hpp"
#include "pending.hpp"
#include "stoker/errors.hpp"
#include "stoker/io/decoder.hpp"
#include "stoker/plan/batch_plan.hpp"
#include "stoker/plan/keyed_draws.hpp"
#include "stoker/plan/keyed_permutation.hpp"

namespace py = pybind11;

namespace stoker::bindings {

namespace {

// A column the plan reads through a raw pointer: it must be the caller's own
// memory (no converted copy), so that rows filled in later are seen.
template <typename T>
py::array_t<T> exact(const py::handle& object, const char* what) {
  if (!py::isinstance<py::array_t<T>>(object)) {
    throw py::type_error(std::string(what) + " must be a numpy array of " +
                         py::str(py::dtype::of<T>()).cast<std::string>());
  }
  auto array = py::reinterpret_borrow<py::array_t<T>>(object);
  if (array.ndim() != 1 || !(array.flags() & py::array::c_style)) {
    throw py::value_error(std::string(what) + " must be a contiguous 1-D array");
  }
  return array;
}

// Python objects a C++ structure points into, let go of with the GIL held from
// whichever thread drops the structure last.
std::shared_ptr<const void> hold_objects(std::vector<py::object> objects) {
  auto* held = new std::vector<py::object>(std::move(objects));
  return std::shared_ptr<const void>(held, [](const void* p) {
    py::gil_scoped_acquire gil;
    delete static_cast<const std::vector<py::object>*>(p);
  });
}

// A member column as the plan reads it: a numpy array of the caller's (held in `keep`),
// or a rule (shard_rows.ComputedColumn: its `base` and `step`, one of each per member of
// a sample). `length` is its rows.
template <typename T>
plan::MemberColumn<T> member_column(const py::handle& object, const char* what,
                                    std::vector<py::object>& keep, uint64_t& length) {
  plan::MemberColumn<T> out;
  if (py::isinstance<py::array>(object)) {
    auto array = exact<T>(object, what);
    keep.push_back(py::reinterpret_borrow<py::object>(object));
    out.stored = array.data();
    length = static_cast<uint64_t>(array.size());
    return out;
  }
  out.base = object.attr("base").cast<std::vector<T>>();
  out.step = object.attr("step").cast<std::vector<T>>();
  if (out.base.empty() || out.base.size() != out.step.size()) {
    throw py::value_error(std::string(what) +
                          ": a rule needs as many steps as bases, at least one");
  }
  length = object.attr("rows").cast<uint64_t>();
  return out;
}

// One indexed shard's member columns (rows within the shard), as the plan reads them.
std::shared_ptr<plan::ShardColumns> make_shard_columns(int64_t first_sample, py::dict columns,
                                                       py::object sample_first,
                                                       py::list field_rows) {
  auto out = std::make_shared<plan::ShardColumns>();
  std::vector<py::object> keep;
  uint64_t rows = 0, length = 0;
  out->file = member_column<uint32_t>(columns["file"], "file", keep, rows);
  auto column = [&](auto& into, const char* name) {
    into = member_column<typename std::decay_t<decltype(into)>::Value>(columns[name], name, keep,
                                                                       length);
    if (length != rows) throw py::value_error("the member columns differ in length");
  };
  column(out->offset, "offset");
  column(out->length, "length");
  column(out->out, "out");
  column(out->codec, "codec");
  column(out->crc, "crc");
  column(out->decoder, "decoder");
  column(out->array, "array");
  out->rows = rows;
  out->sample_first = member_column<int64_t>(sample_first, "sample_first", keep, out->samples);
  out->first_sample = first_sample;
  for (const py::handle& table : field_rows) {
    if (table.is_none()) {
      out->field_rows.emplace_back();
      continue;
    }
    out->field_rows.push_back(member_column<int64_t>(table, "a field's rows", keep, length));
    if (length != out->samples) {
      throw py::value_error("a field's rows differ in length from the shard's samples");
    }
  }
  out->keep = hold_objects(std::move(keep));
  return out;
}

// The index as one batch sees it: made again whenever shards are indexed or let go.
class PyMembers {
 public:
  PyMembers(py::array shard_start, py::dict resident, std::shared_ptr<io::FileTable> files,
            std::vector<uint64_t> decoder_row_bytes, std::vector<std::string> decoder_what) {
    auto starts = exact<int64_t>(shard_start, "shard_start");
    if (starts.size() < 1) throw py::value_error("shard_start needs at least one entry");
    m_.shard_start =
        std::make_shared<const std::vector<int64_t>>(starts.data(), starts.data() + starts.size());
    m_.samples = static_cast<uint64_t>(starts.data()[starts.size() - 1]);
    for (auto item : resident) {
      m_.resident.emplace(item.first.cast<uint32_t>(),
                          item.second.cast<std::shared_ptr<plan::ShardColumns>>());
    }
    m_.files = std::move(files);
    if (decoder_row_bytes.size() != decoder_what.size()) {
      throw py::value_error("decoder_row_bytes and decoder_what differ in length");
    }
    m_.decoder_row_bytes = std::move(decoder_row_bytes);
    m_.decoder_what = std::move(decoder_what);
  }
  const plan::Members& members() const { return m_; }

 private:
  plan::Members m_;
};

plan::KeyOf key_function(py::function key_of) {
  // Keys decode as tar member names do (surrogateescape): back to their bytes.
  return [key_of](int64_t sample) {
    py::object key = key_of(sample);
    return key.attr("encode")("utf-8", "surrogateescape").cast<std::string>();
  };
}

class PyPreparedBatch {
 public:
  PyPreparedBatch(std::shared_ptr<const plan::BatchPlan> plan, plan::PreparedBatch batch,
                  std::shared_ptr<PyMembers> members)
      : plan_(std::move(plan)), batch_(std::move(batch)), members_(std::move(members)) {}

  uint64_t nbytes() const { return batch_.nbytes; }

  PyPendingRead submit(io::ShardReader& reader, std::optional<py::buffer> into) {
    std::vector<io::ReadRequest> requests = batch_.requests;
    auto files = members_->members().files;
    if (into) {
      auto info = std::make_unique<py::buffer_info>(into->request(true));
      if (!PyBuffer_IsContiguous(info->view(), 'C')) {
        throw py::value_error("submit needs a C-contiguous buffer");
      }
      auto* dest = static_cast<uint8_t*>(info->ptr);
      auto size = static_cast<uint64_t>(info->size * info->itemsize);
      if (size < batch_.nbytes) throw py::value_error("the buffer is smaller than the batch");
      plan_->write_columns(batch_, dest);
      auto pending = reader.submit(std::move(files), std::move(requests), dest, batch_.nbytes);
      return PyPendingRead(std::move(pending), *into, std::move(info));
    }
    auto pending = reader.submit(std::move(files), std::move(requests), batch_.nbytes);
    const auto& buffer = pending->buffer();
    // The columns' region is no piece's: filling it beside the reading threads is safe.
    plan_->write_columns(batch_, buffer->data());
    py::object array = bytes_to_numpy(buffer->data(), batch_.nbytes, buffer);
    return PyPendingRead(std::move(pending), std::move(array));
  }

  void check(const py::buffer& buffer) const {
    py::buffer_info info = buffer.request();
    if (static_cast<uint64_t>(info.size * info.itemsize) < batch_.nbytes) {
      throw py::value_error("the buffer is smaller than the batch");
    }
    plan_->check(batch_, static_cast<const uint8_t*>(info.ptr), members_->members());
  }

  // Per field: (offset, decoder, npy, bytes): npy is (descr, shape, fortran_order) for
  // .npy members, bytes is (starts, lengths) for Bytes fields; None otherwise.
  py::list layout() const {
    py::list out;
    for (const plan::FieldLayout& f : batch_.fields) {
      py::object npy = py::none(), bytes = py::none();
      if (f.members) {
        npy = py::make_tuple(f.npy.descr, py::tuple(py::cast(f.npy.shape)), f.npy.fortran_order);
      }
      if (!f.starts.empty() || !f.lengths.empty()) {
        bytes = py::make_tuple(vector_to_numpy(std::vector<uint64_t>(f.starts)),
                               vector_to_numpy(std::vector<uint64_t>(f.lengths)));
      }
      out.append(py::make_tuple(f.offset, f.decoder, npy, bytes));
    }
    return out;
  }

  // A Bytes field's values in sample order, an array each (of `dtype`, uint8 unless given):
  // views of `buffer`, the finished read of `pending` (copies with `copy`: a pinned slot the
  // ring needs back), or of where the reader left them: the decoded units, read-only, as
  // the cache serves the same units to later batches, or copies of the batch's own.
  py::list values(size_t field, const py::array& buffer, const PyPendingRead& pending, bool copy,
                  std::optional<py::dtype> dtype) const {
    if (field >= batch_.fields.size()) throw py::index_error("no such field");
    const plan::FieldLayout& f = batch_.fields[field];
    const size_t n = f.starts.size();
    const std::vector<io::BorrowedValue> borrowed = pending.borrowed();
    std::vector<const io::BorrowedValue*> lent(n, nullptr);
    for (const io::BorrowedValue& b : borrowed) {
      if (b.request >= f.first_request && b.request - f.first_request < n) {
        lent[b.request - f.first_request] = &b;
      }
    }
    const py::dtype type = dtype ? *dtype : py::dtype::of<uint8_t>();
    const auto itemsize = static_cast<uint64_t>(type.itemsize());
    const auto* base = static_cast<const uint8_t*>(buffer.data());
    const auto size = static_cast<uint64_t>(buffer.nbytes());
    py::list out(n);
    py::object unit;  // the capsule of the last unit a value was borrowed from
    const void* unit_of = nullptr;
    for (size_t i = 0; i < n; ++i) {
      const io::BorrowedValue* b = lent[i];
      const uint64_t length = b ? b->size : f.lengths[i];
      if (length % itemsize != 0) {
        throw py::value_error("a value of " + std::to_string(length) +
                              " bytes is not a whole number of " + std::to_string(itemsize) +
                              "-byte items");
      }
      const std::vector<ssize_t> shape{static_cast<ssize_t>(length / itemsize)};
      const std::vector<ssize_t> strides{static_cast<ssize_t>(itemsize)};
      if (!b && (f.starts[i] > size || length > size - f.starts[i])) {
        throw py::value_error("the buffer is smaller than the batch");
      }
      const uint8_t* src = b ? b->data : base + f.starts[i];
      // A pinned slot's values are copied out; views of the buffer are aligned
      // (plan::kAlign), and a borrowed list of numbers lying unaligned is copied too.
      const bool copied = b ? reinterpret_cast<uintptr_t>(src) % itemsize != 0 : copy;
      py::array value;
      if (copied) {
        value = py::array(type, shape, strides);
        if (length) std::memcpy(value.mutable_data(), src, length);
      } else if (!b) {
        value = py::array(type, shape, strides, src, buffer);
      } else {
        if (b->owner.get() != unit_of) {
          auto holder = std::make_unique<std::shared_ptr<const io::ByteVector>>(b->owner);
          unit = py::capsule(holder.get(), [](void* p) {
            delete static_cast<std::shared_ptr<const io::ByteVector>*>(p);
          });
          holder.release();  // the capsule's now
          unit_of = b->owner.get();
        }
        value = py::array(type, shape, strides, src, unit);
        if (b->shared) {
          py::detail::array_proxy(value.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
        }
      }
      PyList_SET_ITEM(out.ptr(), static_cast<ssize_t>(i), value.release().ptr());
    }
    return out;
  }

  // The member row and file offset of every piece read (a reader error names them).
  py::tuple pieces() const {
    std::vector<uint64_t> offsets;
    offsets.reserve(batch_.requests.size());
    for (const io::ReadRequest& r : batch_.requests) offsets.push_back(r.offset);
    return py::make_tuple(vector_to_numpy(std::vector<int64_t>(batch_.request_rows)),
                          vector_to_numpy(std::move(offsets)));
  }

 private:
  std::shared_ptr<const plan::BatchPlan> plan_;
  plan::PreparedBatch batch_;
  std::shared_ptr<PyMembers> members_;
};

// The plan with the arrays its field specs point into.
struct PyBatchPlan {
  std::shared_ptr<const plan::BatchPlan> plan;
  std::vector<py::object> keep;
};

PyBatchPlan make_plan(const py::list& fields) {
  PyBatchPlan out;
  std::vector<plan::FieldSpec> specs;
  for (const py::handle& item : fields) {
    auto t = item.cast<py::tuple>();
    if (t.size() != 8) {
      throw py::value_error(
          "a field is (name, kind, nbytes, what, alternatives, field_ids, column, image)");
    }
    plan::FieldSpec f;
    f.name = t[0].cast<std::string>();
    auto kind = t[1].cast<int>();
    if (kind < 0 || kind > static_cast<int>(plan::Kind::kImage)) {
      throw py::value_error("unknown field kind " + std::to_string(kind));
    }
    f.kind = static_cast<plan::Kind>(kind);
    f.nbytes = t[2].cast<uint64_t>();
    f.what = t[3].cast<std::string>();
    f.alternatives = t[4].cast<std::vector<std::string>>();
    f.field_ids = t[5].cast<std::vector<int32_t>>();
    if (!t[6].is_none()) {
      auto column = exact<int64_t>(t[6], "a column");
      f.length = static_cast<uint64_t>(column.size());
      out.keep.push_back(py::reinterpret_borrow<py::object>(t[6]));
      f.column = column.data();
    }
    if (!t[7].is_none()) f.image = t[7].cast<std::shared_ptr<image::Target>>();
    specs.push_back(std::move(f));
  }
  out.plan = std::make_shared<const plan::BatchPlan>(std::move(specs));
  return out;
}

// The words of keyed_generators' states, to be advanced in place.
uint64_t* generator_states(py::array_t<uint64_t, py::array::c_style>& states) {
  if (states.ndim() != 2 || states.shape(1) != static_cast<py::ssize_t>(plan::kGeneratorWords)) {
    throw py::value_error("states must be keyed_generators' (n, 5) array");
  }
  if (!states.writeable()) throw py::value_error("states must be writable: draws advance them");
  return states.mutable_data();
}

}  // namespace

void register_plan(py::module_& m) {
  m.def(
      "keyed_permutation",
      [](uint64_t n, const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& keys,
         const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& positions) {
        if (n > (uint64_t{1} << 63)) {
          throw py::value_error("n must be at most 2**63: positions are int64");
        }
        const int64_t* at = positions.data();
        for (py::ssize_t i = 0; i < positions.size(); ++i) {
          if (at[i] < 0 || static_cast<uint64_t>(at[i]) >= n) {
            throw py::value_error("position " + std::to_string(at[i]) + " is outside [0, " +
                                  std::to_string(n) + ")");
          }
        }
        py::array_t<int64_t> out(positions.size());
        int64_t* into = out.mutable_data();
        {
          py::gil_scoped_release release;
          plan::keyed_permutation(n, keys.data(), static_cast<size_t>(keys.size()), at,
                                  static_cast<size_t>(positions.size()), into);
        }
        return out;
      },
      py::arg("n"), py::arg("keys"), py::arg("positions"),
      "Where each of `positions` (each in [0, n)) goes under the pseudo-random permutation "
      "of [0, n) that `keys` (uint64, one per Feistel round) choose.");
  m.def(
      "keyed_generators",
      [](const py::array_t<uint32_t, py::array::c_style | py::array::forcecast>& prefix,
         const py::array_t<uint32_t, py::array::c_style | py::array::forcecast>& tails) {
        if (tails.ndim() != 2) throw py::value_error("tails must be 2-D: a row of words a key");
        const auto n = static_cast<size_t>(tails.shape(0));
        py::array_t<uint64_t> out({n, plan::kGeneratorWords});
        uint64_t* into = out.mutable_data();
        {
          py::gil_scoped_release release;
          plan::keyed_generators(prefix.data(), static_cast<size_t>(prefix.size()), tails.data(),
                                 static_cast<size_t>(tails.shape(1)), n, into);
        }
        return out;
      },
      py::arg("prefix"), py::arg("tails"),
      "The generator numpy's default_rng(key) makes, for each key: a (n, 5) uint64 array "
      "that generator_uniforms and generator_integers draw from. A key's 32-bit words (as "
      "SeedSequence splits its integers) are `prefix` then its row of `tails`.");
  m.def(
      "generator_uniforms",
      [](py::array_t<uint64_t, py::array::c_style>& states, size_t count) {
        uint64_t* words = generator_states(states);
        const auto n = static_cast<size_t>(states.shape(0));
        py::array_t<double> out({n, count});
        double* into = out.mutable_data();
        {
          py::gil_scoped_release release;
          plan::generator_uniforms(words, n, count, into);
        }
        return out;
      },
      py::arg("states").noconvert(), py::arg("count"),
      "`count` doubles in [0, 1) from each generator of `states` (keyed_generators'), as "
      "numpy's Generator.random(count) draws them: an (n, count) array. The states advance.");
  m.def(
      "generator_integers",
      [](py::array_t<uint64_t, py::array::c_style>& states,
         const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& highs) {
        uint64_t* words = generator_states(states);
        const auto n = static_cast<size_t>(states.shape(0));
        if (highs.ndim() != 1 || static_cast<size_t>(highs.shape(0)) != n) {
          throw py::value_error("highs must hold one bound a generator");
        }
        const int64_t* bound = highs.data();
        for (size_t i = 0; i < n; ++i) {
          if (bound[i] < 1) {
            throw py::value_error("high " + std::to_string(bound[i]) + " must be at least 1");
          }
        }
        py::array_t<int64_t> out(static_cast<py::ssize_t>(n));
        int64_t* into = out.mutable_data();
        {
          py::gil_scoped_release release;
          plan::generator_integers(words, n, reinterpret_cast<const uint64_t*>(bound), into);
        }
        return out;
      },
      py::arg("states").noconvert(), py::arg("highs"),
      "One integer in [0, highs[i]) from each generator of `states` (keyed_generators'), as "
      "numpy's Generator.integers(highs[i]) draws an int64. The states advance.");
  m.def(
      "keyed_shuffle",
      [](const py::array_t<uint32_t, py::array::c_style | py::array::forcecast>& words, int64_t n) {
        if (n < 0) throw py::value_error("n must not be negative");
        py::array_t<int64_t> out(n);
        int64_t* into = out.mutable_data();
        {
          py::gil_scoped_release release;
          plan::keyed_shuffle(words.data(), static_cast<size_t>(words.size()), uint64_t(n), into);
        }
        return out;
      },
      py::arg("words"), py::arg("n"),
      "The permutation of [0, n) that numpy's default_rng(key).permutation(n) makes; the "
      "key's 32-bit words (as SeedSequence splits its integers) are `words`.");
  // The reader's own codes and those the decoders registered (module.cpp registers
  // them first), under the names they registered.
  py::enum_<io::Codec> codec(m, "Codec",
                             "How a member's bytes are stored (the member table's codec).");
  for (const io::CodecEntry* entry : io::registered_codecs()) codec.value(entry->name, entry->code);
  py::enum_<plan::Kind>(m, "FieldKind", "What a fields= decoder reads.")
      .value("RAW", plan::Kind::kRaw)
      .value("INT", plan::Kind::kInt)
      .value("NPY", plan::Kind::kNpy)
      .value("BYTES", plan::Kind::kBytes)
      .value("COLUMN", plan::Kind::kColumn)
      .value("IMAGE", plan::Kind::kImage);
  m.attr("ALIGN") = plan::kAlign;

  py::class_<plan::ShardColumns, std::shared_ptr<plan::ShardColumns>>(
      m, "ShardColumns", "One indexed shard's member columns, as the plan reads them.")
      .def(py::init(&make_shard_columns), py::arg("first_sample"), py::arg("columns"),
           py::arg("sample_first"), py::arg("field_rows"),
           "columns: the member columns (rows within the shard); sample_first: each sample's "
           "first row; field_rows: per field id, each sample's row of it (-1: none), or None. "
           "Each a numpy array, or a rule with `rows`, `base` and `step` (a ComputedColumn).");
  py::class_<PyMembers, std::shared_ptr<PyMembers>>(m, "MemberColumns",
                                                    "The dataset's index as a batch plan reads it.")
      .def(py::init<py::array, py::dict, std::shared_ptr<io::FileTable>, std::vector<uint64_t>,
                    std::vector<std::string>>(),
           py::arg("shard_start"), py::arg("resident"), py::arg("files"),
           py::arg("decoder_row_bytes"), py::arg("decoder_what"),
           "shard_start: where each shard's samples start (shards + 1 entries); resident: "
           "{shard: ShardColumns} of the shards indexed now.");

  py::class_<PyPreparedBatch>(m, "PreparedBatch", "A batch laid out and ready to read.")
      .def_property_readonly("nbytes", &PyPreparedBatch::nbytes)
      .def("submit", &PyPreparedBatch::submit, py::arg("reader"), py::arg("into") = py::none(),
           "Start reading the batch: into a new buffer, or into `into` (a pinned slot).")
      .def("check", &PyPreparedBatch::check, py::arg("buffer"),
           "After the read: every .npy member's header matches the batch's first.")
      .def("layout", &PyPreparedBatch::layout)
      .def("values", &PyPreparedBatch::values, py::arg("field"), py::arg("buffer"),
           py::arg("pending"), py::arg("copy") = false, py::arg("dtype") = py::none(),
           "A Bytes field's values, an array each: views of `buffer` (copies with `copy`), "
           "or, read-only, of the decoded pages the reader left them in.")
      .def("pieces", &PyPreparedBatch::pieces);

  py::class_<PyBatchPlan>(m, "BatchPlan", "The fields= layout of a Loader, made once.")
      .def(py::init(&make_plan), py::arg("fields"),
           "fields: (name, kind, nbytes, what, alternatives, field_ids, column, image) per "
           "field.")
      .def(
          "prepare",
          [](const PyBatchPlan& self, const py::array_t<int64_t, py::array::c_style>& indices,
             std::shared_ptr<PyMembers> members, py::function key_of, uint64_t augment_seed) {
            auto batch = self.plan->prepare(indices.data(), static_cast<size_t>(indices.size()),
                                            members->members(), key_function(key_of), augment_seed);
            return PyPreparedBatch(self.plan, std::move(batch), std::move(members));
          },
          py::arg("indices"), py::arg("members"), py::arg("key_of"), py::arg("augment_seed") = 0,
          "Lay out the batch of samples `indices`: the requests, regions and checks. Images' "
          "random crops are seeded by `augment_seed` and each sample's index.");
}

}  // namespace stoker::bindings
