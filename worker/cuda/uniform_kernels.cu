#include "worker/cuda/uniform_kernels.h"

#include "worker/cuda/grid.cuh"

namespace muonmesh::cuda::internal {
namespace {

// SplitMix64 (worker/model/rng.h): H(x) = Mix(x + G).
__device__ __forceinline__ uint64_t Hash(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

__global__ void UniformFillKernel(uint64_t key, uint64_t first, int64_t count, double factor,
                                  float* __restrict__ out) {
  MUONMESH_GRID_STRIDE_LOOP(i, count) {
    const uint64_t bits = Hash(key ^ (first + static_cast<uint64_t>(i)));
    // (bits >> 40) - 2^23 is exact in float; times 2^-23 is exact too.
    const float u = static_cast<float>(static_cast<int64_t>(bits >> 40) - (int64_t{1} << 23)) *
                    (1.0f / 8388608.0f);
    out[i] = static_cast<float>(__dmul_rn(static_cast<double>(u), factor));
  }
}

}  // namespace

cudaError_t LaunchUniformFill(uint64_t key, uint64_t first, int64_t count, double factor,
                              float* out, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  UniformFillKernel<<<Blocks(count), kThreads, 0, stream>>>(key, first, count, factor, out);
  return cudaGetLastError();
}

}  // namespace muonmesh::cuda::internal
