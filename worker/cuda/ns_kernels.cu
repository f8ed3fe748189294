#include "worker/cuda/ns_kernels.h"

#include <algorithm>

namespace muonmesh::cuda::internal {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 32;

int BlocksFor(int64_t count) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, 8192)));
}

// Sum of a block's values in a fixed tree order, returned to every thread.
template <typename T>
__device__ T BlockSum(T v) {
  __shared__ T shared[kThreads];
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  return shared[0];
}

__global__ void SumSquaresStage1(const float* __restrict__ x, int64_t count,
                                 double* __restrict__ partial) {
  double s = 0.0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += stride) {
    const double v = x[i];
    s += v * v;
  }
  s = BlockSum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void SumSquaresStage2(const double* __restrict__ partial, int blocks, double* sums,
                                 int slot, double eps, double* inv_norm) {
  double s = 0.0;
  for (int i = threadIdx.x; i < blocks; i += kThreads) s += partial[i];
  s = BlockSum(s);
  if (threadIdx.x == 0) {
    sums[slot] = s;
    if (inv_norm != nullptr) *inv_norm = 1.0 / fmax(sqrt(s), eps);
  }
}

__global__ void ScaleToBf16(float* __restrict__ x, __nv_bfloat16* __restrict__ xb, int64_t count,
                            const double* __restrict__ inv_norm) {
  const double k = *inv_norm;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += stride) {
    const float v = static_cast<float>(x[i] * k);
    x[i] = v;
    xb[i] = __float2bfloat16_rn(v);
  }
}

__global__ void ToBf16(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst,
                       int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += stride) {
    dst[i] = __float2bfloat16_rn(src[i]);
  }
}

__global__ void SplitBf16(const float* __restrict__ src, __nv_bfloat16* __restrict__ hi,
                          __nv_bfloat16* __restrict__ lo, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += stride) {
    const float v = src[i];
    const __nv_bfloat16 h = __float2bfloat16_rn(v);
    hi[i] = h;
    lo[i] = __float2bfloat16_rn(v - __bfloat162float(h));
  }
}

__global__ void AddToDiagonal(float* __restrict__ a, int64_t n, float value) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += stride) {
    a[i * (n + 1)] += value;
  }
}

// One 32 x 32 tile per block, 32 x 8 threads; the +1 column avoids shared
// memory bank conflicts.
__global__ void Transpose(const float* __restrict__ src, int64_t rows, int64_t cols,
                          float* __restrict__ dst) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  for (int dy = threadIdx.y; dy < kTile; dy += blockDim.y) {
    const int64_t r = r0 + dy, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[dy][threadIdx.x] = src[r * cols + c];
  }
  __syncthreads();
  for (int dy = threadIdx.y; dy < kTile; dy += blockDim.y) {
    const int64_t c = c0 + dy, r = r0 + threadIdx.x;  // dst row c, column r
    if (r < rows && c < cols) dst[c * rows + r] = tile[threadIdx.x][dy];
  }
}

}  // namespace

cudaError_t LaunchSumSquares(const float* x, int64_t count, double* partial, double* sums,
                             int slot, double eps, double* inv_norm, cudaStream_t stream) {
  SumSquaresStage1<<<kReduceBlocks, kThreads, 0, stream>>>(x, count, partial);
  SumSquaresStage2<<<1, kThreads, 0, stream>>>(partial, kReduceBlocks, sums, slot, eps, inv_norm);
  return cudaGetLastError();
}

cudaError_t LaunchScaleToBf16(float* x, __nv_bfloat16* xb, int64_t count, const double* inv_norm,
                              cudaStream_t stream) {
  ScaleToBf16<<<BlocksFor(count), kThreads, 0, stream>>>(x, xb, count, inv_norm);
  return cudaGetLastError();
}

cudaError_t LaunchToBf16(const float* src, __nv_bfloat16* dst, int64_t count,
                         cudaStream_t stream) {
  ToBf16<<<BlocksFor(count), kThreads, 0, stream>>>(src, dst, count);
  return cudaGetLastError();
}

cudaError_t LaunchSplitBf16(const float* src, __nv_bfloat16* hi, __nv_bfloat16* lo,
                            int64_t count, cudaStream_t stream) {
  SplitBf16<<<BlocksFor(count), kThreads, 0, stream>>>(src, hi, lo, count);
  return cudaGetLastError();
}

cudaError_t LaunchAddToDiagonal(float* a, int64_t n, float value, cudaStream_t stream) {
  AddToDiagonal<<<BlocksFor(n), kThreads, 0, stream>>>(a, n, value);
  return cudaGetLastError();
}

cudaError_t LaunchTranspose(const float* src, int64_t rows, int64_t cols, float* dst,
                            cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile),
                  static_cast<unsigned>((rows + kTile - 1) / kTile));
  Transpose<<<grid, dim3(kTile, 8), 0, stream>>>(src, rows, cols, dst);
  return cudaGetLastError();
}

}  // namespace muonmesh::cuda::internal
