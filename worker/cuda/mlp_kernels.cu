#include "worker/cuda/mlp_kernels.h"

#include "worker/cuda/grid.cuh"

namespace muonmesh::cuda::internal {
namespace {

__global__ void GatherRowsKernel(const float* __restrict__ src, const int64_t* __restrict__ rows,
                                 int64_t n, int64_t width, float* __restrict__ dst) {
  MUONMESH_GRID_STRIDE_LOOP(k, n * width) {
    const int64_t r = k / width;
    dst[k] = src[rows[r] * width + (k - r * width)];
  }
}

__global__ void BiasActivateKernel(float* __restrict__ z, const float* __restrict__ b, int64_t n,
                                   int64_t width, bool activate) {
  MUONMESH_GRID_STRIDE_LOOP(k, n * width) {
    const float v = __fadd_rn(z[k], b[k % width]);
    z[k] = activate ? tanhf(v) : v;
  }
}

__global__ void OutputDeltaKernel(const float* __restrict__ y, const float* __restrict__ targets,
                                  const int64_t* __restrict__ rows, int64_t n, int64_t width,
                                  double denom, float* __restrict__ delta,
                                  double* __restrict__ partial) {
  __shared__ double sums[kThreads];
  double local = 0.0;
  MUONMESH_GRID_STRIDE_LOOP(k, n * width) {
    const int64_t r = k / width;
    const double d = static_cast<double>(y[k]) -
                     static_cast<double>(targets[rows[r] * width + (k - r * width)]);
    local = __dadd_rn(local, __dmul_rn(d, d));
    delta[k] = static_cast<float>(__ddiv_rn(__dmul_rn(d, 2.0), denom));
  }
  sums[threadIdx.x] = local;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sums[threadIdx.x] += sums[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sums[0];
}

__global__ void ColumnSumsKernel(const float* __restrict__ x, int64_t n, int64_t width,
                                 float* __restrict__ out) {
  MUONMESH_GRID_STRIDE_LOOP(c, width) {
    double s = 0.0;
    for (int64_t r = 0; r < n; ++r) s = __dadd_rn(s, static_cast<double>(x[r * width + c]));
    out[c] = static_cast<float>(s);
  }
}

__global__ void TanhBackwardKernel(float* __restrict__ delta, const float* __restrict__ h,
                                   int64_t count) {
  MUONMESH_GRID_STRIDE_LOOP(k, count) {
    delta[k] = __fmul_rn(delta[k], __fsub_rn(1.0f, __fmul_rn(h[k], h[k])));
  }
}

}  // namespace

cudaError_t LaunchGatherRows(const float* src, const int64_t* rows, int64_t n, int64_t width,
                             float* dst, cudaStream_t stream) {
  if (n * width <= 0) return cudaSuccess;
  GatherRowsKernel<<<Blocks(n * width), kThreads, 0, stream>>>(src, rows, n, width, dst);
  return cudaGetLastError();
}

cudaError_t LaunchBiasActivate(float* z, const float* b, int64_t n, int64_t width, bool activate,
                               cudaStream_t stream) {
  if (n * width <= 0) return cudaSuccess;
  BiasActivateKernel<<<Blocks(n * width), kThreads, 0, stream>>>(z, b, n, width, activate);
  return cudaGetLastError();
}

cudaError_t LaunchOutputDelta(const float* y, const float* targets, const int64_t* rows, int64_t n,
                              int64_t width, double denom, float* delta, double* partial,
                              cudaStream_t stream) {
  OutputDeltaKernel<<<kLossBlocks, kThreads, 0, stream>>>(y, targets, rows, n, width, denom, delta,
                                                          partial);
  return cudaGetLastError();
}

cudaError_t LaunchColumnSums(const float* x, int64_t n, int64_t width, float* out,
                             cudaStream_t stream) {
  if (width <= 0) return cudaSuccess;
  ColumnSumsKernel<<<Blocks(width), kThreads, 0, stream>>>(x, n, width, out);
  return cudaGetLastError();
}

cudaError_t LaunchTanhBackward(float* delta, const float* h, int64_t count, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  TanhBackwardKernel<<<Blocks(count), kThreads, 0, stream>>>(delta, h, count);
  return cudaGetLastError();
}

}  // namespace muonmesh::cuda::internal

namespace muonmesh::cuda::internal {
namespace {

__global__ void GatherRowsStridedKernel(const float* __restrict__ src, int64_t stride,
                                        int64_t offset, const int64_t* __restrict__ rows,
                                        int64_t n, int64_t width, float* __restrict__ dst) {
  MUONMESH_GRID_STRIDE_LOOP(k, n * width) {
    const int64_t i = k / width;
    dst[k] = src[rows[i] * stride + offset + (k - i * width)];
  }
}

__global__ void ScatterRowsKernel(const float* __restrict__ src, const int64_t* __restrict__ rows,
                                  int64_t n, int64_t width, float* __restrict__ dst, bool add) {
  MUONMESH_GRID_STRIDE_LOOP(k, n * width) {
    const int64_t i = k / width;
    float* d = dst + rows[i] * width + (k - i * width);
    *d = add ? __fadd_rn(*d, src[k]) : src[k];
  }
}

__global__ void PackTokensKernel(const float* __restrict__ src, const int64_t* __restrict__ rows,
                                 const float* __restrict__ ids, int64_t n, int64_t width,
                                 float* __restrict__ dst) {
  const int64_t row = width + 1;
  MUONMESH_GRID_STRIDE_LOOP(k, n * row) {
    const int64_t j = k / row;
    const int64_t c = k - j * row;
    dst[k] = c == 0 ? ids[j] : src[rows[j] * width + (c - 1)];
  }
}

__global__ void GatherScaledRowsKernel(const float* __restrict__ src,
                                       const float* __restrict__ scale,
                                       const int64_t* __restrict__ rows, int64_t n, int64_t width,
                                       float* __restrict__ dst) {
  MUONMESH_GRID_STRIDE_LOOP(k, n * width) {
    const int64_t j = k / width;
    const int64_t s = rows[j];
    dst[k] = __fmul_rn(scale[s], src[s * width + (k - j * width)]);
  }
}

__global__ void GatedResidualKernel(const float* __restrict__ h, const float* __restrict__ gate,
                                    const float* __restrict__ o, int64_t n, int64_t width,
                                    float* __restrict__ z) {
  MUONMESH_GRID_STRIDE_LOOP(k, n * width) { z[k] = __fadd_rn(h[k], __fmul_rn(gate[k / width], o[k])); }
}

__global__ void RowDotsKernel(const float* __restrict__ a, const float* __restrict__ b, int64_t n,
                              int64_t width, double* __restrict__ out) {
  MUONMESH_GRID_STRIDE_LOOP(s, n) {
    double sum = 0.0;
    for (int64_t k = 0; k < width; ++k) {
      sum = __dadd_rn(sum, __dmul_rn(static_cast<double>(a[s * width + k]),
                                     static_cast<double>(b[s * width + k])));
    }
    out[s] = sum;
  }
}

__global__ void TanhKernel(float* __restrict__ x, int64_t count) {
  MUONMESH_GRID_STRIDE_LOOP(k, count) { x[k] = tanhf(x[k]); }
}

}  // namespace

cudaError_t LaunchGatherRowsStrided(const float* src, int64_t src_stride, int64_t src_offset,
                                    const int64_t* rows, int64_t n, int64_t width, float* dst,
                                    cudaStream_t stream) {
  if (n * width <= 0) return cudaSuccess;
  GatherRowsStridedKernel<<<Blocks(n * width), kThreads, 0, stream>>>(
      src, src_stride, src_offset, rows, n, width, dst);
  return cudaGetLastError();
}

cudaError_t LaunchScatterRows(const float* src, const int64_t* rows, int64_t n, int64_t width,
                              float* dst, cudaStream_t stream) {
  if (n * width <= 0) return cudaSuccess;
  ScatterRowsKernel<<<Blocks(n * width), kThreads, 0, stream>>>(src, rows, n, width, dst,
                                                                      false);
  return cudaGetLastError();
}

cudaError_t LaunchScatterAddRows(const float* src, const int64_t* rows, int64_t n, int64_t width,
                                 float* dst, cudaStream_t stream) {
  if (n * width <= 0) return cudaSuccess;
  ScatterRowsKernel<<<Blocks(n * width), kThreads, 0, stream>>>(src, rows, n, width, dst,
                                                                      true);
  return cudaGetLastError();
}

cudaError_t LaunchPackTokens(const float* src, const int64_t* rows, const float* ids, int64_t n,
                             int64_t width, float* dst, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  PackTokensKernel<<<Blocks(n * (width + 1)), kThreads, 0, stream>>>(src, rows, ids, n,
                                                                           width, dst);
  return cudaGetLastError();
}

cudaError_t LaunchGatherScaledRows(const float* src, const float* scale, const int64_t* rows,
                                   int64_t n, int64_t width, float* dst, cudaStream_t stream) {
  if (n * width <= 0) return cudaSuccess;
  GatherScaledRowsKernel<<<Blocks(n * width), kThreads, 0, stream>>>(src, scale, rows, n,
                                                                           width, dst);
  return cudaGetLastError();
}

cudaError_t LaunchGatedResidual(const float* h, const float* gate, const float* o, int64_t n,
                                int64_t width, float* z, cudaStream_t stream) {
  if (n * width <= 0) return cudaSuccess;
  GatedResidualKernel<<<Blocks(n * width), kThreads, 0, stream>>>(h, gate, o, n, width, z);
  return cudaGetLastError();
}

cudaError_t LaunchRowDots(const float* a, const float* b, int64_t n, int64_t width, double* out,
                          cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  RowDotsKernel<<<Blocks(n), kThreads, 0, stream>>>(a, b, n, width, out);
  return cudaGetLastError();
}

cudaError_t LaunchTanh(float* x, int64_t count, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  TanhKernel<<<Blocks(count), kThreads, 0, stream>>>(x, count);
  return cudaGetLastError();
}

}  // namespace muonmesh::cuda::internal
