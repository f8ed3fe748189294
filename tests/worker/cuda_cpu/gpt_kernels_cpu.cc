// The kernels of worker/cuda/gpt_kernels.cu on the CPU, for the stand-in
// (README.md in this folder): the same arithmetic in the same order (one
// rounding per operation, -ffp-contract=off), a block's reductions as the
// kernels' kThreads partials added in their tree order, and every read and
// write checked to lie in device memory (cudaErrorIllegalAddress
// otherwise), a token's embedding row included. log is the host's; ExpF,
// Gelu and GeluSlope the shared worker/math/elementwise.h.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "worker/cuda/gpt_kernels.h"
#include "worker/math/elementwise.h"

namespace {

using cuda_cpu::Fits;

constexpr int kThreads = 256;  // worker/cuda/grid.cuh
constexpr double kLayerNormEps = 1e-5;

// A block's sum over elements [0, count) of `term`: thread j's partial over
// j, j + kThreads, ..., then the tree with halving strides.
template <typename Term>
double BlockSum(int64_t count, Term term) {
  std::array<double, kThreads> part{};
  for (int j = 0; j < kThreads; ++j) {
    for (int64_t i = j; i < count; i += kThreads) part[j] += term(i);
  }
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    for (int j = 0; j < s; ++j) part[j] += part[j + s];
  }
  return part[0];
}

float RowMax(const float* row, int64_t count) {
  float m = -FLT_MAX;
  for (int64_t j = 0; j < count; ++j) m = std::max(m, row[j]);
  return m;
}

bool RowsFitGrid(int64_t rows) { return rows <= 0x7fffffff; }

// Every token of windows [n, T + 1] names a row of c floats inside `table`'s
// allocation.
bool TokensFit(const int32_t* windows, int64_t n, int64_t t_len, const float* table, int64_t c) {
  for (int64_t k = 0; k < n * (t_len + 1); ++k) {
    if (windows[k] < 0 || !Fits(table + static_cast<int64_t>(windows[k]) * c, c)) return false;
  }
  return true;
}

}  // namespace

namespace muonmesh::cuda::internal {

cudaError_t LaunchGptEmbed(const int32_t* windows, int64_t n, int64_t t_len, int64_t c,
                           const float* wte, const float* wpe, float* x, cudaStream_t) {
  if (n * t_len * c <= 0) return cudaSuccess;
  if (!Fits(windows, n * (t_len + 1)) || !TokensFit(windows, n, t_len, wte, c) ||
      !Fits(wpe, t_len * c) || !Fits(x, n * t_len * c)) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t b = 0; b < n; ++b) {
    for (int64_t t = 0; t < t_len; ++t) {
      const float* te = wte + static_cast<int64_t>(windows[b * (t_len + 1) + t]) * c;
      float* row = x + (b * t_len + t) * c;
      for (int64_t i = 0; i < c; ++i) row[i] = te[i] + wpe[t * c + i];
    }
  }
  return cudaSuccess;
}

cudaError_t LaunchAddInPlace(float* y, const float* x, int64_t count, cudaStream_t) {
  if (count <= 0) return cudaSuccess;
  if (!Fits(y, count) || !Fits(x, count)) return cudaErrorIllegalAddress;
  for (int64_t k = 0; k < count; ++k) y[k] += x[k];
  return cudaSuccess;
}

cudaError_t LaunchLayerNorm(const float* x, const float* w, const float* b, int64_t rows, int64_t c,
                            float* y, float* mean, float* rstd, cudaStream_t) {
  if (rows <= 0) return cudaSuccess;
  if (!RowsFitGrid(rows)) return cudaErrorInvalidConfiguration;
  if (!Fits(x, rows * c) || !Fits(w, c) || !Fits(b, c) || !Fits(y, rows * c) || !Fits(mean, rows) ||
      !Fits(rstd, rows)) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * c;
    const double m =
        BlockSum(c, [&](int64_t i) { return static_cast<double>(xr[i]); }) / static_cast<double>(c);
    const double var = BlockSum(c,
                                [&](int64_t i) {
                                  const double d = static_cast<double>(xr[i]) - m;
                                  return d * d;
                                }) /
                       static_cast<double>(c);
    const float mf = static_cast<float>(m);
    const float rf = static_cast<float>(1.0 / std::sqrt(var + kLayerNormEps));
    for (int64_t i = 0; i < c; ++i) y[r * c + i] = (xr[i] - mf) * rf * w[i] + b[i];
    mean[r] = mf;
    rstd[r] = rf;
  }
  return cudaSuccess;
}

cudaError_t LaunchLayerNormBackward(const float* x, const float* mean, const float* rstd,
                                    const float* w, const float* dy, int64_t rows, int64_t c,
                                    float* dx, cudaStream_t) {
  if (rows <= 0) return cudaSuccess;
  if (!RowsFitGrid(rows)) return cudaErrorInvalidConfiguration;
  if (!Fits(x, rows * c) || !Fits(mean, rows) || !Fits(rstd, rows) || !Fits(w, c) ||
      !Fits(dy, rows * c) || !Fits(dx, rows * c)) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * c;
    const float* dyr = dy + r * c;
    auto xhat = [&](int64_t i) { return static_cast<double>((xr[i] - mean[r]) * rstd[r]); };
    auto g = [&](int64_t i) { return static_cast<double>(dyr[i] * w[i]); };
    const double mean_g = BlockSum(c, g) / static_cast<double>(c);
    const double mean_gx =
        BlockSum(c, [&](int64_t i) { return g(i) * xhat(i); }) / static_cast<double>(c);
    for (int64_t i = 0; i < c; ++i) {
      const double v = static_cast<double>(rstd[r]) * ((g(i) - mean_g) - xhat(i) * mean_gx);
      dx[r * c + i] += static_cast<float>(v);
    }
  }
  return cudaSuccess;
}

cudaError_t LaunchLayerNormParamGrads(const float* x, const float* mean, const float* rstd,
                                      const float* dy, int64_t rows, int64_t c, float* dw,
                                      float* db, cudaStream_t) {
  if (c <= 0) return cudaSuccess;
  if (!Fits(x, rows * c) || !Fits(mean, rows) || !Fits(rstd, rows) || !Fits(dy, rows * c) ||
      !Fits(dw, c) || !Fits(db, c)) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t i = 0; i < c; ++i) {
    double acc_w = 0.0;
    double acc_b = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      const double xhat = static_cast<double>((x[r * c + i] - mean[r]) * rstd[r]);
      const double d = dy[r * c + i];
      acc_w += d * xhat;
      acc_b += d;
    }
    dw[i] = static_cast<float>(acc_w);
    db[i] = static_cast<float>(acc_b);
  }
  return cudaSuccess;
}

cudaError_t LaunchGelu(const float* x, float* y, int64_t count, cudaStream_t) {
  if (count <= 0) return cudaSuccess;
  if (!Fits(x, count) || !Fits(y, count)) return cudaErrorIllegalAddress;
  for (int64_t k = 0; k < count; ++k) y[k] = muonmesh::math::Gelu(x[k]);
  return cudaSuccess;
}

cudaError_t LaunchGeluBackward(const float* x, float* d, int64_t count, cudaStream_t) {
  if (count <= 0) return cudaSuccess;
  if (!Fits(x, count) || !Fits(d, count)) return cudaErrorIllegalAddress;
  for (int64_t k = 0; k < count; ++k) d[k] = d[k] * muonmesh::math::GeluSlope(x[k]);
  return cudaSuccess;
}

cudaError_t LaunchCausalSoftmax(float* s, int64_t rows, int64_t t_len, cudaStream_t) {
  if (rows <= 0) return cudaSuccess;
  if (!RowsFitGrid(rows)) return cudaErrorInvalidConfiguration;
  if (!Fits(s, rows * t_len)) return cudaErrorIllegalAddress;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r % t_len;
    float* row = s + r * t_len;
    const float max = RowMax(row, t + 1);
    auto e = [&](int64_t j) { return static_cast<double>(muonmesh::math::ExpF(row[j] - max)); };
    const double sum = BlockSum(t + 1, e);
    for (int64_t j = 0; j < t_len; ++j) row[j] = j <= t ? static_cast<float>(e(j) / sum) : 0.0f;
  }
  return cudaSuccess;
}

cudaError_t LaunchCausalSoftmaxBackward(const float* p, float* d, int64_t rows, int64_t t_len,
                                        cudaStream_t) {
  if (rows <= 0) return cudaSuccess;
  if (!RowsFitGrid(rows)) return cudaErrorInvalidConfiguration;
  if (!Fits(p, rows * t_len) || !Fits(d, rows * t_len)) return cudaErrorIllegalAddress;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r % t_len;
    const float* pr = p + r * t_len;
    float* dr = d + r * t_len;
    const double dot = BlockSum(
        t + 1, [&](int64_t j) { return static_cast<double>(pr[j]) * static_cast<double>(dr[j]); });
    for (int64_t j = 0; j < t_len; ++j) {
      dr[j] =
          j <= t
              ? static_cast<float>(static_cast<double>(pr[j]) * (static_cast<double>(dr[j]) - dot))
              : 0.0f;
    }
  }
  return cudaSuccess;
}

cudaError_t LaunchCrossEntropy(float* logits, const int32_t* windows, int64_t n, int64_t t_len,
                               int64_t v, double denom, bool gradients, double* row_loss,
                               cudaStream_t) {
  if (n * t_len <= 0) return cudaSuccess;
  if (!RowsFitGrid(n * t_len)) return cudaErrorInvalidConfiguration;
  if (!Fits(logits, n * t_len * v) || !Fits(windows, n * (t_len + 1)) ||
      !Fits(row_loss, n * t_len)) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t r = 0; r < n * t_len; ++r) {
    const int64_t target = windows[(r / t_len) * (t_len + 1) + r % t_len + 1];
    if (target < 0 || target >= v) return cudaErrorIllegalAddress;
    float* row = logits + r * v;
    const float max = RowMax(row, v);
    auto e = [&](int64_t j) { return static_cast<double>(muonmesh::math::ExpF(row[j] - max)); };
    const double sum = BlockSum(v, e);
    row_loss[r] = static_cast<double>(max) + std::log(sum) - static_cast<double>(row[target]);
    if (!gradients) continue;
    for (int64_t j = 0; j < v; ++j) {
      row[j] = static_cast<float>((e(j) / sum - (j == target ? 1.0 : 0.0)) / denom);
    }
  }
  return cudaSuccess;
}

cudaError_t LaunchGptEmbedBackward(const int32_t* windows, int64_t n, int64_t t_len, int64_t c,
                                   const float* dx, float* dwte, cudaStream_t) {
  if (c <= 0) return cudaSuccess;
  if (!Fits(windows, n * (t_len + 1)) || !TokensFit(windows, n, t_len, dwte, c) ||
      !Fits(dx, n * t_len * c)) {
    return cudaErrorIllegalAddress;
  }
  for (int64_t i = 0; i < c; ++i) {
    for (int64_t b = 0; b < n; ++b) {
      for (int64_t t = 0; t < t_len; ++t) {
        dwte[static_cast<int64_t>(windows[b * (t_len + 1) + t]) * c + i] +=
            dx[(b * t_len + t) * c + i];
      }
    }
  }
  return cudaSuccess;
}

cudaError_t LaunchPositionGrads(const float* dx, int64_t n, int64_t t_len, int64_t c,
                                int64_t block_size, float* dwpe, cudaStream_t) {
  if (block_size * c <= 0) return cudaSuccess;
  if (!Fits(dx, n * t_len * c) || !Fits(dwpe, block_size * c)) return cudaErrorIllegalAddress;
  for (int64_t k = 0; k < block_size * c; ++k) {
    const int64_t t = k / c;
    const int64_t i = k - t * c;
    double acc = 0.0;
    if (t < t_len) {
      for (int64_t b = 0; b < n; ++b) acc += static_cast<double>(dx[(b * t_len + t) * c + i]);
    }
    dwpe[k] = static_cast<float>(acc);
  }
  return cudaSuccess;
}

}  // namespace muonmesh::cuda::internal
