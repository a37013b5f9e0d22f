#include "stoker/io/decoder.hpp"

#include <array>
#include <atomic>
#include <cstring>
#include <mutex>

#include "stoker/errors.hpp"

namespace stoker::io {

namespace {

struct Registry {
  std::mutex mutex;  // registrations only: lookups read the table without it
  std::array<std::atomic<const CodecEntry*>, 256> entries{};
};

Registry& registry() {
  // Never destroyed, nor any entry: pool threads may look codes up at exit.
  static Registry* r = [] {
    auto* fresh = new Registry;
    for (CodecEntry own : {CodecEntry{Codec::kStored, "STORED", false, nullptr, false},
                           CodecEntry{Codec::kDeflate, "DEFLATE", true, nullptr, false},
                           CodecEntry{Codec::kArrayRow, "ARRAY_ROW", false, nullptr, false},
                           CodecEntry{Codec::kArrayBox, "ARRAY_BOX", false, nullptr, false},
                           CodecEntry{Codec::kColumnValue, "COLUMN_VALUE", false, nullptr, false},
                           CodecEntry{Codec::kSpanBox, "SPAN_BOX", false, nullptr, true}}) {
      fresh->entries[static_cast<uint8_t>(own.code)].store(new CodecEntry(own));
    }
    return fresh;
  }();
  return *r;
}

}  // namespace

void register_codec(CodecEntry entry) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto& slot = r.entries[static_cast<uint8_t>(entry.code)];
  if (const CodecEntry* known = slot.load()) {
    if (std::strcmp(known->name, entry.name) == 0) return;
    throw Error("codec " + std::to_string(int(entry.code)) + " is " + known->name +
                ", so it cannot be registered as " + entry.name);
  }
  slot.store(new CodecEntry(std::move(entry)), std::memory_order_release);
}

const CodecEntry* find_codec(Codec code) {
  return registry().entries[static_cast<uint8_t>(code)].load(std::memory_order_acquire);
}

std::vector<const CodecEntry*> registered_codecs() {
  std::vector<const CodecEntry*> out;
  for (const auto& slot : registry().entries) {
    if (const CodecEntry* entry = slot.load(std::memory_order_acquire)) out.push_back(entry);
  }
  return out;
}

}  // namespace stoker::io
