// A shard's member index kept beside it (`<shard>.stoker-idx`), written by
// `stoker index` and `stoker pack`, so that opening the shard costs one small
// read instead of a walk over every tar header (or every zip local header).
//
// The sidecar records the shard's size and modification time. It is used only
// while the shard still has both; anything else (the shard rewritten, or copied
// without its times), and a sidecar that is corrupt or cut short, is never
// trusted: the shard is indexed the long way, and the caller is told why.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "stoker/format/shard_index.hpp"

namespace stoker::format {

constexpr const char* kSidecarSuffix = ".stoker-idx";

enum class SidecarState : uint8_t {
  kNone = 0,     // no sidecar beside the shard
  kUsed = 1,     // the shard's index came from it
  kStale = 2,    // the shard is not the one it was written for
  kCorrupt = 3,  // not a sidecar stoker wrote, or damaged
};

// The index of the shard at `path` from its sidecar, if there is a sidecar for
// it as it is now (`shard`: the shard's identity); `state` says what was found.
bool read_sidecar(const std::string& path, const io::FileIdentity& shard, ShardIndex& index,
                  SidecarState& state);

// The index in a sidecar's bytes, with the shard size and mtime it was written
// for; false when the bytes are not a whole sidecar stoker wrote, or describe
// what no shard could hold (the fuzz target's entry point too).
bool decode_sidecar(const std::vector<uint8_t>& bytes, ShardIndex& index, uint64_t& size,
                    int64_t& mtime_ns);

// Writes the sidecar of `index` (of the shard at `path`, tar or zip) beside it:
// to a temporary file, synced, then renamed into place. Throws ReadError
// naming the sidecar when it cannot be written.
void write_sidecar(const std::string& path, const ShardIndex& index);

}  // namespace stoker::format
