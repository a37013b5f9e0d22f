#include "stoker/io/file_cache.hpp"

namespace stoker::io {

std::shared_ptr<const FileDescriptor> FileCache::get(const std::string& path) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(path);
    if (it != entries_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.position);
      return it->second.fd;
    }
  }
  // Open outside the lock: on a network mount an open can take milliseconds
  // and other threads should keep reading meanwhile.
  auto fd = std::make_shared<const FileDescriptor>(open_for_read(path));
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(path);
  if (it != entries_.end()) {  // another thread opened it first; keep theirs
    lru_.splice(lru_.begin(), lru_, it->second.position);
    return it->second.fd;
  }
  while (entries_.size() >= capacity_) {
    entries_.erase(lru_.back());
    lru_.pop_back();
  }
  lru_.push_front(path);
  entries_.emplace(path, Entry{fd, lru_.begin()});
  return fd;
}

size_t FileCache::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

}  // namespace stoker::io
