#pragma once

// Launchers of the small memory-bound kernels around the cuBLAS products of
// CudaNewtonSchulz. Plain C++ interface (no Abseil), compiled by nvcc in
// ns_kernels.cu; each returns the launch error (cudaGetLastError).
//
// tests/worker/cuda_cpu/kernels_cpu.cc transcribes these kernels for the CPU
// stand-in that runs the GPU tests in every build: change both together.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace muonmesh::cuda::internal {

// Blocks of the first reduction stage: `partial` must hold this many values.
inline constexpr int kReduceBlocks = 512;

// sums[slot] = sum of x[i]^2 (infinite or NaN exactly when some x[i] is), and
// when `inv_norm` is not null, *inv_norm = 1 / max(sqrt(sums[slot]), eps).
// The data is fp32; the squares are accumulated in double because finite
// floats can overflow an fp32 sum (1e20^2 > FLT_MAX). Two stages of fixed
// shape, so the order of additions and hence the result is the same on every
// call.
cudaError_t LaunchSumSquares(const float* x, int64_t count, double* partial, double* sums,
                             int slot, double eps, double* inv_norm, cudaStream_t stream);

// x[i] = float(x[i] * *inv_norm) (the product in double, as on the CPU);
// xb[i] = bf16(x[i]).
cudaError_t LaunchScaleToBf16(float* x, __nv_bfloat16* xb, int64_t count, const double* inv_norm,
                              cudaStream_t stream);

// dst[i] = bf16(src[i]) (round to nearest even).
cudaError_t LaunchToBf16(const float* src, __nv_bfloat16* dst, int64_t count,
                         cudaStream_t stream);

// hi[i] = bf16(src[i]), lo[i] = bf16(src[i] - hi[i]): hi + lo carries about
// 16 of src's 24 significant bits, so products of such pairs (three bf16
// GEMMs: hi hi + hi lo + lo hi) come within about 2^-16 of fp32's.
cudaError_t LaunchSplitBf16(const float* src, __nv_bfloat16* hi, __nv_bfloat16* lo,
                            int64_t count, cudaStream_t stream);

// a[i][i] += value for the n x n matrix a (either layout).
cudaError_t LaunchAddToDiagonal(float* a, int64_t n, float value, cudaStream_t stream);

// dst (cols x rows) = src (rows x cols)^T, row-major.
cudaError_t LaunchTranspose(const float* src, int64_t rows, int64_t cols, float* dst,
                            cudaStream_t stream);

}  // namespace muonmesh::cuda::internal
