#pragma once

// The small kernels around cuBLAS in the GPU `mlp` workload
// (worker/model/mlp_cuda.h): each mirrors one loop of worker/model/mlp.cc with
// the same arithmetic per element. Plain C++ interface, compiled by nvcc;
// each returns the launch error.
//
// tests/worker/cuda_cpu/kernels_cpu.cc transcribes these kernels for the CPU
// stand-in that runs the GPU tests in every build: change both together.

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

namespace muonmesh::cuda::internal {

// The row moves of the GPU `moe_mlp` (worker/model/moe_mlp_cuda.h); `rows`
// are device int64 indices, widths in floats.
// dst[i, :] = src[rows[i] * src_stride + src_offset + (0..width)], i < n.
cudaError_t LaunchGatherRowsStrided(const float* src, int64_t src_stride, int64_t src_offset,
                                    const int64_t* rows, int64_t n, int64_t width, float* dst,
                                    cudaStream_t stream);
// dst[rows[i], :] = src[i, :] (rows distinct).
cudaError_t LaunchScatterRows(const float* src, const int64_t* rows, int64_t n, int64_t width,
                              float* dst, cudaStream_t stream);
// dst[rows[i], :] += src[i, :] (rows distinct; float adds).
cudaError_t LaunchScatterAddRows(const float* src, const int64_t* rows, int64_t n, int64_t width,
                                 float* dst, cudaStream_t stream);
// Token packing: dst[j * (width + 1)] = ids[j], then src[rows[j], :].
cudaError_t LaunchPackTokens(const float* src, const int64_t* rows, const float* ids, int64_t n,
                             int64_t width, float* dst, cudaStream_t stream);
// dst[j, :] = scale[rows[j]] * src[rows[j], :] (float products).
cudaError_t LaunchGatherScaledRows(const float* src, const float* scale, const int64_t* rows,
                                   int64_t n, int64_t width, float* dst, cudaStream_t stream);
// z[s, :] = h[s, :] + gate[s] * o[s, :] (float, product then sum).
cudaError_t LaunchGatedResidual(const float* h, const float* gate, const float* o, int64_t n,
                                int64_t width, float* z, cudaStream_t stream);
// out[s] = sum over k of double(a[s, k]) * double(b[s, k]), in k order.
cudaError_t LaunchRowDots(const float* a, const float* b, int64_t n, int64_t width, double* out,
                          cudaStream_t stream);
// x[i] = tanhf(x[i]).
cudaError_t LaunchTanh(float* x, int64_t count, cudaStream_t stream);

}  // namespace muonmesh::cuda::internal
