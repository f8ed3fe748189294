// The kernels of worker/cuda/*_kernels.cu on the CPU, for the stand-in
// (README.md in this folder): element by element, with the same arithmetic
// in the same order (each __fadd_rn / __dmul_rn as one rounded operation;
// compiled with -ffp-contract=off), block reductions in the kernels' tree
// order, and each checking that it reads and writes inside device memory,
// as a kernel must (cudaErrorIllegalAddress otherwise). tanhf is the host's.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "worker/cuda/mlp_kernels.h"
#include "worker/cuda/ns_kernels.h"
#include "worker/cuda/optimizer_kernels.h"
#include "worker/cuda/uniform_kernels.h"

namespace {

using cuda_cpu::Fits;
using cuda_cpu::Overlaps;

// The largest row index in rows[0, n) plus one, or -1 when one is negative
// or too large to address (rows is device memory the caller has checked).
int64_t RowsSpanned(const int64_t* rows, int64_t n) {
  int64_t top = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < 0 || rows[i] >= (int64_t{1} << 40)) return -1;
    top = std::max(top, rows[i] + 1);
  }
  return top;
}

// True when rows[0, n) (all within [0, top)) repeats a row: scattering to
// one row twice is a data race in the CUDA kernels (mlp_kernels.h asks for
// distinct rows), which the sequential loops here would hide.
bool RepeatsARow(const int64_t* rows, int64_t n, int64_t top) {
  std::vector<bool> seen(static_cast<size_t>(top));
  for (int64_t i = 0; i < n; ++i) {
    if (seen[static_cast<size_t>(rows[i])]) return true;
    seen[static_cast<size_t>(rows[i])] = true;
  }
  return false;
}

// torch's lerp as the CUDA kernels write it, one rounding per operation.
float Lerp(float s, float e, float w) {
  return std::fabs(w) < 0.5f ? s + w * (e - s) : e - (e - s) * (1.0f - w);
}

void Flag(long long* bad, int64_t i) { *bad = std::min(*bad, static_cast<long long>(i)); }

}  // namespace

namespace muonmesh::cuda::internal {

cudaError_t LaunchCheckFinite(const float* x, int64_t count, long long* bad, cudaStream_t) {
  if (count <= 0) return cudaSuccess;
  if (!Fits(x, count) || !Fits(bad, 1)) return cudaErrorIllegalAddress;
  for (int64_t i = 0; i < count; ++i) {
    if (!std::isfinite(x[i])) Flag(bad, i);
  }
  return cudaSuccess;
}

cudaError_t LaunchFill(float* dst, int64_t count, float value, cudaStream_t) {
  if (count <= 0) return cudaSuccess;
  if (!Fits(dst, count)) return cudaErrorIllegalAddress;
  std::fill(dst, dst + count, value);
  return cudaSuccess;
}

cudaError_t LaunchAdamW(const AdamWScalars& k, const float* grad, float* exp_avg,
                        float* exp_avg_sq, float* param, int64_t count, bool commit,
                        long long* bad, cudaStream_t) {
  if (count <= 0) return cudaSuccess;
  if (!Fits(grad, count) || !Fits(exp_avg, count) || !Fits(exp_avg_sq, count) ||
      !Fits(param, count) || (!commit && !Fits(bad, 1))) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t i = 0; i < count; ++i) {
    const float g = grad[i], p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    const float p_decayed = p * k.decay;
    const float m_new = Lerp(m, g, k.one_minus_beta1);
    const float v_new = v * k.beta2 + (k.one_minus_beta2 * g) * g;
    const float denom = std::sqrt(v_new) / k.bias_correction2_sqrt + k.eps;
    const float p_new = p_decayed + (k.neg_step_size * m_new) / denom;
    if (!commit) {
      if (!std::isfinite(g) || !std::isfinite(p_new) || !std::isfinite(m_new) ||
          !std::isfinite(v_new)) {
        Flag(bad, i);
      }
      continue;
    }
    param[i] = p_new;
    exp_avg[i] = m_new;
    exp_avg_sq[i] = v_new;
  }
  return cudaSuccess;
}

cudaError_t LaunchMuonPrepare(const MuonScalars& k, const float* grad, const float* momentum,
                              float* update, int64_t count, bool commit, long long* bad,
                              cudaStream_t) {
  if (count <= 0) return cudaSuccess;
  if (!Fits(grad, count) || !Fits(momentum, count) || !Fits(update, count) ||
      (!commit && !Fits(bad, 1))) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t i = 0; i < count; ++i) {
    const float g = grad[i], m = momentum[i];
    const float m_new = Lerp(m, g, k.one_minus_beta);
    const float u = k.nesterov ? Lerp(g, m_new, k.beta) : m_new;
    if (!commit) {
      if (!std::isfinite(g) || !std::isfinite(m) || !std::isfinite(u)) Flag(bad, i);
      continue;
    }
    update[i] = u;
  }
  return cudaSuccess;
}

cudaError_t LaunchMuonApply(const MuonScalars& k, const float* grad, const float* orthogonalized,
                            float* momentum, float* param, int64_t count, bool commit,
                            long long* bad, cudaStream_t) {
  if (count <= 0) return cudaSuccess;
  if (!Fits(grad, count) || !Fits(orthogonalized, count) || !Fits(momentum, count) ||
      !Fits(param, count) || (!commit && !Fits(bad, 1))) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t i = 0; i < count; ++i) {
    const float o = orthogonalized[i];
    const float p_new = param[i] * k.decay + k.step * o;
    const float m_new = Lerp(momentum[i], grad[i], k.one_minus_beta);
    if (!commit) {
      if (!std::isfinite(o) || !std::isfinite(p_new) || !std::isfinite(m_new)) Flag(bad, i);
      continue;
    }
    param[i] = p_new;
    momentum[i] = m_new;
  }
  return cudaSuccess;
}

cudaError_t LaunchUniformFill(uint64_t key, uint64_t first, int64_t count, double factor,
                              float* out, cudaStream_t) {
  if (count <= 0) return cudaSuccess;
  if (!Fits(out, count)) return cudaErrorIllegalAddress;
  for (int64_t i = 0; i < count; ++i) {
    uint64_t z = (key ^ (first + static_cast<uint64_t>(i))) + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    const uint64_t bits = z ^ (z >> 31);
    const float u = static_cast<float>(static_cast<int64_t>(bits >> 40) - (int64_t{1} << 23)) *
                    (1.0f / 8388608.0f);
    out[i] = static_cast<float>(static_cast<double>(u) * factor);
  }
  return cudaSuccess;
}

cudaError_t LaunchGatherRows(const float* src, const int64_t* rows, int64_t n, int64_t width,
                             float* dst, cudaStream_t stream) {
  return LaunchGatherRowsStrided(src, width, 0, rows, n, width, dst, stream);
}

cudaError_t LaunchBiasActivate(float* z, const float* b, int64_t n, int64_t width, bool activate,
                               cudaStream_t) {
  if (n * width <= 0) return cudaSuccess;
  if (!Fits(z, n * width) || !Fits(b, width)) return cudaErrorIllegalAddress;
  for (int64_t k = 0; k < n * width; ++k) {
    const float v = z[k] + b[k % width];
    z[k] = activate ? std::tanh(v) : v;
  }
  return cudaSuccess;
}

// kLossBlocks blocks of 256 threads: each thread sums its grid-stride share,
// each block reduces its threads in the kernel's tree order into partial.
cudaError_t LaunchOutputDelta(const float* y, const float* targets, const int64_t* rows, int64_t n,
                              int64_t width, double denom, float* delta, double* partial,
                              cudaStream_t) {
  constexpr int kThreads = 256;
  const int64_t total = n * width;
  if (!Fits(y, total) || !Fits(delta, total) || !Fits(rows, n) || !Fits(partial, kLossBlocks)) {
    return cudaErrorIllegalAddress;
  }
  const int64_t top = RowsSpanned(rows, n);
  if (top < 0 || !Fits(targets, top * width)) return cudaErrorIllegalAddress;
  const int64_t stride = static_cast<int64_t>(kLossBlocks) * kThreads;
  std::vector<double> sums(kThreads);
  for (int b = 0; b < kLossBlocks; ++b) {
    for (int t = 0; t < kThreads; ++t) {
      double local = 0.0;
      for (int64_t k = static_cast<int64_t>(b) * kThreads + t; k < total; k += stride) {
        const int64_t r = k / width;
        const float target = targets[rows[r] * width + (k - r * width)];
        const double d = static_cast<double>(y[k]) - static_cast<double>(target);
        local = local + d * d;
        delta[k] = static_cast<float>((d * 2.0) / denom);
      }
      sums[t] = local;
    }
    for (int s = kThreads / 2; s > 0; s >>= 1) {
      for (int t = 0; t < s; ++t) sums[t] += sums[t + s];
    }
    partial[b] = sums[0];
  }
  return cudaSuccess;
}

cudaError_t LaunchColumnSums(const float* x, int64_t n, int64_t width, float* out, cudaStream_t) {
  if (width <= 0) return cudaSuccess;
  if (!Fits(x, n * width) || !Fits(out, width)) return cudaErrorIllegalAddress;
  for (int64_t c = 0; c < width; ++c) {
    double s = 0.0;
    for (int64_t r = 0; r < n; ++r) s = s + static_cast<double>(x[r * width + c]);
    out[c] = static_cast<float>(s);
  }
  return cudaSuccess;
}

cudaError_t LaunchTanhBackward(float* delta, const float* h, int64_t count, cudaStream_t) {
  if (count <= 0) return cudaSuccess;
  if (!Fits(delta, count) || !Fits(h, count)) return cudaErrorIllegalAddress;
  for (int64_t k = 0; k < count; ++k) delta[k] = delta[k] * (1.0f - h[k] * h[k]);
  return cudaSuccess;
}

cudaError_t LaunchGatherRowsStrided(const float* src, int64_t src_stride, int64_t src_offset,
                                    const int64_t* rows, int64_t n, int64_t width, float* dst,
                                    cudaStream_t) {
  if (n * width <= 0) return cudaSuccess;
  if (!Fits(rows, n) || !Fits(dst, n * width)) return cudaErrorIllegalAddress;
  const int64_t top = RowsSpanned(rows, n);
  if (top < 0 || src_offset < 0 ||
      (top > 0 && !Fits(src, (top - 1) * src_stride + src_offset + width))) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t k = 0; k < n * width; ++k) {
    const int64_t i = k / width;
    dst[k] = src[rows[i] * src_stride + src_offset + (k - i * width)];
  }
  return cudaSuccess;
}

namespace {

cudaError_t ScatterRows(const float* src, const int64_t* rows, int64_t n, int64_t width,
                        float* dst, bool add) {
  if (n * width <= 0) return cudaSuccess;
  if (!Fits(src, n * width) || !Fits(rows, n)) return cudaErrorIllegalAddress;
  const int64_t top = RowsSpanned(rows, n);
  if (top < 0 || !Fits(dst, top * width)) return cudaErrorIllegalAddress;
  if (RepeatsARow(rows, n, top)) return cudaErrorInvalidValue;
  for (int64_t k = 0; k < n * width; ++k) {
    const int64_t i = k / width;
    float* d = dst + rows[i] * width + (k - i * width);
    *d = add ? *d + src[k] : src[k];
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t LaunchScatterRows(const float* src, const int64_t* rows, int64_t n, int64_t width,
                              float* dst, cudaStream_t) {
  return ScatterRows(src, rows, n, width, dst, false);
}

cudaError_t LaunchScatterAddRows(const float* src, const int64_t* rows, int64_t n, int64_t width,
                                 float* dst, cudaStream_t) {
  return ScatterRows(src, rows, n, width, dst, true);
}

cudaError_t LaunchPackTokens(const float* src, const int64_t* rows, const float* ids, int64_t n,
                             int64_t width, float* dst, cudaStream_t) {
  if (n <= 0) return cudaSuccess;
  const int64_t row = width + 1;
  if (!Fits(rows, n) || !Fits(ids, n) || !Fits(dst, n * row)) return cudaErrorIllegalAddress;
  const int64_t top = RowsSpanned(rows, n);
  if (top < 0 || !Fits(src, top * width)) return cudaErrorIllegalAddress;
  for (int64_t k = 0; k < n * row; ++k) {
    const int64_t j = k / row;
    const int64_t c = k - j * row;
    dst[k] = c == 0 ? ids[j] : src[rows[j] * width + (c - 1)];
  }
  return cudaSuccess;
}

cudaError_t LaunchGatherScaledRows(const float* src, const float* scale, const int64_t* rows,
                                   int64_t n, int64_t width, float* dst, cudaStream_t) {
  if (n * width <= 0) return cudaSuccess;
  const int64_t top = Fits(rows, n) ? RowsSpanned(rows, n) : -1;
  if (top < 0 || !Fits(dst, n * width) || !Fits(scale, top) || !Fits(src, top * width)) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t k = 0; k < n * width; ++k) {
    const int64_t j = k / width;
    const int64_t s = rows[j];
    dst[k] = scale[s] * src[s * width + (k - j * width)];
  }
  return cudaSuccess;
}

cudaError_t LaunchGatedResidual(const float* h, const float* gate, const float* o, int64_t n,
                                int64_t width, float* z, cudaStream_t) {
  if (n * width <= 0) return cudaSuccess;
  if (!Fits(h, n * width) || !Fits(gate, n) || !Fits(o, n * width) || !Fits(z, n * width)) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t k = 0; k < n * width; ++k) z[k] = h[k] + gate[k / width] * o[k];
  return cudaSuccess;
}

cudaError_t LaunchRowDots(const float* a, const float* b, int64_t n, int64_t width, double* out,
                          cudaStream_t) {
  if (n <= 0) return cudaSuccess;
  if (!Fits(a, n * width) || !Fits(b, n * width) || !Fits(out, n)) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t s = 0; s < n; ++s) {
    double sum = 0.0;
    for (int64_t k = 0; k < width; ++k) {
      sum = sum + static_cast<double>(a[s * width + k]) * static_cast<double>(b[s * width + k]);
    }
    out[s] = sum;
  }
  return cudaSuccess;
}

cudaError_t LaunchTanh(float* x, int64_t count, cudaStream_t) {
  if (count <= 0) return cudaSuccess;
  if (!Fits(x, count)) return cudaErrorIllegalAddress;
  for (int64_t k = 0; k < count; ++k) x[k] = std::tanh(x[k]);
  return cudaSuccess;
}

}  // namespace muonmesh::cuda::internal

// ns_kernels.cu (the sums of squares in double, in one order).
namespace muonmesh::cuda::internal {

cudaError_t LaunchSumSquares(const float* x, int64_t count, double* partial, double* sums,
                             int slot, double eps, double* inv_norm, cudaStream_t) {
  if (!Fits(x, count) || !Fits(partial, kReduceBlocks) || !Fits(sums, slot + 1) ||
      (inv_norm != nullptr && !Fits(inv_norm, 1))) {
    return cudaErrorIllegalAddress;
  }
  // Stage 1: kReduceBlocks blocks of 256 threads, each thread over its
  // grid-stride share, each block's threads summed in the tree order; stage
  // 2: one block of 256 threads over the partials, then the tree.
  constexpr int kThreads = 256;
  const auto tree = [](std::vector<double>& v) {
    for (int stride = kThreads / 2; stride > 0; stride /= 2) {
      for (int t = 0; t < stride; ++t) v[t] += v[t + stride];
    }
    return v[0];
  };
  std::vector<double> lane(kThreads);
  const int64_t grid = static_cast<int64_t>(kReduceBlocks) * kThreads;
  for (int b = 0; b < kReduceBlocks; ++b) {
    for (int t = 0; t < kThreads; ++t) {
      double s = 0.0;
      for (int64_t i = static_cast<int64_t>(b) * kThreads + t; i < count; i += grid) {
        const double v = x[i];
        s += v * v;
      }
      lane[t] = s;
    }
    partial[b] = tree(lane);
  }
  for (int t = 0; t < kThreads; ++t) {
    double s = 0.0;
    for (int i = t; i < kReduceBlocks; i += kThreads) s += partial[i];
    lane[t] = s;
  }
  const double s = tree(lane);
  sums[slot] = s;
  if (inv_norm != nullptr) *inv_norm = 1.0 / std::fmax(std::sqrt(s), eps);
  return cudaSuccess;
}

cudaError_t LaunchScaleToBf16(float* x, __nv_bfloat16* xb, int64_t count, const double* inv_norm,
                              cudaStream_t) {
  if (!Fits(x, count) ||
      !Fits(xb, count) ||
      !Fits(inv_norm, 1)) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t i = 0; i < count; ++i) {
    x[i] = static_cast<float>(x[i] * *inv_norm);
    xb[i] = __float2bfloat16_rn(x[i]);
  }
  return cudaSuccess;
}

cudaError_t LaunchToBf16(const float* src, __nv_bfloat16* dst, int64_t count, cudaStream_t) {
  if (!Fits(src, count) ||
      !Fits(dst, count)) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t i = 0; i < count; ++i) dst[i] = __float2bfloat16_rn(src[i]);
  return cudaSuccess;
}

cudaError_t LaunchSplitBf16(const float* src, __nv_bfloat16* hi, __nv_bfloat16* lo,
                            int64_t count, cudaStream_t) {
  if (!Fits(src, count) || !Fits(hi, count) || !Fits(lo, count)) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t i = 0; i < count; ++i) {
    hi[i] = __float2bfloat16_rn(src[i]);
    lo[i] = __float2bfloat16_rn(src[i] - __bfloat162float(hi[i]));
  }
  return cudaSuccess;
}

cudaError_t LaunchAddToDiagonal(float* a, int64_t n, float value, cudaStream_t) {
  if (!Fits(a, n * n)) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t i = 0; i < n; ++i) a[i * (n + 1)] += value;
  return cudaSuccess;
}

cudaError_t LaunchTranspose(const float* src, int64_t rows, int64_t cols, float* dst,
                            cudaStream_t) {
  // The kernel's grid: cols / 32 by rows / 32 blocks, at most 65535 in y.
  if (rows <= 0 || cols <= 0 || (rows + 31) / 32 > 65535) return cudaErrorInvalidConfiguration;
  const size_t bytes = static_cast<size_t>(rows * cols) * sizeof(float);
  if (!cuda_cpu::InDevice(src, bytes) || !cuda_cpu::InDevice(dst, bytes) ||
      Overlaps(src, bytes, dst, bytes)) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
  }
  return cudaSuccess;
}

}  // namespace muonmesh::cuda::internal
