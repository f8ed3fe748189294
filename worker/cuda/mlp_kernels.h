#pragma once

// The small kernels around cuBLAS in the GPU `mlp` workload
// (worker/model/mlp_cuda.h): each mirrors one loop of worker/model/mlp.cc with
// the same arithmetic per element. Plain C++ interface, compiled by nvcc;
// each returns the launch error.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace muonmesh::cuda::internal {

// Blocks of LaunchOutputDelta's loss partial sums (`partial` holds this many).
inline constexpr int kLossBlocks = 256;

// dst[r, :] = src[rows[r], :] for r < n; rows are device int64 indices.
cudaError_t LaunchGatherRows(const float* src, const int64_t* rows, int64_t n, int64_t width,
                             float* dst, cudaStream_t stream);

// z[r, o] = z[r, o] + b[o], then tanh when `activate` (float, as the CPU).
cudaError_t LaunchBiasActivate(float* z, const float* b, int64_t n, int64_t width, bool activate,
                               cudaStream_t stream);

// For each element: d = double(y) - double(t); delta = float(d * 2 / denom);
// partial[block] = sum of d^2 over the elements block `block` visits (a
// fixed grid, so the loss sum is the same on every run). t is gathered:
// t[r, :] = targets[rows[r], :].
cudaError_t LaunchOutputDelta(const float* y, const float* targets, const int64_t* rows, int64_t n,
                              int64_t width, double denom, float* delta, double* partial,
                              cudaStream_t stream);

// out[c] = float(sum over r, in row order, of double(x[r, c])).
cudaError_t LaunchColumnSums(const float* x, int64_t n, int64_t width, float* out,
                             cudaStream_t stream);

// delta[k] *= 1 - h[k] * h[k] (float, rounded step by step).
cudaError_t LaunchTanhBackward(float* delta, const float* h, int64_t count, cudaStream_t stream);

}  // namespace muonmesh::cuda::internal
