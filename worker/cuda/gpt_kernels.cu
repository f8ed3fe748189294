#include "worker/cuda/gpt_kernels.h"

#include <cfloat>

#include "worker/cuda/grid.cuh"
#include "worker/math/elementwise.h"

namespace muonmesh::cuda::internal {
namespace {

constexpr double kLayerNormEps = 1e-5;

// The block's sum of every thread's `v`: partials in shared memory, added as
// a tree with halving strides (kernels_cpu.cc transcribes this order).
// Every thread gets the total; `shared` may be reused after it returns.
__device__ double BlockSum(double v, double* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] = __dadd_rn(shared[threadIdx.x], shared[threadIdx.x + s]);
    __syncthreads();
  }
  const double total = shared[0];
  __syncthreads();
  return total;
}

// The block's maximum of every thread's `v` (order-free).
__device__ float BlockMax(float v, float* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] = fmaxf(shared[threadIdx.x], shared[threadIdx.x + s]);
    __syncthreads();
  }
  const float total = shared[0];
  __syncthreads();
  return total;
}

__global__ void EmbedKernel(const int32_t* __restrict__ windows, int64_t n, int64_t t_len,
                            int64_t c, const float* __restrict__ wte, const float* __restrict__ wpe,
                            float* __restrict__ x) {
  MUONMESH_GRID_STRIDE_LOOP(k, n * t_len * c) {
    const int64_t row = k / c;
    const int64_t i = k - row * c;
    const int64_t b = row / t_len;
    const int64_t t = row - b * t_len;
    const int64_t token = windows[b * (t_len + 1) + t];
    x[k] = __fadd_rn(wte[token * c + i], wpe[t * c + i]);
  }
}

__global__ void AddKernel(float* __restrict__ y, const float* __restrict__ x, int64_t count) {
  MUONMESH_GRID_STRIDE_LOOP(k, count) { y[k] = __fadd_rn(y[k], x[k]); }
}

__global__ void LayerNormKernel(const float* __restrict__ x, const float* __restrict__ w,
                                const float* __restrict__ b, int64_t c, float* __restrict__ y,
                                float* __restrict__ mean, float* __restrict__ rstd) {
  __shared__ double shared[kThreads];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * c;
  double local = 0.0;
  for (int64_t i = threadIdx.x; i < c; i += kThreads) local = __dadd_rn(local, xr[i]);
  const double m = __ddiv_rn(BlockSum(local, shared), static_cast<double>(c));
  local = 0.0;
  for (int64_t i = threadIdx.x; i < c; i += kThreads) {
    const double d = __dsub_rn(static_cast<double>(xr[i]), m);
    local = __dadd_rn(local, __dmul_rn(d, d));
  }
  const double var = __ddiv_rn(BlockSum(local, shared), static_cast<double>(c));
  const float mf = static_cast<float>(m);
  const float rf = static_cast<float>(__ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(var, kLayerNormEps))));
  float* yr = y + r * c;
  for (int64_t i = threadIdx.x; i < c; i += kThreads) {
    yr[i] = __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(xr[i], mf), rf), w[i]), b[i]);
  }
  if (threadIdx.x == 0) {
    mean[r] = mf;
    rstd[r] = rf;
  }
}

__global__ void LayerNormBackwardKernel(const float* __restrict__ x, const float* __restrict__ mean,
                                        const float* __restrict__ rstd, const float* __restrict__ w,
                                        const float* __restrict__ dy, int64_t c,
                                        float* __restrict__ dx) {
  __shared__ double shared[kThreads];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * c;
  const float* dyr = dy + r * c;
  const float mr = mean[r];
  const float rr = rstd[r];
  double sum_g = 0.0;
  double sum_gx = 0.0;
  for (int64_t i = threadIdx.x; i < c; i += kThreads) {
    const double xhat = __fmul_rn(__fsub_rn(xr[i], mr), rr);
    const double g = __fmul_rn(dyr[i], w[i]);
    sum_g = __dadd_rn(sum_g, g);
    sum_gx = __dadd_rn(sum_gx, __dmul_rn(g, xhat));
  }
  const double mean_g = __ddiv_rn(BlockSum(sum_g, shared), static_cast<double>(c));
  const double mean_gx = __ddiv_rn(BlockSum(sum_gx, shared), static_cast<double>(c));
  float* dxr = dx + r * c;
  for (int64_t i = threadIdx.x; i < c; i += kThreads) {
    const double xhat = __fmul_rn(__fsub_rn(xr[i], mr), rr);
    const double g = __fmul_rn(dyr[i], w[i]);
    const double v = __dmul_rn(static_cast<double>(rr),
                               __dsub_rn(__dsub_rn(g, mean_g), __dmul_rn(xhat, mean_gx)));
    dxr[i] = __fadd_rn(dxr[i], static_cast<float>(v));
  }
}

__global__ void LayerNormParamGradsKernel(const float* __restrict__ x,
                                          const float* __restrict__ mean,
                                          const float* __restrict__ rstd,
                                          const float* __restrict__ dy, int64_t rows, int64_t c,
                                          float* __restrict__ dw, float* __restrict__ db) {
  MUONMESH_GRID_STRIDE_LOOP(i, c) {
    double acc_w = 0.0;
    double acc_b = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      const double xhat = __fmul_rn(__fsub_rn(x[r * c + i], mean[r]), rstd[r]);
      const double d = dy[r * c + i];
      acc_w = __dadd_rn(acc_w, __dmul_rn(d, xhat));
      acc_b = __dadd_rn(acc_b, d);
    }
    dw[i] = static_cast<float>(acc_w);
    db[i] = static_cast<float>(acc_b);
  }
}

__global__ void GeluKernel(const float* __restrict__ x, float* __restrict__ y, int64_t count) {
  MUONMESH_GRID_STRIDE_LOOP(k, count) { y[k] = math::Gelu(x[k]); }
}

__global__ void GeluBackwardKernel(const float* __restrict__ x, float* __restrict__ d,
                                   int64_t count) {
  MUONMESH_GRID_STRIDE_LOOP(k, count) { d[k] = d[k] * math::GeluSlope(x[k]); }
}

__global__ void CausalSoftmaxKernel(float* __restrict__ s, int64_t t_len) {
  __shared__ double shared[kThreads];
  __shared__ float shared_max[kThreads];
  const int64_t r = blockIdx.x;
  const int64_t t = r % t_len;
  float* row = s + r * t_len;
  float local_max = -FLT_MAX;
  for (int64_t j = threadIdx.x; j <= t; j += kThreads) local_max = fmaxf(local_max, row[j]);
  const float max = BlockMax(local_max, shared_max);
  double local = 0.0;
  for (int64_t j = threadIdx.x; j <= t; j += kThreads) {
    local = __dadd_rn(local, static_cast<double>(math::ExpF(row[j] - max)));
  }
  const double sum = BlockSum(local, shared);
  for (int64_t j = threadIdx.x; j < t_len; j += kThreads) {
    row[j] = j <= t ? static_cast<float>(
                          __ddiv_rn(static_cast<double>(math::ExpF(row[j] - max)), sum))
                    : 0.0f;
  }
}

__global__ void CausalSoftmaxBackwardKernel(const float* __restrict__ p, float* __restrict__ d,
                                            int64_t t_len) {
  __shared__ double shared[kThreads];
  const int64_t r = blockIdx.x;
  const int64_t t = r % t_len;
  const float* pr = p + r * t_len;
  float* dr = d + r * t_len;
  double local = 0.0;
  for (int64_t j = threadIdx.x; j <= t; j += kThreads) {
    local = __dadd_rn(local, __dmul_rn(static_cast<double>(pr[j]), static_cast<double>(dr[j])));
  }
  const double dot = BlockSum(local, shared);
  for (int64_t j = threadIdx.x; j < t_len; j += kThreads) {
    dr[j] = j <= t ? static_cast<float>(__dmul_rn(static_cast<double>(pr[j]),
                                                  __dsub_rn(static_cast<double>(dr[j]), dot)))
                   : 0.0f;
  }
}

__global__ void CrossEntropyKernel(float* __restrict__ logits, const int32_t* __restrict__ windows,
                                   int64_t t_len, int64_t v, double denom, bool gradients,
                                   double* __restrict__ row_loss) {
  __shared__ double shared[kThreads];
  __shared__ float shared_max[kThreads];
  const int64_t r = blockIdx.x;
  const int64_t target = windows[(r / t_len) * (t_len + 1) + r % t_len + 1];
  float* row = logits + r * v;
  // Read before any thread overwrites the row with its gradient.
  const float target_logit = row[target];
  float local_max = -FLT_MAX;
  for (int64_t j = threadIdx.x; j < v; j += kThreads) local_max = fmaxf(local_max, row[j]);
  const float max = BlockMax(local_max, shared_max);
  double local = 0.0;
  for (int64_t j = threadIdx.x; j < v; j += kThreads) {
    local = __dadd_rn(local, static_cast<double>(math::ExpF(row[j] - max)));
  }
  const double sum = BlockSum(local, shared);
  if (threadIdx.x == 0) {
    row_loss[r] = __dsub_rn(__dadd_rn(static_cast<double>(max), log(sum)),
                            static_cast<double>(target_logit));
  }
  if (!gradients) return;
  for (int64_t j = threadIdx.x; j < v; j += kThreads) {
    const double prob = __ddiv_rn(static_cast<double>(math::ExpF(row[j] - max)), sum);
    row[j] = static_cast<float>(__ddiv_rn(__dsub_rn(prob, j == target ? 1.0 : 0.0), denom));
  }
}

__global__ void EmbedBackwardKernel(const int32_t* __restrict__ windows, int64_t n, int64_t t_len,
                                    int64_t c, const float* __restrict__ dx,
                                    float* __restrict__ dwte) {
  MUONMESH_GRID_STRIDE_LOOP(i, c) {
    for (int64_t b = 0; b < n; ++b) {
      for (int64_t t = 0; t < t_len; ++t) {
        float* te = dwte + static_cast<int64_t>(windows[b * (t_len + 1) + t]) * c + i;
        *te = __fadd_rn(*te, dx[(b * t_len + t) * c + i]);
      }
    }
  }
}

__global__ void PositionGradsKernel(const float* __restrict__ dx, int64_t n, int64_t t_len,
                                    int64_t c, int64_t block_size, float* __restrict__ dwpe) {
  MUONMESH_GRID_STRIDE_LOOP(k, block_size * c) {
    const int64_t t = k / c;
    const int64_t i = k - t * c;
    double acc = 0.0;
    if (t < t_len) {
      for (int64_t b = 0; b < n; ++b) acc = __dadd_rn(acc, dx[(b * t_len + t) * c + i]);
    }
    dwpe[k] = static_cast<float>(acc);
  }
}

// A launch of one block per row: `rows` must fit the grid's x dimension.
bool RowsFitGrid(int64_t rows) { return rows <= 0x7fffffff; }

}  // namespace

cudaError_t LaunchGptEmbed(const int32_t* windows, int64_t n, int64_t t_len, int64_t c,
                           const float* wte, const float* wpe, float* x, cudaStream_t stream) {
  if (n * t_len * c <= 0) return cudaSuccess;
  EmbedKernel<<<Blocks(n * t_len * c), kThreads, 0, stream>>>(windows, n, t_len, c, wte, wpe, x);
  return cudaGetLastError();
}

cudaError_t LaunchAddInPlace(float* y, const float* x, int64_t count, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  AddKernel<<<Blocks(count), kThreads, 0, stream>>>(y, x, count);
  return cudaGetLastError();
}

cudaError_t LaunchLayerNorm(const float* x, const float* w, const float* b, int64_t rows,
                            int64_t c, float* y, float* mean, float* rstd, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (!RowsFitGrid(rows)) return cudaErrorInvalidConfiguration;
  LayerNormKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, w, b, c, y, mean, rstd);
  return cudaGetLastError();
}

cudaError_t LaunchLayerNormBackward(const float* x, const float* mean, const float* rstd,
                                    const float* w, const float* dy, int64_t rows, int64_t c,
                                    float* dx, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (!RowsFitGrid(rows)) return cudaErrorInvalidConfiguration;
  LayerNormBackwardKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, mean, rstd, w,
                                                                               dy, c, dx);
  return cudaGetLastError();
}

cudaError_t LaunchLayerNormParamGrads(const float* x, const float* mean, const float* rstd,
                                      const float* dy, int64_t rows, int64_t c, float* dw,
                                      float* db, cudaStream_t stream) {
  if (c <= 0) return cudaSuccess;
  LayerNormParamGradsKernel<<<Blocks(c), kThreads, 0, stream>>>(x, mean, rstd, dy, rows, c, dw,
                                                                db);
  return cudaGetLastError();
}

cudaError_t LaunchGelu(const float* x, float* y, int64_t count, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  GeluKernel<<<Blocks(count), kThreads, 0, stream>>>(x, y, count);
  return cudaGetLastError();
}

cudaError_t LaunchGeluBackward(const float* x, float* d, int64_t count, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  GeluBackwardKernel<<<Blocks(count), kThreads, 0, stream>>>(x, d, count);
  return cudaGetLastError();
}

cudaError_t LaunchCausalSoftmax(float* s, int64_t rows, int64_t t_len, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (!RowsFitGrid(rows)) return cudaErrorInvalidConfiguration;
  CausalSoftmaxKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(s, t_len);
  return cudaGetLastError();
}

cudaError_t LaunchCausalSoftmaxBackward(const float* p, float* d, int64_t rows, int64_t t_len,
                                        cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (!RowsFitGrid(rows)) return cudaErrorInvalidConfiguration;
  CausalSoftmaxBackwardKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(p, d, t_len);
  return cudaGetLastError();
}

cudaError_t LaunchCrossEntropy(float* logits, const int32_t* windows, int64_t n, int64_t t_len,
                               int64_t v, double denom, bool gradients, double* row_loss,
                               cudaStream_t stream) {
  if (n * t_len <= 0) return cudaSuccess;
  if (!RowsFitGrid(n * t_len)) return cudaErrorInvalidConfiguration;
  CrossEntropyKernel<<<static_cast<unsigned>(n * t_len), kThreads, 0, stream>>>(
      logits, windows, t_len, v, denom, gradients, row_loss);
  return cudaGetLastError();
}

cudaError_t LaunchGptEmbedBackward(const int32_t* windows, int64_t n, int64_t t_len, int64_t c,
                                   const float* dx, float* dwte, cudaStream_t stream) {
  if (c <= 0) return cudaSuccess;
  EmbedBackwardKernel<<<Blocks(c), kThreads, 0, stream>>>(windows, n, t_len, c, dx, dwte);
  return cudaGetLastError();
}

cudaError_t LaunchPositionGrads(const float* dx, int64_t n, int64_t t_len, int64_t c,
                                int64_t block_size, float* dwpe, cudaStream_t stream) {
  if (block_size * c <= 0) return cudaSuccess;
  PositionGradsKernel<<<Blocks(block_size * c), kThreads, 0, stream>>>(dx, n, t_len, c,
                                                                       block_size, dwpe);
  return cudaGetLastError();
}

}  // namespace muonmesh::cuda::internal
