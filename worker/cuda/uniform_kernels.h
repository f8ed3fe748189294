#pragma once

// The counter-based uniforms of worker/model/rng.h on the GPU, bit for bit:
// out[i] = float(double(UniformFromBits(H(key ^ (first + i)))) * factor) with
// key = H(H(seed) ^ stream) computed by the caller (UniformStream's key).
// Plain C++ interface, compiled by nvcc; returns the launch error.
//
// tests/worker/cuda_cpu/kernels_cpu.cc transcribes these kernels for the CPU
// stand-in that runs the GPU tests in every build: change both together.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace muonmesh::cuda::internal {

cudaError_t LaunchUniformFill(uint64_t key, uint64_t first, int64_t count, double factor,
                              float* out, cudaStream_t stream);

}  // namespace muonmesh::cuda::internal
