#include "worker/cuda/optimizer_kernels.h"

#include <cmath>

#include "worker/cuda/grid.cuh"

namespace muonmesh::cuda::internal {
namespace {

// torch's lerp: w < 0.5 ? s + w (e - s) : e - (e - s)(1 - w), rounded step by
// step as the CPU code does.
__device__ __forceinline__ float Lerp(float s, float e, float w) {
  return fabsf(w) < 0.5f ? __fadd_rn(s, __fmul_rn(w, __fsub_rn(e, s)))
                         : __fsub_rn(e, __fmul_rn(__fsub_rn(e, s), __fsub_rn(1.0f, w)));
}

__device__ __forceinline__ void Flag(long long* bad, int64_t i) {
  atomicMin(bad, static_cast<long long>(i));
}

__global__ void AdamWKernel(AdamWScalars k, const float* __restrict__ grad,
                            float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                            float* __restrict__ param, int64_t count, bool commit,
                            long long* bad) {
  MUONMESH_GRID_STRIDE_LOOP(i, count) {
    const float g = grad[i];
    const float p = param[i];
    const float m = exp_avg[i];
    const float v = exp_avg_sq[i];
    // p * decay; lerp(m, g, 1 - beta1); v beta2 + ((1 - beta2) g) g;
    // sqrt(v') / bc2_sqrt + eps; p' + (neg_step m') / denom.
    const float p_decayed = __fmul_rn(p, k.decay);
    const float m_new = Lerp(m, g, k.one_minus_beta1);
    const float v_new =
        __fadd_rn(__fmul_rn(v, k.beta2), __fmul_rn(__fmul_rn(k.one_minus_beta2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v_new), k.bias_correction2_sqrt), k.eps);
    const float p_new = __fadd_rn(p_decayed, __fdiv_rn(__fmul_rn(k.neg_step_size, m_new), denom));
    if (!commit) {
      if (!isfinite(g) || !isfinite(p_new) || !isfinite(m_new) || !isfinite(v_new)) Flag(bad, i);
      continue;
    }
    param[i] = p_new;
    exp_avg[i] = m_new;
    exp_avg_sq[i] = v_new;
  }
}

__global__ void MuonPrepareKernel(MuonScalars k, const float* __restrict__ grad,
                                  const float* __restrict__ momentum,
                                  float* __restrict__ update, int64_t count, bool commit,
                                  long long* bad) {
  MUONMESH_GRID_STRIDE_LOOP(i, count) {
    const float g = grad[i];
    const float m = momentum[i];
    const float m_new = Lerp(m, g, k.one_minus_beta);
    const float u = k.nesterov ? Lerp(g, m_new, k.beta) : m_new;
    if (!commit) {
      // The CPU refuses non-finite inputs and a non-finite result (finite
      // extremes can overflow in e - s).
      if (!isfinite(g) || !isfinite(m) || !isfinite(u)) Flag(bad, i);
      continue;
    }
    update[i] = u;
  }
}

__global__ void MuonApplyKernel(MuonScalars k, const float* __restrict__ grad,
                                const float* __restrict__ orthogonalized,
                                float* __restrict__ momentum, float* __restrict__ param,
                                int64_t count, bool commit, long long* bad) {
  MUONMESH_GRID_STRIDE_LOOP(i, count) {
    const float o = orthogonalized[i];
    const float p_new = __fadd_rn(__fmul_rn(param[i], k.decay), __fmul_rn(k.step, o));
    const float m_new = Lerp(momentum[i], grad[i], k.one_minus_beta);
    if (!commit) {
      if (!isfinite(o) || !isfinite(p_new) || !isfinite(m_new)) Flag(bad, i);
      continue;
    }
    param[i] = p_new;
    momentum[i] = m_new;
  }
}

__global__ void FillKernel(float* __restrict__ dst, int64_t count, float value) {
  MUONMESH_GRID_STRIDE_LOOP(i, count) {
    dst[i] = value;
  }
}

__global__ void CheckFiniteKernel(const float* __restrict__ x, int64_t count, long long* bad) {
  MUONMESH_GRID_STRIDE_LOOP(i, count) {
    if (!isfinite(x[i])) Flag(bad, i);
  }
}

}  // namespace

cudaError_t LaunchCheckFinite(const float* x, int64_t count, long long* bad, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  CheckFiniteKernel<<<Blocks(count), kThreads, 0, stream>>>(x, count, bad);
  return cudaGetLastError();
}

cudaError_t LaunchFill(float* dst, int64_t count, float value, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  FillKernel<<<Blocks(count), kThreads, 0, stream>>>(dst, count, value);
  return cudaGetLastError();
}

cudaError_t LaunchAdamW(const AdamWScalars& k, const float* grad, float* exp_avg,
                        float* exp_avg_sq, float* param, int64_t count, bool commit,
                        long long* bad, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  AdamWKernel<<<Blocks(count), kThreads, 0, stream>>>(k, grad, exp_avg, exp_avg_sq, param, count,
                                                      commit, bad);
  return cudaGetLastError();
}

cudaError_t LaunchMuonPrepare(const MuonScalars& k, const float* grad, const float* momentum,
                              float* update, int64_t count, bool commit, long long* bad,
                              cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  MuonPrepareKernel<<<Blocks(count), kThreads, 0, stream>>>(k, grad, momentum, update, count,
                                                            commit, bad);
  return cudaGetLastError();
}

cudaError_t LaunchMuonApply(const MuonScalars& k, const float* grad, const float* orthogonalized,
                            float* momentum, float* param, int64_t count, bool commit,
                            long long* bad, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  MuonApplyKernel<<<Blocks(count), kThreads, 0, stream>>>(k, grad, orthogonalized, momentum,
                                                          param, count, commit, bad);
  return cudaGetLastError();
}

}  // namespace muonmesh::cuda::internal
