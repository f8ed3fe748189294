// A floor under the thread stacks that libraries ask for.
//
// glibc carves a thread's static TLS out of the stack size it is given, and
// Debian's civetweb (the HTTP server under prometheus-cpp's Exposer) asks for
// 100 KiB stacks. OpenBLAS alone has 60 KiB of static TLS, so in a process
// that loads OpenBLAS, gRPC and CUDA libraries the metrics server's threads
// are left a few KiB of stack, overflow it, and crash (seen: SIGSEGV in
// __pthread_disable_asynccancel with a zeroed thread descriptor when the
// Exposer stops). Every binary that links this object gets the definition
// below, which the dynamic linker binds ahead of libc's for every library:
// it raises any explicitly requested stack below kMinStackBytes to that, and
// leaves larger requests alone. The executable must export the symbol
// (CMake adds --export-dynamic-symbol with this object).

#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <cstddef>

namespace {
constexpr size_t kMinStackBytes = size_t{1} << 20;
}  // namespace

extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  using Fn = int (*)(pthread_attr_t*, size_t);
  static const Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  return real(attr, std::max(size, kMinStackBytes));
}
