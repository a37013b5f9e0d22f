#include "stoker/format/sidecar.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "stoker/errors.hpp"
#include "stoker/io/inflate.hpp"
#include "stoker/io/posix_file.hpp"
#include "stoker/util/little_endian.hpp"

namespace stoker::format {

namespace {

// Layout, little-endian: the magic; version; the shard's size and mtime_ns;
// key_runs; format (0 tar, 1 zip); the counts of fields, samples and members;
// field names and keys (each a u32 length and its bytes); sample_start (u32,
// samples + 1); per member field (u16), offset, length, out_length (u64),
// codec (u8) and CRC (u32); last the CRC-32 of everything before it.
constexpr char kMagic[8] = {'S', 'T', 'K', 'I', 'D', 'X', '\0', '\1'};
constexpr uint64_t kVersion = 1;
constexpr uint64_t kMaxSidecar = 1ull << 32;  // far beyond any real shard's

class Writer {
 public:
  void bytes(const void* p, size_t n) {
    auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  }
  template <typename T>
  void le(T value) {
    for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
  }
  void text(const std::string& s) {
    le<uint32_t>(static_cast<uint32_t>(s.size()));
    bytes(s.data(), s.size());
  }
  template <typename T>
  void column(const std::vector<T>& values) {
    for (T v : values) le<T>(v);
  }
  std::vector<uint8_t> out;
};

// Reads the sidecar's fields; any read past its end makes it corrupt.
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  bool ok() const { return ok_; }
  const uint8_t* take(size_t n) {
    if (!ok_ || n > n_ - at_) {
      ok_ = false;
      return nullptr;
    }
    const uint8_t* here = p_ + at_;
    at_ += n;
    return here;
  }
  uint64_t u64() {
    const uint8_t* b = take(8);
    return b ? util::le64(b) : 0;
  }
  uint32_t u32() {
    const uint8_t* b = take(4);
    return b ? util::le32(b) : 0;
  }
  uint16_t u16() {
    const uint8_t* b = take(2);
    return b ? util::le16(b) : 0;
  }
  uint8_t u8() {
    const uint8_t* b = take(1);
    return b ? *b : 0;
  }
  std::string text() {
    uint32_t n = u32();
    const uint8_t* b = take(n);
    return b ? std::string(reinterpret_cast<const char*>(b), n) : std::string();
  }
  bool at_end() const { return ok_ && at_ == n_; }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t at_ = 0;
  bool ok_ = true;
};

std::vector<uint8_t> encode(const ShardIndex& index) {
  Writer w;
  w.bytes(kMagic, sizeof kMagic);
  w.le<uint64_t>(kVersion);
  w.le<uint64_t>(index.identity.size);
  w.le<int64_t>(index.identity.mtime_ns);
  w.le<uint64_t>(index.key_runs);
  w.le<uint32_t>(index.format == "zip" ? 1 : 0);
  w.le<uint32_t>(static_cast<uint32_t>(index.field_names.size()));
  w.le<uint64_t>(index.keys.size());
  w.le<uint64_t>(index.member_offset.size());
  for (const std::string& name : index.field_names) w.text(name);
  for (const std::string& key : index.keys) w.text(key);
  w.column(index.sample_start);
  w.column(index.member_field);
  w.column(index.member_offset);
  w.column(index.member_length);
  w.column(index.member_out_length);
  w.column(index.member_codec);
  w.column(index.member_crc);
  w.le<uint32_t>(io::crc32_of(w.out.data(), w.out.size()));
  return w.out;
}

// Whether `index` could have come from indexing a shard of `size` bytes: the
// rules the parsers enforce (SampleBuilder, the tar and zip walks), checked
// again, so that a sidecar with a good CRC still cannot say what no shard could.
bool plausible(const ShardIndex& index, uint64_t size) {
  size_t samples = index.keys.size(), fields = index.field_names.size();
  if (index.key_runs < samples) return false;
  std::vector<uint64_t> last_sample(fields, UINT64_MAX);
  for (uint64_t s = 0; s < samples; ++s) {
    if (index.sample_start[s] >= index.sample_start[s + 1]) return false;  // no empty sample
    for (uint64_t m = index.sample_start[s]; m < index.sample_start[s + 1]; ++m) {
      uint16_t field = index.member_field[m];
      if (field >= fields || last_sample[field] == s) return false;  // a field twice
      last_sample[field] = s;
      uint64_t offset = index.member_offset[m], length = index.member_length[m];
      uint64_t out = index.member_out_length[m];
      if (offset > size || length > size - offset) return false;
      auto codec = static_cast<io::Codec>(index.member_codec[m]);
      if (codec == io::Codec::kStored) {
        if (out != length) return false;
      } else if (codec == io::Codec::kDeflate) {
        // tar members are stored; deflate cannot expand more than about 1032:1
        if (index.format != "zip" || out / 1032 > length + 1) return false;
      } else {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

bool decode_sidecar(const std::vector<uint8_t>& bytes, ShardIndex& index, uint64_t& size,
                    int64_t& mtime_ns) {
  if (bytes.size() < sizeof kMagic + 4 || std::memcmp(bytes.data(), kMagic, sizeof kMagic)) {
    return false;
  }
  size_t body = bytes.size() - 4;
  if (io::crc32_of(bytes.data(), body) != util::le32(bytes.data() + body)) return false;
  Reader r(bytes.data(), body);
  r.take(sizeof kMagic);
  if (r.u64() != kVersion) return false;
  size = r.u64();
  mtime_ns = static_cast<int64_t>(r.u64());
  index.key_runs = r.u64();
  uint32_t format = r.u32();
  uint64_t fields = r.u32(), samples = r.u64(), members = r.u64();
  // Each member takes 31 bytes and each sample at least 8: counts beyond the
  // sidecar's own size are lies, refused before anything is allocated for them.
  if (!r.ok() || format > 1 || members > body / 31 || samples > body / 8 || fields > body / 4) {
    return false;
  }
  index.format = format == 1 ? "zip" : "tar";
  for (uint64_t i = 0; i < fields; ++i) index.field_names.push_back(r.text());
  for (uint64_t i = 0; i < samples; ++i) index.keys.push_back(r.text());
  index.sample_start.assign(samples + 1, 0);
  for (auto& v : index.sample_start) v = r.u32();
  index.member_field.resize(members);
  for (auto& v : index.member_field) v = r.u16();
  for (auto* column : {&index.member_offset, &index.member_length, &index.member_out_length}) {
    column->resize(members);
    for (auto& v : *column) v = r.u64();
  }
  index.member_codec.resize(members);
  for (auto& v : index.member_codec) v = r.u8();
  index.member_crc.resize(members);
  for (auto& v : index.member_crc) v = r.u32();
  if (!r.at_end() || index.sample_start.front() != 0 || index.sample_start.back() != members) {
    return false;
  }
  return plausible(index, size);
}

bool read_sidecar(const std::string& path, const io::FileIdentity& shard, ShardIndex& index,
                  SidecarState& state) {
  std::string sidecar = path + kSidecarSuffix;
  state = SidecarState::kNone;
  int fd = ::open(sidecar.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  io::FileDescriptor owned(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return false;
  state = SidecarState::kCorrupt;
  if (static_cast<uint64_t>(st.st_size) > kMaxSidecar) return false;
  std::vector<uint8_t> bytes(static_cast<size_t>(st.st_size));
  try {
    io::pread_exact(fd, sidecar, bytes.data(), bytes.size(), 0);
  } catch (const Error&) {
    return false;
  }
  ShardIndex found;
  uint64_t size;
  int64_t mtime_ns;
  if (!decode_sidecar(bytes, found, size, mtime_ns)) return false;
  if (size != shard.size || mtime_ns != shard.mtime_ns) {
    state = SidecarState::kStale;
    return false;
  }
  found.file_size = shard.size;
  found.identity = shard;
  found.sidecar = static_cast<uint8_t>(SidecarState::kUsed);
  index = std::move(found);
  state = SidecarState::kUsed;
  return true;
}

void write_sidecar(const std::string& path, const ShardIndex& index) {
  if (index.format != "tar" && index.format != "zip") {
    throw Error(path, 0, "only tar and zip shards have member index sidecars");
  }
  std::vector<uint8_t> bytes = encode(index);
  std::string target = path + kSidecarSuffix;
  // A name no other writer (thread or process) of the same sidecar uses.
  static std::atomic<uint64_t> serial{0};
  std::string temp =
      target + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(serial.fetch_add(1));
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  auto fail = [&](int err, const char* what) {
    if (fd >= 0) ::close(fd);
    ::unlink(temp.c_str());
    throw ReadError(target, 0, err, std::string(what) + ": " + std::strerror(err));
  };
  if (fd < 0) fail(errno, "cannot write the member index");
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(n < 0 ? errno : EIO, "cannot write the member index");
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) fail(errno, "cannot sync the member index");
  if (::close(fd) != 0) {
    fd = -1;
    fail(errno, "cannot write the member index");
  }
  fd = -1;
  if (::rename(temp.c_str(), target.c_str()) != 0) fail(errno, "cannot rename the member index");
}

}  // namespace stoker::format
