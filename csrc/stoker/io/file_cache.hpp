// A bounded cache of open read-only descriptors, so each shard is opened once
// rather than once per sample. Handles are shared: evicting an entry never
// closes a descriptor that a read in flight still holds.
#pragma once

#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "stoker/io/posix_file.hpp"

namespace stoker::io {

class FileCache {
 public:
  explicit FileCache(size_t capacity) : capacity_(capacity == 0 ? 1 : capacity) {}

  // A descriptor for `path`. When `expected` is known, the file must still be
  // the one indexed: a replaced or rewritten file is a FormatError, never a
  // read of other bytes than the index describes.
  std::shared_ptr<const FileDescriptor> get(const std::string& path,
                                            const FileIdentity& expected = {});
  // Closes the cached descriptor of `path` (reads in flight keep theirs), so
  // that a deleted file's space is freed: a cache evicts shards it let go of.
  void forget(const std::string& path);
  size_t capacity() const { return capacity_; }
  size_t size() const;

 private:
  using Lru = std::list<std::string>;
  struct Entry {
    std::shared_ptr<const FileDescriptor> fd;
    FileIdentity identity;
    Lru::iterator position;
  };

  size_t capacity_;
  mutable std::mutex mutex_;
  Lru lru_;  // front: most recently used
  std::unordered_map<std::string, Entry> entries_;
};

}  // namespace stoker::io
