#pragma once

// CPU stand-in (tests/worker/cuda_cpu/README.md): cuda_runtime.h adds C++
// conveniences to the runtime API, such as the typed cudaMalloc.
#include <cuda_runtime_api.h>

template <typename T>
cudaError_t cudaMalloc(T** ptr, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(ptr), bytes);
}
