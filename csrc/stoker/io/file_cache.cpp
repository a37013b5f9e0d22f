#include "stoker/io/file_cache.hpp"

#include <utility>

#include "stoker/errors.hpp"

namespace stoker::io {

std::shared_ptr<const FileDescriptor> FileCache::get(const std::string& path,
                                                     const FileIdentity& expected) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(path);
    if (it != entries_.end() && (!expected.known() || it->second.identity == expected)) {
      lru_.splice(lru_.begin(), lru_, it->second.position);
      return it->second.fd;
    }
  }
  // Open outside the lock: on a network mount an open can take milliseconds
  // and other threads should keep reading meanwhile.
  FileDescriptor opened = open_for_read(path);
  FileIdentity identity = identity_of(opened.get(), path);
  if (expected.known() && identity != expected) {
    throw FormatError(path, 0,
                      "the file changed after it was indexed (now " +
                          std::to_string(identity.size) + " bytes, inode " +
                          std::to_string(identity.inode) + "; indexed " +
                          std::to_string(expected.size) + " bytes, inode " +
                          std::to_string(expected.inode) + "): open the dataset again");
  }
  opened.map();
  auto fd = std::make_shared<const FileDescriptor>(std::move(opened));
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(path);
  if (it != entries_.end()) {  // replace whatever is cached: this one is checked
    lru_.erase(it->second.position);
    entries_.erase(it);
  }
  while (entries_.size() >= capacity_) {
    entries_.erase(lru_.back());
    lru_.pop_back();
  }
  lru_.push_front(path);
  entries_.emplace(path, Entry{fd, identity, lru_.begin()});
  return fd;
}

void FileCache::forget(const std::string& path) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(path);
  if (it == entries_.end()) return;
  lru_.erase(it->second.position);
  entries_.erase(it);
}

size_t FileCache::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

}  // namespace stoker::io
