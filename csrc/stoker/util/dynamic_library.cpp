#include "stoker/util/dynamic_library.hpp"

#include <dlfcn.h>
#include <link.h>

namespace stoker::util {

DynamicLibrary DynamicLibrary::open(const std::vector<std::string>& candidates) {
  DynamicLibrary library;
  for (const auto& candidate : candidates) {
    if (void* handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      library.handle_ = handle;
      library.candidate_ = candidate;
      library.failures_.clear();
      return library;
    }
    const char* why = dlerror();
    library.failures_ += (library.failures_.empty() ? "" : "; ") +
                         std::string(why != nullptr ? why : candidate.c_str());
  }
  return library;
}

std::string DynamicLibrary::mapped_path() const {
  struct link_map* map = nullptr;
  if (handle_ != nullptr && dlinfo(handle_, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr &&
      map->l_name != nullptr && *map->l_name != '\0') {
    return map->l_name;
  }
  return candidate_;
}

void* DynamicLibrary::lookup(const char* name) const {
  return handle_ != nullptr ? dlsym(handle_, name) : nullptr;
}

}  // namespace stoker::util
