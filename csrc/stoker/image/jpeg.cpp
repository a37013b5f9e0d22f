// JPEG through libjpeg-turbo's libjpeg API. libjpeg reports errors by calling
// error_exit, which must not return: it longjmps back here. The functions that
// setjmp hold only C objects across the libjpeg calls, so nothing with a
// destructor is skipped by the jump.
#ifdef STOKER_HAVE_IMAGE

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>
// clang-format off
#include <jpeglib.h>
#include <jerror.h>
// clang-format on

#include "stoker/image/codec.hpp"
#include "stoker/io/byte_vector.hpp"
#include "stoker/util/fnv1a.hpp"

namespace stoker::image::detail {

namespace {

struct ErrorManager {
  jpeg_error_mgr base;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  bool truncated;
};

[[noreturn]] void on_error(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  if (cinfo->err->msg_code == JERR_NO_BACKING_STORE) {  // past max_memory_to_use
    std::snprintf(err->message, sizeof err->message,
                  "decoding it would take more than the %ld MiB an image may use (a progressive "
                  "JPEG keeps every coefficient of the image in memory)",
                  kMaxDecoderMemory >> 20);
  } else {
    (*cinfo->err->format_message)(cinfo, err->message);
  }
  std::longjmp(err->jump, 1);
}

// Warnings are not printed. Running out of data is an error for us (libjpeg
// would pad the image with grey); corrupt entropy data that libjpeg can step
// over is tolerated, as the usual decoders tolerate it.
void on_message(j_common_ptr cinfo, int level) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) err->truncated = true;
}

void install(jpeg_error_mgr& base) {
  jpeg_std_error(&base);
  base.error_exit = on_error;
  base.emit_message = on_message;
}

// Inverted CMYK (Adobe's, which is what libjpeg hands back for Adobe files) or
// plain CMYK, to RGB: each channel is scaled by the black's complement.
void cmyk_to_rgb(const uint8_t* in, uint8_t* out, uint32_t count, bool inverted) {
  for (uint32_t i = 0; i < count; ++i, in += 4, out += 3) {
    uint32_t c = in[0], m = in[1], y = in[2], k = in[3];
    if (!inverted) {
      c = 255 - c;
      m = 255 - m;
      y = 255 - y;
      k = 255 - k;
    }
    out[0] = static_cast<uint8_t>((c * k + 127) / 255);
    out[1] = static_cast<uint8_t>((m * k + 127) / 255);
    out[2] = static_cast<uint8_t>((y * k + 127) / 255);
  }
}

// libjpeg-turbo's SIMD colour conversion writes a row that starts on a 16-byte boundary
// (32 on its AVX2 path) with non-temporal stores, which go around the cache to memory. A
// tile's or window's rows are read back at once (copied into the batch), from memory
// then: a decode took up to twice as long (libjpeg-turbo 2.1.5, half of a 256² 4:2:0
// tile: 283 µs where its row starts were aligned, 127 µs where they were not). Such rows
// are decoded into spare rows that start off such boundaries (skewed_start), and copied
// out of the cache; a row of 768 bytes costs about 20 ns to copy.
// Spare rows a thread keeps after a wider image needed more.
constexpr size_t kSpareRowsKeep = size_t(1) << 20;

bool stored_around_the_cache(const uint8_t* row) {
  return reinterpret_cast<uintptr_t>(row) % 16 == 0;
}

// Decodes the next `count` rows into `first`, `first + stride`, ...; returns how many it
// decoded (fewer where libjpeg stopped). Asking for up to an iMCU row's worth a call,
// rather than a row a call, lets libjpeg upsample chroma straight into the rows instead
// of through its spare row, and spares a call per row: about 13% of a 256² tile's decode.
JDIMENSION read_rows(jpeg_decompress_struct& cinfo, uint8_t* first, size_t stride,
                     JDIMENSION count) {
  constexpr JDIMENSION kRowsPerCall = 16;
  // Thread storage, not the frame's: a libjpeg error jumps over this function.
  thread_local io::ByteVector spare;
  const size_t width = size_t(cinfo.output_width) * size_t(cinfo.output_components);
  const size_t spare_stride = (width + 63) / 64 * 64;
  uint8_t* spare_rows = nullptr;  // made when a row first needs one
  bool no_spare = false;          // (no memory for them: slower, not wrong)
  JSAMPROW rows[kRowsPerCall];
  JDIMENSION done = 0;
  while (done < count) {
    const JDIMENSION ask = std::min(kRowsPerCall, count - done);
    uint32_t through_spare = 0;  // a bit a row
    for (JDIMENSION i = 0; i < ask; ++i) {
      rows[i] = first + size_t(done + i) * stride;
      if (no_spare || !stored_around_the_cache(rows[i])) continue;
      if (spare_rows == nullptr) {
        try {
          spare.resize(kRowsPerCall * spare_stride + kSkewedRoom);
          spare_rows = skewed_start(spare.data());
        } catch (const std::bad_alloc&) {
          no_spare = true;
          continue;
        }
      }
      rows[i] = spare_rows + i * spare_stride;
      through_spare |= 1u << i;
    }
    const JDIMENSION got = jpeg_read_scanlines(&cinfo, rows, ask);
    for (JDIMENSION i = 0; i < got; ++i) {
      if (through_spare & (1u << i)) {
        std::memcpy(first + size_t(done + i) * stride, rows[i], width);
      }
    }
    if (got == 0) break;
    done += got;
  }
  io::give_back_if_larger(spare, kSpareRowsKeep);
  return done;
}

// The head of libjpeg-turbo's Huffman decoder (huff_entropy_decoder in its jdhuff.c),
// which its API keeps private: the public part (jpegint.h's jpeg_entropy_decoder, as of
// the version built against), then the state an MCU's decode starts from and saves back
// when it ends (the bit buffer and each component's last DC coefficient).
// entropy_marks_work() checks that the libjpeg loaded lays it out so.
struct HuffmanDecoderHead {
  void (*start_pass)(j_decompress_ptr);
  boolean (*decode_mcu)(j_decompress_ptr, JBLOCKROW*);
#if defined(LIBJPEG_TURBO_VERSION_NUMBER) && LIBJPEG_TURBO_VERSION_NUMBER >= 3000000
  void* decode_mcus;  // (3.0 added these two: lossless JPEG's decoder, and restarts')
  void* process_restart;
#endif
  boolean insufficient_data;
  struct {
    size_t get_buffer;
    int bits_left;
  } bitstate;
  struct {
    int last_dc_val[MAX_COMPS_IN_SCAN];
  } saved;
};

HuffmanDecoderHead& huffman(j_decompress_ptr cinfo) {
  return *reinterpret_cast<HuffmanDecoderHead*>(cinfo->entropy);
}

// stoker's own Huffman decoder for MCUs whose coefficients nobody uses ("skimming"): it
// finds where each block ends and keeps the DC predictions, and stores nothing.
// libjpeg-turbo decodes a symbol at a time, and each symbol's decode waits on the one
// before it (to know where it starts): that chain is the cost. Here one look-up of the
// next kSkimBits bits steps over every whole symbol they hold, so a block takes fewer
// steps down the chain. Over a slide's epochs, alternating the two decoders catch-up by
// catch-up in one process: about 175 ns an MCU against libjpeg-turbo 2.1.5's 240 ns. A
// 12-bit window (16 KiB a table) was slower there than 10 bits (4 KiB), though faster
// alone: between skims, the rest of the decode pushes the tables out of the cache. It
// never reads a marker: where one comes before the MCU's bits (the tile's end, corrupt
// data), or a code is invalid, it stops at that MCU's start, and libjpeg's decoder goes
// on from there, as it would have.
constexpr int kSkimBits = 10;

// One Huffman table, as the skim decoder reads it. fast[] is indexed by the next
// kSkimBits bits of the stream. For an AC table, bits 0-5: how many bits the whole
// symbols there take (codes and magnitude bits, within the kSkimBits), 6-12: how far
// they move along the block, not counting an end of block, 13: whether they end with one;
// bits 16-21: the first symbol's bits alone (0: its code is longer than kSkimBits),
// 22-28: how far it alone moves (64: an end of block). For a DC table, bits 0-5: the
// code's length (0: longer), 6-10: the magnitude's.
struct SkimTable {
  uint32_t fast[1 << kSkimBits];
  int32_t maxcode[18];    // by code length, the largest code of that length (-1: none)
  int32_t valoffset[18];  // by code length, code + valoffset = index into symbols
  uint8_t symbols[256];
};

// The canonical codes of `table` (the JPEG standard's Annex C), their lengths and symbols
// into `t`; false where the table is malformed.
bool canonical_codes(const JHUFF_TBL& table, SkimTable& t, uint8_t* length, uint16_t* code_of,
                     int& count) {
  uint32_t code = 0;
  int k = 0;
  for (int l = 1; l <= 16; ++l) {
    t.valoffset[l] = k - int(code);
    for (int i = 0; i < table.bits[l]; ++i, ++k, ++code) {
      if (k >= 256 || code >= (1u << l)) return false;
      t.symbols[k] = table.huffval[k];
      length[k] = uint8_t(l);
      code_of[k] = uint16_t(code);
    }
    t.maxcode[l] = table.bits[l] ? int32_t(code) - 1 : -1;
    code <<= 1;
  }
  t.maxcode[17] = INT32_MAX;
  count = k;
  return true;
}

// How far an AC symbol moves along its block: past its zero run and itself, past 16
// zeros for ZRL, or to the block's end.
int ac_advance(int symbol) {
  const int size = symbol & 15, run = symbol >> 4;
  return size ? run + 1 : (run == 15 ? 16 : 64);
}

bool build_skim_table(const JHUFF_TBL& table, bool dc, SkimTable& t) {
  uint8_t length[256];
  uint16_t code_of[256];
  int count = 0;
  if (!canonical_codes(table, t, length, code_of, count)) return false;
  // The symbol whose code starts each window (-1: a longer code, or none).
  std::array<int16_t, size_t(1) << kSkimBits> first;
  first.fill(-1);
  for (int k = 0; k < count; ++k) {
    if (dc && t.symbols[k] > 15) return false;
    if (length[k] > kSkimBits) continue;
    const uint32_t lo = uint32_t(code_of[k]) << (kSkimBits - length[k]);
    const uint32_t hi = uint32_t(code_of[k] + 1) << (kSkimBits - length[k]);
    std::fill(first.begin() + lo, first.begin() + hi, int16_t(k));
  }
  constexpr uint32_t kWindow = (1u << kSkimBits) - 1;
  for (uint32_t w = 0; w <= kWindow; ++w) {
    const int k = first[w];
    if (k < 0) {
      t.fast[w] = 0;
      continue;
    }
    const int symbol = t.symbols[k];
    if (dc) {
      t.fast[w] = uint32_t(length[k]) | uint32_t(symbol) << 6;
      continue;
    }
    // Whole symbols from the window's start, as long as code and magnitude fit in it.
    uint32_t used = 0, advance = 0, ends = 0;
    while (used < uint32_t(kSkimBits)) {
      const int next = first[(w << used) & kWindow];
      if (next < 0 || length[next] > kSkimBits - int(used)) break;  // (its code runs past)
      const int s = t.symbols[next];
      const uint32_t bits = length[next] + (s & 15);
      if (used + bits > uint32_t(kSkimBits)) break;
      used += bits;
      if (ac_advance(s) == 64) {
        ends = 1;
        break;
      }
      advance += uint32_t(ac_advance(s));
      if (advance >= 64) break;
    }
    t.fast[w] = used | advance << 6 | ends << 13 | uint32_t(length[k] + (symbol & 15)) << 16 |
                uint32_t(ac_advance(symbol)) << 22;
  }
  return true;
}

// The entropy data from a position on, its next `left` bits at the top of `buf` (below
// them: zeros, or the bits that follow).
struct SkimBits {
  const uint8_t* at;
  const uint8_t* end;
  uint64_t buf;
  int left;

  // At least 32 bits in buf (more than a symbol and its magnitude take), else false: a
  // marker or the data's end comes first.
  bool fill() {
    if (left >= 32) return true;
    if (end - at >= 8) {  // eight bytes at once where none is 0xFF (no stuffing, no marker)
      uint64_t word;
      std::memcpy(&word, at, 8);
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
      word = __builtin_bswap64(word);  // (the stream's first byte on top)
#endif
      const uint64_t inverted = ~word;  // (a byte of word is 0xFF where this one is 0)
      if (((inverted - 0x0101010101010101ull) & ~inverted & 0x8080808080808080ull) == 0) {
        buf |= word >> left;
        const int bytes = (63 - left) >> 3;
        at += bytes;
        left += 8 * bytes;
        return true;
      }
    }
    while (left <= 56 && at < end) {
      const uint8_t c = *at;
      if (c == 0xFF) {
        if (end - at < 2 || at[1] != 0) break;  // a marker
        at += 2;                                // a stuffed 0xFF
      } else {
        ++at;
      }
      buf |= uint64_t(c) << (56 - left);
      left += 8;
    }
    return left >= 32;
  }
  uint32_t peek(int bits) const { return uint32_t(buf >> (64 - bits)); }
  // The next `left` bits in the low bits, as libjpeg keeps them.
  uint64_t low_bits() const { return left == 0 ? 0 : buf >> (64 - left); }
  void drop(int bits) {
    buf <<= bits;
    left -= bits;
  }
};

// A symbol whose code is longer than kSkimBits; -1 where no code matches.
int long_symbol(const SkimTable& t, const SkimBits& b, int& length) {
  for (int l = kSkimBits + 1; l <= 16; ++l) {
    const int32_t code = int32_t(b.peek(l));
    if (code <= t.maxcode[l]) {
      length = l;
      return t.symbols[code + t.valoffset[l]];
    }
  }
  return -1;
}

// The tables of a scan's blocks, an MCU's worth.
struct SkimScan {
  const SkimTable* dc[D_MAX_BLOCKS_IN_MCU];
  const SkimTable* ac[D_MAX_BLOCKS_IN_MCU];
  int component[D_MAX_BLOCKS_IN_MCU];
  int blocks = 0;
};

// Steps `b` over one MCU and adds its DC differences to `dc`; false where it cannot (b
// and dc are then anywhere in it).
bool skim_mcu(const SkimScan& scan, SkimBits& b, int* dc) {
  for (int block = 0; block < scan.blocks; ++block) {
    if (!b.fill()) return false;
    const SkimTable& d = *scan.dc[block];
    const uint32_t e = d.fast[b.peek(kSkimBits)];
    int length = int(e & 63), size = int(e >> 6);
    if (length == 0) {
      size = long_symbol(d, b, length);
      if (size < 0 || size > 15) return false;
    }
    b.drop(length);
    if (size) {
      int diff = int(b.peek(size));
      b.drop(size);
      if (diff < (1 << (size - 1))) diff -= (1 << size) - 1;
      // (wrapping, as libjpeg's sum does, where corrupt data runs it past an int's range)
      int& last = dc[scan.component[block]];
      last = int(unsigned(last) + unsigned(diff));
    }
    const SkimTable& a = *scan.ac[block];
    for (int k = 1; k < 64;) {
      if (!b.fill()) return false;
      const uint32_t f = a.fast[b.peek(kSkimBits)];
      const int advance = int((f >> 6) & 127);
      const bool ends = (f >> 13) & 1;
      // All the window's symbols, where the block does not end before the last of them.
      if ((f & 63) && (ends ? k + advance < 64 : k + advance <= 64)) {
        b.drop(int(f & 63));
        k = ends ? 64 : k + advance;
      } else if (f >> 16) {
        b.drop(int((f >> 16) & 63));
        k += int(f >> 22);
      } else {
        int code_length = 0;
        const int symbol = long_symbol(a, b, code_length);
        if (symbol < 0) return false;
        b.drop(code_length + (symbol & 15));
        k += ac_advance(symbol);
      }
    }
  }
  return true;
}

// Skim tables a thread built, for the Huffman tables they were built from. The tiles of a
// slide usually share theirs (an encoder's default tables); an encoder that optimizes its
// tables gives each tile its own, and building a skim table (about 10 µs) would then cost
// more than skimming a tile's MCUs saves. So a table is built only when a thread meets it
// again among the last kMet it met, and a decode whose scan has a table not built skims
// nothing. A decode holds its scan's skim tables (by address) while it runs: a scan has
// at most 2 * MAX_COMPS_IN_SCAN tables, each looked up once (when the decode first skims), and
// only the least recently looked up of more than kKept is let go, so none of them is let
// go before the decode ends (a thread decodes one tile at a time).
class SkimTableSet {
 public:
  // nullptr where the table is not built (not met again yet, or malformed).
  const SkimTable* find(const JHUFF_TBL* from, bool dc) {
    if (from == nullptr) return nullptr;
    const int symbols = symbol_count(*from);
    if (symbols > 256) return nullptr;
    for (const auto& built : built_) {
      if (built->dc == dc && same_codes(built->from, *from, symbols)) {
        built->used = ++clock_;
        return &built->table;
      }
    }
    const uint64_t print = fingerprint(*from, symbols, dc);
    if (std::find(met_.begin(), met_.end(), print) == met_.end()) {
      met_[next_met_++ % kMet] = print;
      return nullptr;
    }
    auto made = std::make_unique<Built>();
    made->dc = dc;
    made->from = *from;
    made->used = ++clock_;
    if (!build_skim_table(*from, dc, made->table)) return nullptr;
    if (built_.size() < kKept) {
      built_.push_back(std::move(made));
      return &built_.back()->table;
    }
    auto& oldest =
        *std::min_element(built_.begin(), built_.end(),
                          [](const auto& a, const auto& b) { return a->used < b->used; });
    oldest = std::move(made);
    return &oldest->table;
  }

 private:
  struct Built {
    bool dc;
    JHUFF_TBL from;
    uint64_t used;  // when it was last looked up
    SkimTable table;
  };
  static constexpr size_t kKept = 8, kMet = 32;
  static_assert(kKept >= 2 * MAX_COMPS_IN_SCAN, "a scan's tables must outlive its decode");
  std::vector<std::unique_ptr<Built>> built_;
  uint64_t clock_ = 0;
  std::array<uint64_t, kMet> met_{};
  size_t next_met_ = 0;

  static int symbol_count(const JHUFF_TBL& t) {
    int count = 0;
    for (int l = 1; l <= 16; ++l) count += t.bits[l];
    return count;
  }
  // (the symbols past the count are not part of the table)
  static bool same_codes(const JHUFF_TBL& a, const JHUFF_TBL& b, int symbols) {
    return std::memcmp(a.bits, b.bits, sizeof a.bits) == 0 &&
           std::memcmp(a.huffval, b.huffval, size_t(symbols)) == 0;
  }
  static uint64_t fingerprint(const JHUFF_TBL& t, int symbols, bool dc) {
    util::Fnv1a h;
    h.add(&dc, sizeof dc);
    h.add(t.bits + 1, 16);
    h.add(t.huffval, size_t(symbols));
    return h.value() | 1;  // (0: an empty slot)
  }
};

// The skim tables for cinfo's scan; false where a table is missing, malformed or not built
// (std::bad_alloc where there is no memory to build one).
bool prepare_skim(j_decompress_ptr cinfo, SkimScan& scan) {
  thread_local SkimTableSet tables;
  if (cinfo->blocks_in_MCU > D_MAX_BLOCKS_IN_MCU) return false;
  scan.blocks = cinfo->blocks_in_MCU;
  // Each of the scan's tables is looked up once (a component's blocks share theirs, and a
  // second look-up would count as meeting it again), and all of them, so that each is met.
  const JHUFF_TBL* looked_up[2 * MAX_COMPS_IN_SCAN];
  const SkimTable* found[2 * MAX_COMPS_IN_SCAN];
  int count = 0;
  auto find = [&](const JHUFF_TBL* table, bool dc) {
    for (int i = 0; i < count; ++i) {
      if (looked_up[i] == table) return found[i];
    }
    looked_up[count] = table;
    return found[count++] = tables.find(table, dc);
  };
  bool all = true;
  for (int block = 0; block < scan.blocks; ++block) {
    const int c = cinfo->MCU_membership[block];
    const jpeg_component_info* component = cinfo->cur_comp_info[c];
    scan.component[block] = c;
    scan.dc[block] = find(cinfo->dc_huff_tbl_ptrs[component->dc_tbl_no], true);
    scan.ac[block] = find(cinfo->ac_huff_tbl_ptrs[component->ac_tbl_no], false);
    all = all && scan.dc[block] != nullptr && scan.ac[block] != nullptr;
  }
  return all;
}

using DecodeMcu = boolean (*)(j_decompress_ptr, JBLOCKROW*);

std::atomic<uint64_t> mcus_stepped_over{0};
std::atomic<uint64_t> mcus_skimmed{0};
std::atomic<bool> skim_allowed{true};

// One decode's use of a tile's marks, reached through cinfo->client_data by
// decode_marked_mcu, which stands in for the decoder's decode_mcu.
struct MarkedEntropy {
  DecodeMcu decode = nullptr;  // libjpeg's own
  EntropyMarks::Mark* marks = nullptr;
  const uint8_t* stream = nullptr;  // the tile's bytes, which the offsets count from
  size_t stream_size = 0;
  JDIMENSION count = 0, per_row = 1;
  JDIMENSION first_col = 0, last_col = 0;  // the MCU columns libjpeg transforms
  JDIMENSION next = 0;                     // the MCU the next call is for
  int components = 0;
  // Whether libjpeg's decoder stands at the start of MCU `next` (else at an MCU before it,
  // the calls between having been stepped over).
  bool positioned = true;
  uint64_t stepped_over = 0, skimmed = 0;
  const uint8_t* entropy = nullptr;  // where the tile's entropy data starts
  SkimScan skim;  // (skim.blocks == 0: not prepared yet; -1: the tile is not skimmed)
};

// Whether entropy data, from `data` to `end`, is as a conforming encoder writes it: each
// 0xFF stuffed (followed by 0x00), and after it only the end-of-image marker (after any
// fill bytes). libjpeg-turbo decodes other data (a marker or fill bytes mid-stream, data
// cut short) in ways that hang on how far ahead it had read, which skimming changes
// (found by fuzzing decodes made with and without it): such tiles are not skimmed, so
// that every decode of them gives the same pixels and fails alike.
bool plain_entropy_data(const uint8_t* data, const uint8_t* end) {
  if (data == nullptr || end - data < 2 || end[-1] != 0xD9 || end[-2] != 0xFF) return false;
  end -= 2;
  while (end > data && end[-1] == 0xFF) --end;
  for (const uint8_t* p = data;
       (p = static_cast<const uint8_t*>(std::memchr(p, 0xFF, size_t(end - p)))) != nullptr;
       p += 2) {
    if (end - p < 2 || p[1] != 0) return false;
  }
  return true;
}

// Marks MCU `at` (unless it is marked) with a decoder state: `consumed` bytes of the tile,
// the next `bits_left` bits in the low bits of `bits`, as libjpeg keeps them.
void mark(MarkedEntropy& m, JDIMENSION at, size_t consumed, uint64_t bits, int bits_left,
          int unread_marker, const int* dc) {
  EntropyMarks::Mark& mark = m.marks[at];
  if (mark.offset != EntropyMarks::kUnset) return;
  if (consumed > m.stream_size || bits_left < 0 || bits_left > 64 || unread_marker < 0 ||
      unread_marker > 0xFF) {
    return;
  }
  EntropyMarks::Mark made;
  for (int c = 0; c < m.components; ++c) {
    if (dc[c] < INT16_MIN || dc[c] > INT16_MAX) return;
    made.dc[c] = int16_t(dc[c]);
  }
  made.bits = bits;
  made.bits_left = uint8_t(bits_left);
  made.unread_marker = uint8_t(unread_marker);
  made.offset = uint32_t(consumed);
  mark = made;
}

void record(j_decompress_ptr cinfo, MarkedEntropy& m, JDIMENSION at) {
  const HuffmanDecoderHead& h = huffman(cinfo);
  // (past corrupt data, the decoder pads with zeros: nothing to come back to)
  if (h.insufficient_data) return;
  // (past the data, libjpeg's source reads from a buffer of its own: compared as numbers)
  const auto consumed = size_t(reinterpret_cast<uintptr_t>(cinfo->src->next_input_byte) -
                               reinterpret_cast<uintptr_t>(m.stream));
  mark(m, at, consumed, h.bitstate.get_buffer, h.bitstate.bits_left, cinfo->unread_marker,
       h.saved.last_dc_val);
}

// Steps libjpeg's decoder, restored to the start of MCU `from`, over MCUs up to `to` with
// the skim decoder, marking each; returns the MCU it stopped at, where libjpeg's decoder
// now stands (`from` where the skim decoder cannot start).
JDIMENSION skim(j_decompress_ptr cinfo, MarkedEntropy& m, JDIMENSION from, JDIMENSION to) {
  if (!skim_allowed.load(std::memory_order_relaxed)) return from;
  if (m.skim.blocks == 0) {
    bool prepared = false;
    try {  // (libjpeg called this: nothing may be thrown through it)
      prepared =
          plain_entropy_data(m.entropy, m.stream + m.stream_size) && prepare_skim(cinfo, m.skim);
    } catch (const std::bad_alloc&) {
    }
    if (!prepared) m.skim.blocks = -1;
  }
  HuffmanDecoderHead& h = huffman(cinfo);
  if (m.skim.blocks < 0 || cinfo->unread_marker != 0) return from;
  struct State {
    SkimBits bits;
    int dc[MAX_COMPS_IN_SCAN];
  };
  const int left = h.bitstate.bits_left;
  State now{{cinfo->src->next_input_byte, m.stream + m.stream_size,
             left == 0 ? 0 : uint64_t(h.bitstate.get_buffer) << (64 - left), left},
            {}};
  for (int c = 0; c < m.components; ++c) now.dc[c] = h.saved.last_dc_val[c];
  JDIMENSION at = from;
  for (; at < to; ++at) {
    const SkimBits& b = now.bits;
    mark(m, at, size_t(b.at - m.stream), b.low_bits(), b.left, 0, now.dc);
    State next = now;  // (where an MCU cannot be skimmed, libjpeg starts at its start)
    if (!skim_mcu(m.skim, next.bits, next.dc)) break;
    now = next;
  }
  cinfo->src->next_input_byte = now.bits.at;
  cinfo->src->bytes_in_buffer = size_t(now.bits.end - now.bits.at);
  h.bitstate.get_buffer = size_t(now.bits.low_bits());
  h.bitstate.bits_left = now.bits.left;
  for (int c = 0; c < m.components; ++c) h.saved.last_dc_val[c] = now.dc[c];
  m.skimmed += at - from;
  return at;
}

void restore(j_decompress_ptr cinfo, const MarkedEntropy& m, const EntropyMarks::Mark& mark) {
  HuffmanDecoderHead& h = huffman(cinfo);
  cinfo->src->next_input_byte = m.stream + mark.offset;
  cinfo->src->bytes_in_buffer = m.stream_size - mark.offset;
  cinfo->unread_marker = mark.unread_marker;
  h.insufficient_data = FALSE;
  h.bitstate.get_buffer = size_t(mark.bits);
  h.bitstate.bits_left = mark.bits_left;
  for (int c = 0; c < m.components; ++c) h.saved.last_dc_val[c] = mark.dc[c];
}

// libjpeg calls its decoder once an MCU, in the stream's order: with nowhere to put the
// coefficients for rows it skips, with the MCU's blocks otherwise, of which it transforms
// those in the cropped columns. An MCU whose coefficients nobody uses is stepped over
// where its place is marked (to come back to); the first one used after such a step
// restores the nearest mark before it, and decodes from there.
boolean decode_marked_mcu(j_decompress_ptr cinfo, JBLOCKROW* data) {
  auto& m = *static_cast<MarkedEntropy*>(cinfo->client_data);
  const JDIMENSION at = m.next;
  if (at >= m.count) return m.decode(cinfo, data);
  const JDIMENSION col = at % m.per_row;
  const bool used = data != nullptr && col >= m.first_col && col <= m.last_col;
  if (m.positioned) record(cinfo, m, at);
  if (!used && (!m.positioned || m.marks[at].offset != EntropyMarks::kUnset)) {
    m.positioned = false;
    ++m.next;
    ++m.stepped_over;
    return TRUE;
  }
  if (!m.positioned) {
    JDIMENSION from = at;  // the mark that let this decode step away is one of these
    while (m.marks[from].offset == EntropyMarks::kUnset) --from;
    restore(cinfo, m, m.marks[from]);
    m.stepped_over -= at - from;
    for (JDIMENSION k = from < at ? skim(cinfo, m, from, at) : at; k < at; ++k) {
      record(cinfo, m, k);
      m.decode(cinfo, nullptr);  // (a memory source never suspends a decode)
    }
    m.positioned = true;
    record(cinfo, m, at);
  }
  if (!m.decode(cinfo, data)) return FALSE;
  ++m.next;
  return TRUE;
}

// Whether a tile's MCUs can be marked: one baseline Huffman scan of every component, no
// restart markers, 8-bit samples.
bool markable(const jpeg_decompress_struct& cinfo, uint64_t size) {
  return !cinfo.progressive_mode && !cinfo.arith_code && cinfo.restart_interval == 0 &&
         cinfo.data_precision == 8 && cinfo.comps_in_scan == cinfo.num_components &&
         cinfo.num_components <= 3 && size < EntropyMarks::kUnset &&
         uint64_t(cinfo.MCUs_per_row) * cinfo.MCU_rows_in_scan <= (uint64_t(1) << 22);
}

}  // namespace

std::string decode_jpeg(const uint8_t* src, uint64_t size, const ChooseRegion& choose,
                        Window& window) {
  jpeg_decompress_struct cinfo;
  std::memset(&cinfo, 0, sizeof cinfo);  // destroyable even if creating it fails
  ErrorManager err;
  std::memset(&err, 0, sizeof err);
  install(err.base);
  cinfo.err = &err.base;
  // Nothing of automatic storage that the jump could leave half-updated is used
  // after it: the CMYK row lives in thread storage, the window is the caller's.
  thread_local std::vector<uint8_t> cmyk_row;
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    return err.message;
  }
  jpeg_create_decompress(&cinfo);
  // A progressive JPEG keeps every coefficient of the image in memory: a tiny file
  // may declare a large image. Past this, libjpeg fails with "insufficient memory".
  cinfo.mem->max_memory_to_use = kMaxDecoderMemory;
  jpeg_mem_src(&cinfo, src, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  window.width = cinfo.image_width;
  window.height = cinfo.image_height;
  Region region;
  try {
    region = choose(cinfo.image_width, cinfo.image_height);
  } catch (...) {
    jpeg_destroy_decompress(&cinfo);
    throw;
  }
  const bool cmyk = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
  cinfo.out_color_space = cmyk ? JCS_CMYK : JCS_RGB;
  cinfo.scale_num = region.eighths;
  cinfo.scale_denom = 8;
  cinfo.dct_method = JDCT_ISLOW;
  jpeg_start_decompress(&cinfo);
  // Decoded pixel i covers source pixels [8i / e, 8(i + 1) / e): the scale is e / 8
  // exactly, whatever the rounding of the decoded size, unless libjpeg chose another.
  const uint64_t eighths = region.eighths;
  bool as_asked = cinfo.output_width == (uint64_t(cinfo.image_width) * eighths + 7) / 8 &&
                  cinfo.output_height == (uint64_t(cinfo.image_height) * eighths + 7) / 8;
  window.scale_x = as_asked ? eighths / 8.0 : double(cinfo.output_width) / cinfo.image_width;
  window.scale_y = as_asked ? eighths / 8.0 : double(cinfo.output_height) / cinfo.image_height;
  // The region at the decoded scale, widened to whole pixels.
  const double sx = window.scale_x, sy = window.scale_y;
  JDIMENSION x0 = std::min<JDIMENSION>(JDIMENSION(region.x0 * sx), cinfo.output_width - 1);
  JDIMENSION x1 = std::min<JDIMENSION>(JDIMENSION(std::ceil(region.x1 * sx)), cinfo.output_width);
  JDIMENSION y0 = std::min<JDIMENSION>(JDIMENSION(region.y0 * sy), cinfo.output_height - 1);
  JDIMENSION y1 = std::min<JDIMENSION>(JDIMENSION(std::ceil(region.y1 * sy)), cinfo.output_height);
  if (x1 <= x0) x1 = x0 + 1;
  if (y1 <= y0) y1 = y0 + 1;
  JDIMENSION crop_x = x0, crop_width = x1 - x0;
  if (crop_width < cinfo.output_width) {
    // Moves crop_x down to an iMCU boundary and widens crop_width to match.
    jpeg_crop_scanline(&cinfo, &crop_x, &crop_width);
  }
  const JDIMENSION cols = cinfo.output_width;  // after cropping: the window's width
  window.x0 = crop_x;
  window.y0 = y0;
  window.cols = cols;
  window.rows = y1 - y0;
  try {
    window.pixels.resize(size_t(cols) * window.rows * 3);
    if (cmyk) cmyk_row.resize(size_t(cols) * 4);
  } catch (...) {
    jpeg_destroy_decompress(&cinfo);
    throw;
  }
  if (y0 > 0) jpeg_skip_scanlines(&cinfo, y0);
  JDIMENSION decoded = 0;
  if (cmyk) {  // a row at a time through the CMYK row, turned into RGB as it lands
    while (decoded < window.rows && read_rows(cinfo, cmyk_row.data(), 0, 1) == 1) {
      cmyk_to_rgb(cmyk_row.data(), window.pixels.data() + size_t(decoded) * cols * 3, cols,
                  cinfo.saw_Adobe_marker);
      ++decoded;
    }
  } else {
    decoded = read_rows(cinfo, window.pixels.data(), size_t(cols) * 3, window.rows);
  }
  if (decoded < window.rows) {
    std::snprintf(err.message, sizeof err.message, "decoding stopped at row %u",
                  unsigned(y0 + decoded));
    jpeg_destroy_decompress(&cinfo);
    return err.message;
  }
  // The rows below the region are never decoded.
  jpeg_abort_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  if (err.truncated) return "the data ends before the image does (a truncated JPEG)";
  return {};
}

namespace {

// decode_jpeg_tile, with `marks` used whether or not they work with this libjpeg.
std::string decode_tile(const uint8_t* tables, uint64_t tables_size, const uint8_t* src,
                        uint64_t size, bool rgb, const TileCheck& check, uint8_t* dest,
                        const TileRegion& region, EntropyMarks* marks) {
  jpeg_decompress_struct cinfo;
  std::memset(&cinfo, 0, sizeof cinfo);  // destroyable even if creating it fails
  ErrorManager err;
  std::memset(&err, 0, sizeof err);
  install(err.base);
  cinfo.err = &err.base;
  // Which stream failed; a C string, so that the jump leaves nothing to destroy.
  const char* volatile stage = "";
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    return std::string(stage) + err.message;
  }
  jpeg_create_decompress(&cinfo);
  cinfo.mem->max_memory_to_use = kMaxDecoderMemory;
  if (tables_size > 0) {
    stage = "its JPEG tables: ";
    jpeg_mem_src(&cinfo, tables, static_cast<unsigned long>(tables_size));
    // Tables only: libjpeg keeps them and goes back to waiting for a stream.
    if (jpeg_read_header(&cinfo, FALSE) != JPEG_HEADER_TABLES_ONLY) {
      jpeg_destroy_decompress(&cinfo);
      return "its JPEG tables hold an image, not only tables";
    }
    stage = "";
  }
  jpeg_mem_src(&cinfo, src, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  // A TIFF says in its photometric tag what the stream holds; the stream's own
  // markers (JFIF, Adobe) are usually absent, and libjpeg would guess.
  if (cinfo.num_components == 3) {
    cinfo.jpeg_color_space = rgb ? JCS_RGB : JCS_YCbCr;
    cinfo.out_color_space = JCS_RGB;
  } else if (cinfo.num_components == 1) {
    cinfo.jpeg_color_space = JCS_GRAYSCALE;
    cinfo.out_color_space = JCS_GRAYSCALE;
  } else {
    std::snprintf(err.message, sizeof err.message,
                  "a JPEG of %d components (stoker reads grey or three-component tiles)",
                  cinfo.num_components);
    jpeg_destroy_decompress(&cinfo);
    return err.message;
  }
  cinfo.dct_method = JDCT_ISLOW;
  jpeg_calc_output_dimensions(&cinfo);
  bool fits = false;
  try {
    std::string problem =
        check(cinfo.output_width, cinfo.output_height, uint32_t(cinfo.output_components));
    fits = problem.empty();
    if (!fits) std::snprintf(err.message, sizeof err.message, "%s", problem.c_str());
  } catch (...) {
    jpeg_destroy_decompress(&cinfo);
    throw;
  }
  if (!fits) {
    jpeg_destroy_decompress(&cinfo);
    return err.message;
  }
  jpeg_start_decompress(&cinfo);
  const uint32_t width = cinfo.output_width;
  const size_t components = size_t(cinfo.output_components);
  const size_t row_bytes = size_t(width) * components;
  // A margin of one chroma sample (max_h_samp_factor pixels) left and right of the
  // region, so that the pixels kept have the same neighbours as in a whole decode: chroma
  // upsampling reads a sample's neighbours, and a crop's edge samples have none (the crop
  // then widens the columns to whole iMCUs, which often holds the margin already). Rows
  // need no margin: skipping to a row decodes the rows above it that its upsampling reads
  // (checked against whole decodes for 4:2:0, 4:2:2 and 4:4:4 tiles at many offsets in
  // tests/volumes/test_slides.py). A progressive tile keeps a margin of a whole MCU:
  // libjpeg-turbo's block smoothing, where a scan leaves coefficients out, reads the
  // neighbouring blocks, and a crop's first block column has none.
  const uint32_t margin =
      uint32_t(cinfo.max_h_samp_factor) * (cinfo.progressive_mode ? uint32_t(DCTSIZE) : 1u);
  JDIMENSION x = 0, columns = width;
  if (region.col0 > 0 || region.col1 < width) {
    uint32_t lo = region.col0 > margin ? region.col0 - margin : 0;
    uint32_t hi = uint32_t(std::min<uint64_t>(width, uint64_t(region.col1) + margin));
    if (lo < hi && hi - lo < width) {
      x = lo;
      columns = hi - lo;
      jpeg_crop_scanline(&cinfo, &x, &columns);  // widened to whole iMCUs
    }
  }
  MarkedEntropy marked;
  if (marks != nullptr && markable(cinfo, size)) {
    const JDIMENSION count = cinfo.MCUs_per_row * cinfo.MCU_rows_in_scan;
    bool ready = marks->marks.size() == count;
    if (!ready) {
      try {
        marks->marks.assign(count, {});
        ready = true;
      } catch (const std::bad_alloc&) {  // decoded without them
      }
    }
    if (ready) {
      // The MCU columns libjpeg transforms, as jpeg_crop_scanline works them out.
      const JDIMENSION align =
          DCTSIZE * JDIMENSION(cinfo.num_components == 1 ? 1 : cinfo.max_h_samp_factor);
      marked.decode = huffman(&cinfo).decode_mcu;
      marked.marks = marks->marks.data();
      marked.stream = src;
      marked.stream_size = size;
      marked.count = count;
      marked.per_row = cinfo.MCUs_per_row;
      marked.first_col = x / align;
      marked.last_col = (x + cinfo.output_width + align - 1) / align - 1;
      marked.components = cinfo.num_components;
      // (libjpeg has read the headers, and no entropy data yet)
      const uint8_t* at = cinfo.src->next_input_byte;
      if (at >= src && at <= src + size) marked.entropy = at;
      cinfo.client_data = &marked;
      huffman(&cinfo).decode_mcu = decode_marked_mcu;
    }
  }
  const uint32_t last = std::min<uint32_t>(region.row1, cinfo.output_height);
  if (region.row0 > 0 && region.row0 < last) jpeg_skip_scanlines(&cinfo, region.row0);
  if (cinfo.output_scanline < last) {
    const JDIMENSION from = cinfo.output_scanline;
    uint8_t* first = dest + size_t(from) * row_bytes + size_t(x) * components;
    if (read_rows(cinfo, first, row_bytes, last - from) != last - from) {
      std::snprintf(err.message, sizeof err.message, "decoding stopped at row %u",
                    unsigned(cinfo.output_scanline));
      jpeg_destroy_decompress(&cinfo);
      return err.message;
    }
  }
  jpeg_abort_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  if (err.truncated) return "the data ends before the tile does (a truncated JPEG)";
  if (marked.stepped_over) mcus_stepped_over.fetch_add(marked.stepped_over);
  if (marked.skimmed) mcus_skimmed.fetch_add(marked.skimmed);
  return {};
}

// A 48 x 40 JPEG of stoker's own (4:2:0, with detail in every block), decoded whole
// without marks, then whole and in parts with them: the same pixels each time, and a
// mark at every MCU, or the marks are not used.
bool check_marks() {
  constexpr uint32_t kWidth = 48, kHeight = 40;
  std::vector<uint8_t> rgb(kWidth * kHeight * 3), jpeg;
  uint32_t state = 12345;
  for (size_t i = 0; i < rgb.size(); ++i) {
    state = state * 1103515245u + 12345u;
    rgb[i] = uint8_t((i * 7 / 3) % 256 / 2 + (state >> 25));
  }
  if (!encode_jpeg(rgb.data(), kWidth, kHeight, 90, jpeg).empty()) return false;
  const TileCheck fits = [](uint32_t, uint32_t, uint32_t) { return std::string(); };
  const size_t bytes = rgb.size();
  std::vector<uint8_t> whole(bytes), again(bytes);
  if (!decode_tile(nullptr, 0, jpeg.data(), jpeg.size(), false, fits, whole.data(), {}, nullptr)
           .empty()) {
    return false;
  }
  EntropyMarks marks;
  if (!decode_tile(nullptr, 0, jpeg.data(), jpeg.size(), false, fits, again.data(), {}, &marks)
           .empty() ||
      again != whole || marks.marks.size() != 3 * 3) {
    return false;
  }
  for (const auto& mark : marks.marks) {
    if (mark.offset == EntropyMarks::kUnset) return false;
  }
  for (const TileRegion& part : {TileRegion{17, 40, 20, 44}, TileRegion{0, 9, 0, 10},
                                 TileRegion{30, 33, 33, 48}, TileRegion{8, 24, 16, 32}}) {
    std::fill(again.begin(), again.end(), 0);
    if (!decode_tile(nullptr, 0, jpeg.data(), jpeg.size(), false, fits, again.data(), part, &marks)
             .empty()) {
      return false;
    }
    for (uint32_t row = part.row0; row < part.row1; ++row) {
      const size_t at = (size_t(row) * kWidth + part.col0) * 3;
      if (!std::equal(whole.begin() + at, whole.begin() + at + (part.col1 - part.col0) * 3,
                      again.begin() + at)) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

bool entropy_marks_work() {
  static const bool works = check_marks();
  return works;
}

uint64_t entropy_mcus_stepped_over() { return mcus_stepped_over.load(); }

uint64_t entropy_mcus_skimmed() { return mcus_skimmed.load(); }

bool allow_entropy_skim(bool allowed) { return skim_allowed.exchange(allowed); }

std::string decode_jpeg_tile(const uint8_t* tables, uint64_t tables_size, const uint8_t* src,
                             uint64_t size, bool rgb, const TileCheck& check, uint8_t* dest,
                             const TileRegion& region, EntropyMarks* marks) {
  return decode_tile(tables, tables_size, src, size, rgb, check, dest, region,
                     marks != nullptr && entropy_marks_work() ? marks : nullptr);
}

namespace {

// Compressed bytes go straight into the caller's vector (which is not of the
// encoder's frame, so a jump leaves it whole), a block at a time.
struct VectorDestination {
  jpeg_destination_mgr base;
  std::vector<uint8_t>* out;
  JOCTET block[16384];
};

void start_block(j_compress_ptr cinfo) {
  auto* dest = reinterpret_cast<VectorDestination*>(cinfo->dest);
  dest->base.next_output_byte = dest->block;
  dest->base.free_in_buffer = sizeof dest->block;
}

boolean flush_block(j_compress_ptr cinfo) {
  auto* dest = reinterpret_cast<VectorDestination*>(cinfo->dest);
  try {
    dest->out->insert(dest->out->end(), dest->block, dest->block + sizeof dest->block);
  } catch (...) {
    ERREXIT(cinfo, JERR_OUT_OF_MEMORY);
  }
  start_block(cinfo);
  return TRUE;
}

void finish_blocks(j_compress_ptr cinfo) {
  auto* dest = reinterpret_cast<VectorDestination*>(cinfo->dest);
  size_t used = sizeof dest->block - dest->base.free_in_buffer;
  try {
    dest->out->insert(dest->out->end(), dest->block, dest->block + used);
  } catch (...) {
    ERREXIT(cinfo, JERR_OUT_OF_MEMORY);
  }
}

}  // namespace

std::string encode_jpeg(const uint8_t* rgb, uint32_t width, uint32_t height, int quality,
                        std::vector<uint8_t>& out) {
  jpeg_compress_struct cinfo;
  std::memset(&cinfo, 0, sizeof cinfo);
  ErrorManager err;
  std::memset(&err, 0, sizeof err);
  install(err.base);
  cinfo.err = &err.base;
  VectorDestination dest;
  dest.base.init_destination = start_block;
  dest.base.empty_output_buffer = flush_block;
  dest.base.term_destination = finish_blocks;
  dest.out = &out;
  out.clear();
  if (setjmp(err.jump)) {
    jpeg_destroy_compress(&cinfo);
    out.clear();
    return err.message;
  }
  jpeg_create_compress(&cinfo);
  cinfo.dest = &dest.base;
  cinfo.image_width = width;
  cinfo.image_height = height;
  cinfo.input_components = 3;
  cinfo.in_color_space = JCS_RGB;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < height) {
    JSAMPROW row = const_cast<uint8_t*>(rgb) + size_t(cinfo.next_scanline) * width * 3;
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  return {};
}

}  // namespace stoker::image::detail

#endif  // STOKER_HAVE_IMAGE
