// Built only into a wheel's extension (STOKER_STATIC_CXX_RUNTIME). With libstdc++ linked in
// statically, its std::random_device pulls in glibc 2.36's arc4random, although stoker
// never makes a random_device; that one symbol alone would tag the wheel manylinux_2_36
// and keep it off Ubuntu 22.04 and RHEL 9. This definition, local to the extension, takes
// its place, from getrandom (glibc 2.25).
#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>

extern "C" __attribute__((visibility("hidden"))) uint32_t arc4random(void) {
  uint32_t value = 0;
  for (;;) {
    const ssize_t got = getrandom(&value, sizeof value, 0);
    if (got == static_cast<ssize_t>(sizeof value)) return value;
    if (got < 0 && errno != EINTR) std::abort();  // no entropy at all: nothing to return
  }
}
