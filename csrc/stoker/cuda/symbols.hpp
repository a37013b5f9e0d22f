// Entry points of a library opened with dlopen, looked up into a table.
#pragma once

#include <dlfcn.h>

#include <string>

namespace stoker::cuda {

// Sets `slot` to `name` in `library`; the first name not found goes to `missing`.
template <typename Fn>
void bind(void* library, const char* name, Fn*& slot, std::string& missing) {
  slot = reinterpret_cast<Fn*>(dlsym(library, name));
  if (slot == nullptr && missing.empty()) missing = name;
}

}  // namespace stoker::cuda
