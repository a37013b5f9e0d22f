#include "stoker/plan/batch_plan.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "stoker/errors.hpp"
#include "stoker/format/window_reader.hpp"
#include "stoker/io/column_rows.hpp"
#include "stoker/text/ascii_int.hpp"

namespace stoker::plan {

namespace {

using io::Codec;
using io::ReadRequest;

// Consecutive regions of one buffer, each starting on an aligned offset.
class Regions {
 public:
  uint64_t take(uint64_t size) {
    uint64_t base = end_;
    end_ += (size + kAlign - 1) / kAlign * kAlign;
    return base;
  }
  uint64_t end() const { return end_; }

 private:
  uint64_t end_ = 0;
};

std::string name_of(const FieldSpec& f) { return "field " + quoted(f.name); }

// A message's "sample 'k1'".
std::string sample_of(const KeyOf& key_of, int64_t sample) {
  return "sample " + quoted(key_of(sample));
}

[[noreturn]] void bad_member(const Members& m, const MemberRef& r, const std::string& what) {
  throw FormatError(m.files->paths[r.shard->file[r.row]], r.shard->offset[r.row], what);
}

std::string shape_text(const std::vector<uint64_t>& shape) {
  std::string out = "(";
  for (size_t d = 0; d < shape.size(); ++d) {
    out += std::to_string(shape[d]);
    if (shape.size() == 1 || d + 1 < shape.size()) out += shape.size() == 1 ? "," : ", ";
  }
  return out + ")";
}

MemberRef ref(const ShardColumns* shard, uint32_t id, int64_t row) {
  return MemberRef{shard, static_cast<uint64_t>(row),
                   static_cast<int64_t>((uint64_t(id) << 32) | uint64_t(row))};
}

// Each sample's member of field `f`: the first of its alternatives the sample has.
void find_rows(const FieldSpec& f, const int64_t* indices, size_t n, const Members& m,
               const KeyOf& key_of, std::vector<MemberRef>& rows) {
  rows.resize(n);
  const ShardColumns* shard = nullptr;  // consecutive samples mostly share a shard
  uint32_t id = 0;
  for (size_t i = 0; i < n; ++i) {
    int64_t sample = indices[i];
    if (shard == nullptr || sample < shard->first_sample ||
        sample >= shard->first_sample + static_cast<int64_t>(shard->samples)) {
      shard = m.shard_of(sample, id);
      if (shard == nullptr) {
        throw Error("internal: sample " + std::to_string(sample) +
                    " is read before its shard is indexed");
      }
    }
    int64_t local = sample - shard->first_sample;
    int64_t row = -1;
    for (int32_t field : f.field_ids) {
      if (field >= 0 && static_cast<size_t>(field) < shard->field_rows.size() &&
          shard->field_rows[field].present()) {
        row = shard->field_rows[field][local];
        if (row >= 0) break;
      }
    }
    if (row < 0 || static_cast<uint64_t>(row) >= shard->rows) {
      std::string which = name_of(f);
      if (f.alternatives.size() > 1) {
        which = "field of ";
        for (size_t a = 0; a < f.alternatives.size(); ++a) {
          which += (a ? ", " : "") + quoted(f.alternatives[a]);
        }
      }
      int64_t first = shard->sample_first[local];
      std::string what =
          sample_of(key_of, sample) + " (#" + std::to_string(sample) + ") has no " + which;
      if (first < 0) throw FormatError(what);
      bad_member(m, ref(shard, id, first), what);
    }
    rows[i] = ref(shard, id, row);
  }
}

ReadRequest request_for(const MemberRef& m, uint64_t dest) {
  const ShardColumns& s = *m.shard;
  uint64_t row = m.row;
  ReadRequest r;
  r.file = s.file[row];
  r.offset = s.offset[row];
  r.length = s.length[row];
  r.dest_offset = dest;
  r.out_length = s.out[row];
  r.codec = static_cast<Codec>(s.codec[row]);
  r.crc32 = s.crc[row];
  r.array = s.array[row];
  // Stored bytes are served as they are on disk; inflating touches every byte anyway.
  r.check_crc =
      r.codec != Codec::kStored && r.codec != Codec::kArrayRow && r.codec != Codec::kColumnValue;
  return r;
}

uint64_t out_of(const MemberRef& r) { return r.shard->out[r.row]; }

// A table value whose size is not known yet, or which is known to be null (the index's
// length is then UNSIZED - 1, members.py's NULL_VALUE): its read finds out, and a null
// asked for is an error there.
bool unsized(const MemberRef& r) {
  const ShardColumns& s = *r.shard;
  return static_cast<Codec>(s.codec[r.row]) == Codec::kColumnValue &&
         (s.out[r.row] == io::kUnsizedValue || s.length[r.row] == io::kUnsizedValue - 1);
}

void add(PreparedBatch& batch, const ReadRequest& r, const MemberRef& member) {
  batch.requests.push_back(r);
  batch.request_rows.push_back(member.id);
}

// A fixed number of bytes per sample (kRaw, or rows of .npy shards).
void plan_fixed(const FieldSpec& f, uint64_t nbytes, const std::string& what,
                const std::vector<MemberRef>& rows, const Members& m, const KeyOf& key_of,
                Regions& regions, FieldLayout& out, PreparedBatch& batch) {
  size_t n = rows.size();
  for (size_t i = 0; i < n; ++i) {
    if (out_of(rows[i]) != nbytes) {
      bad_member(m, rows[i],
                 name_of(f) + " of " + sample_of(key_of, batch.indices[i]) + " is " +
                     std::to_string(out_of(rows[i])) + " bytes, not the " + std::to_string(nbytes) +
                     " of " + what);
    }
  }
  out.offset = regions.take(n * nbytes);
  for (size_t i = 0; i < n; ++i) {
    add(batch, request_for(rows[i], out.offset + i * nbytes), rows[i]);
  }
}

void plan_int(const FieldSpec& f, const std::vector<MemberRef>& rows, const Members& m,
              Regions& regions, FieldLayout& out, PreparedBatch& batch) {
  size_t n = rows.size();
  out.offset = regions.take(n * sizeof(int64_t));
  for (size_t i = 0; i < n; ++i) {
    const MemberRef& row = rows[i];
    ReadRequest r = request_for(row, out.offset + i * sizeof(int64_t));
    if (r.codec == Codec::kColumnValue) {
      // A table's integers are widened as they are; its text is parsed as a member's is.
      const io::ColumnLayout& c = *m.files->columns[r.array];
      r.decoder = c.integer == io::ColumnInteger::kNone
                      ? io::find_codec(text::kAsciiInt)->decoder
                      : io::integer_decoder(c.width, c.integer == io::ColumnInteger::kSigned);
    } else if (r.codec == Codec::kStored) {
      r.codec = text::kAsciiInt;  // parsed straight from the bytes on disk
    } else {
      if (r.out_length > text::kMaxIntText) {
        bad_member(
            m, row,
            name_of(f) + " is " + std::to_string(r.out_length) + " bytes: too long for an integer");
      }
      r.codec = text::kDeflateAsciiInt;  // inflated, then parsed
      r.inflated_length = r.out_length;
    }
    r.out_length = sizeof(int64_t);
    add(batch, r, row);
  }
}

void plan_bytes(const std::vector<MemberRef>& rows, Regions& regions, FieldLayout& out,
                PreparedBatch& batch) {
  size_t n = rows.size();
  out.starts.resize(n);
  out.lengths.resize(n);
  uint64_t size = 0;
  for (size_t i = 0; i < n; ++i) {
    out.starts[i] = size;
    // A table value not sized yet gets no room: its read hands it out where it lies.
    const uint64_t length = unsized(rows[i]) ? 0 : out_of(rows[i]);
    out.lengths[i] = length;
    size += (length + kAlign - 1) / kAlign * kAlign;
  }
  out.offset = regions.take(size);
  out.first_request = batch.requests.size();
  for (size_t i = 0; i < n; ++i) {
    out.starts[i] += out.offset;
    ReadRequest r = request_for(rows[i], out.starts[i]);
    r.borrow = true;  // handed out one array a value: it need not lie in the buffer
    if (unsized(rows[i])) r.out_length = io::kUnsizedValue;
    add(batch, r, rows[i]);
  }
}

// Images: each member is decoded by the reader into a fixed-size slot.
void plan_image(const FieldSpec& f, const std::vector<MemberRef>& rows, uint64_t augment_seed,
                Regions& regions, FieldLayout& out, PreparedBatch& batch) {
  size_t n = rows.size();
  uint64_t nbytes = f.decoder->output_bytes();
  out.offset = regions.take(n * nbytes);
  for (size_t i = 0; i < n; ++i) {
    ReadRequest r = request_for(rows[i], out.offset + i * nbytes);
    if (r.codec == Codec::kColumnValue) {
      // (the value, decoded from its column's pages, is handed to the image decoder)
    } else if (r.codec == Codec::kStored) {
      r.codec = image::kImage;
    } else {
      r.codec = image::kDeflateImage;
      r.inflated_length = r.out_length;
    }
    r.out_length = nbytes;
    r.decoder = f.decoder;
    r.seed = image::sample_seed(augment_seed, static_cast<uint64_t>(batch.indices[i]));
    add(batch, r, rows[i]);
  }
}

// .npy files stored as members: each member is read as its header (into a
// side region, checked against the first's after the read) and its data (laid
// out as one array).
void plan_npy_members(const FieldSpec& f, const std::vector<MemberRef>& rows, const Members& m,
                      const KeyOf& key_of, Regions& regions, FieldLayout& out,
                      PreparedBatch& batch) {
  size_t n = rows.size();
  for (const MemberRef& row : rows) {
    if (row.shard->codec[row.row] != static_cast<uint8_t>(Codec::kStored)) {
      bad_member(m, row,
                 name_of(f) +
                     ": compressed .npy members cannot be viewed in place; store them "
                     "uncompressed, or read them with stoker.Bytes()");
    }
  }
  // The first member's header says the batch's dtype and shape: one small read.
  const MemberRef& first = rows[0];
  const std::string& path = m.files->paths[first.shard->file[first.row]];
  uint64_t first_offset = first.shard->offset[first.row];
  try {
    format::WindowReader in(path, 4096);
    out.npy = format::read_npy_header(in, first_offset, out_of(first));
    const uint8_t* bytes = in.at(first_offset, out.npy.data_offset, ".npy header");
    out.header.assign(bytes, bytes + out.npy.data_offset);
  } catch (const FormatError& e) {
    bad_member(m, first, name_of(f) + " is not a .npy file: " + e.detail());
  }
  int long_axes = 0;
  for (uint64_t d : out.npy.shape) long_axes += d > 1;
  if (out.npy.fortran_order && long_axes > 1) {
    bad_member(m, first,
               name_of(f) +
                   ": a Fortran-ordered .npy cannot be viewed in place; save "
                   "numpy.ascontiguousarray(a)");
  }
  uint64_t header = out.npy.data_offset, nbytes = out.npy.data_bytes;
  for (size_t i = 0; i < n; ++i) {
    if (out_of(rows[i]) != header + nbytes) {
      bad_member(m, rows[i],
                 name_of(f) + " of " + sample_of(key_of, batch.indices[i]) + " does not hold a " +
                     shape_text(out.npy.shape) + " " + quoted(out.npy.descr) +
                     " array like the batch's first sample");
    }
  }
  out.members = true;
  out.rows = rows;
  out.header_offset = regions.take(n * header);
  out.offset = regions.take(n * nbytes);
  for (size_t i = 0; i < n; ++i) {
    ReadRequest r = request_for(rows[i], out.header_offset + i * header);
    r.length = r.out_length = header;
    add(batch, r, rows[i]);
    r.offset += header;
    r.dest_offset = out.offset + i * nbytes;
    r.length = r.out_length = nbytes;
    add(batch, r, rows[i]);
  }
}

}  // namespace

BatchPlan::BatchPlan(std::vector<FieldSpec> fields) : fields_(std::move(fields)) {
  for (FieldSpec& f : fields_) {
    if (f.kind == Kind::kColumn ? f.column == nullptr : f.field_ids.empty()) {
      throw Error("field '" + f.name + "' has nothing to read");
    }
    if (f.kind == Kind::kImage && !f.image) {
      throw Error("field '" + f.name + "' is an image field with no target");
    }
    if (f.kind == Kind::kImage) f.decoder = image::field_decoder(f.image);
  }
}

const ShardColumns* Members::shard_of(int64_t sample, uint32_t& shard) const {
  const std::vector<int64_t>& starts = *shard_start;
  auto after = std::upper_bound(starts.begin(), starts.end(), sample);
  if (after == starts.begin() || after == starts.end()) return nullptr;
  shard = static_cast<uint32_t>(after - starts.begin() - 1);
  auto found = resident.find(shard);
  return found == resident.end() ? nullptr : found->second.get();
}

PreparedBatch BatchPlan::prepare(const int64_t* indices, size_t n, const Members& m,
                                 const KeyOf& key_of, uint64_t augment_seed) const {
  PreparedBatch batch;
  batch.indices.assign(indices, indices + n);
  for (const FieldSpec& f : fields_) {
    if (f.kind == Kind::kColumn && f.length < m.samples) {
      throw Error("field '" + f.name + "' has " + std::to_string(f.length) +
                  " entries for a dataset of " + std::to_string(m.samples) + " samples");
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (indices[i] < 0 || static_cast<uint64_t>(indices[i]) >= m.samples) {
      throw Error("sample " + std::to_string(indices[i]) + " is not in the dataset");
    }
  }
  batch.fields.resize(fields_.size());
  Regions regions;
  std::vector<MemberRef> rows;
  for (size_t k = 0; k < fields_.size(); ++k) {
    const FieldSpec& f = fields_[k];
    FieldLayout& out = batch.fields[k];
    if (f.kind == Kind::kColumn) {
      out.offset = regions.take(n * sizeof(int64_t));
      continue;
    }
    if (n == 0) continue;
    find_rows(f, indices, n, m, key_of, rows);
    switch (f.kind) {
      case Kind::kRaw:
        plan_fixed(f, f.nbytes, f.what, rows, m, key_of, regions, out, batch);
        break;
      case Kind::kInt:
        plan_int(f, rows, m, regions, out, batch);
        break;
      case Kind::kBytes:
        plan_bytes(rows, regions, out, batch);
        break;
      case Kind::kImage:
        plan_image(f, rows, augment_seed, regions, out, batch);
        break;
      case Kind::kNpy: {
        bool all_members = true;
        for (const MemberRef& row : rows) {
          all_members = all_members && row.shard->decoder[row.row] == 0;
        }
        if (all_members) {
          plan_npy_members(f, rows, m, key_of, regions, out, batch);
          break;
        }
        // Rows of .npy shards: one decoder (dtype and shape) for the batch.
        out.decoder = rows[0].shard->decoder[rows[0].row];
        for (const MemberRef& row : rows) {
          if (row.shard->decoder[row.row] != out.decoder || out.decoder == 0 ||
              static_cast<size_t>(out.decoder) >= m.decoder_row_bytes.size()) {
            bad_member(m, row,
                       name_of(f) +
                           ": stoker.Row() (or Npy()) reads rows of array sources and .npy "
                           "shards, or .npy members, and every sample of a batch must share "
                           "one dtype and shape");
          }
        }
        plan_fixed(f, m.decoder_row_bytes[out.decoder], m.decoder_what[out.decoder], rows, m,
                   key_of, regions, out, batch);
        break;
      }
      case Kind::kColumn:
        break;
    }
  }
  batch.nbytes = regions.end();
  return batch;
}

void BatchPlan::write_columns(const PreparedBatch& batch, uint8_t* buffer) const {
  for (size_t k = 0; k < fields_.size(); ++k) {
    if (fields_[k].kind != Kind::kColumn) continue;
    auto* column = reinterpret_cast<int64_t*>(buffer + batch.fields[k].offset);
    for (size_t i = 0; i < batch.indices.size(); ++i) {
      column[i] = fields_[k].column[batch.indices[i]];
    }
  }
}

void BatchPlan::check(const PreparedBatch& batch, const uint8_t* buffer, const Members& m) const {
  for (size_t k = 0; k < fields_.size(); ++k) {
    const FieldLayout& f = batch.fields[k];
    if (!f.members) continue;
    uint64_t size = f.header.size();
    for (size_t i = 0; i < f.rows.size(); ++i) {
      if (std::memcmp(buffer + f.header_offset + i * size, f.header.data(), size) != 0) {
        bad_member(m, f.rows[i],
                   name_of(fields_[k]) +
                       ": this .npy's dtype or shape differs from the batch's first sample's");
      }
    }
  }
}

}  // namespace stoker::plan
