// Shared libraries opened with dlopen at run time instead of linked (the CUDA
// driver, cuFile, libzstd, libblosc): one build imports and runs everywhere, and
// a library that is not installed is a status with the loader's words, never a
// failure at import or a crash.
#pragma once

#include <string>
#include <vector>

namespace stoker::util {

class DynamicLibrary {
 public:
  // Tries `candidates` (paths, or names for the loader's search path) in order and
  // keeps the first that loads. Never throws.
  static DynamicLibrary open(const std::vector<std::string>& candidates);

  bool loaded() const { return handle_ != nullptr; }
  // The candidate that loaded.
  const std::string& candidate() const { return candidate_; }
  // The file the loader mapped: for a bare name, where its search found it.
  std::string mapped_path() const;
  // When none loaded: the loader's reason for each candidate, "; "-separated.
  const std::string& failures() const { return failures_; }

  // Points `slot` at the entry point `name`, or at null when the library has none;
  // a required one's name is kept in missing() (the first only), so a whole table
  // of entry points is bound before one check.
  template <typename Fn>
  void bind(const char* name, Fn*& slot) {
    slot = reinterpret_cast<Fn*>(lookup(name));
    if (slot == nullptr && missing_.empty()) missing_ = name;
  }
  // As bind, for an entry point only newer versions of the library have.
  template <typename Fn>
  void bind_optional(const char* name, Fn*& slot) {
    slot = reinterpret_cast<Fn*>(lookup(name));
  }
  // The first required entry point bind() did not find; empty when all were there.
  const std::string& missing() const { return missing_; }

 private:
  void* lookup(const char* name) const;

  // Never closed: entry points bound from it must stay valid for threads and
  // destructors that run during interpreter shutdown.
  void* handle_ = nullptr;
  std::string candidate_;
  std::string failures_;
  std::string missing_;
};

}  // namespace stoker::util
