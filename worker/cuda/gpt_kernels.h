#pragma once

// The kernels around cuBLAS in the GPU `gpt` workload (worker/model/gpt_cuda.h):
// each is one loop of worker/model/gpt.cc with the same arithmetic per
// element (one rounding per operation, doubles where gpt.h says so). Row
// reductions (LayerNorm, softmax, cross-entropy) run one block of kThreads
// (grid.cuh) per row: thread j sums elements j, j + kThreads, ... in order,
// then the block adds the partials as a tree (halving strides), so a row's
// sum is the same on every run but not the CPU's sequential one. Column
// reductions (LayerNorm parameter gradients, the embedding gradients) run one
// thread per column in row order, as the CPU does, and equal it bit for bit.
// Compiled with --fmad=false, so the shared float formulas of
// worker/math/elementwise.h round as on the CPU. Plain C++ interface; each
// returns the launch error.
//
// tests/worker/cuda_cpu/kernels_cpu.cc transcribes these kernels for the CPU
// stand-in that runs the GPU tests in every build: change both together.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace muonmesh::cuda::internal {

// windows: [n, T + 1] device int32 token ids; row b T + t of an activation
// is position t of window b.

// x[b T + t, :] = wte[windows[b (T + 1) + t], :] + wpe[t, :] (float adds).
cudaError_t LaunchGptEmbed(const int32_t* windows, int64_t n, int64_t t_len, int64_t c,
                           const float* wte, const float* wpe, float* x, cudaStream_t stream);

// y[k] += x[k] (float adds).
cudaError_t LaunchAddInPlace(float* y, const float* x, int64_t count, cudaStream_t stream);

// LayerNorm over each row of x [rows, c]: mean and variance in double
// (block sums), mean[r] = float(mean), rstd[r] = float(1 / sqrt(var +
// 1e-5)), y = ((x - mean) rstd) w + b in float.
cudaError_t LaunchLayerNorm(const float* x, const float* w, const float* b, int64_t rows, int64_t c,
                            float* y, float* mean, float* rstd, cudaStream_t stream);

// dx[r, :] += rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w, xhat =
// (x - mean) rstd, the row means in double (block sums).
cudaError_t LaunchLayerNormBackward(const float* x, const float* mean, const float* rstd,
                                    const float* w, const float* dy, int64_t rows, int64_t c,
                                    float* dx, cudaStream_t stream);

// dw[i] = sum over rows of dy xhat, db[i] = sum of dy (double, row order).
cudaError_t LaunchLayerNormParamGrads(const float* x, const float* mean, const float* rstd,
                                      const float* dy, int64_t rows, int64_t c, float* dw,
                                      float* db, cudaStream_t stream);

// y = math::Gelu(x) (worker/math/elementwise.h).
cudaError_t LaunchGelu(const float* x, float* y, int64_t count, cudaStream_t stream);
// d *= math::GeluSlope(x).
cudaError_t LaunchGeluBackward(const float* x, float* d, int64_t count, cudaStream_t stream);

// s: rows of t_len scores, row r at position t = r % t_len; each becomes
// softmax over j <= t (exps math::ExpF(s - max), their sum in double), 0
// above.
cudaError_t LaunchCausalSoftmax(float* s, int64_t rows, int64_t t_len, cudaStream_t stream);
// d (dL/dp, rows as above) becomes dL/dscores: p_j (d_j - sum_k p_k d_k),
// the sum in double, 0 above the diagonal.
cudaError_t LaunchCausalSoftmaxBackward(const float* p, float* d, int64_t rows, int64_t t_len,
                                        cudaStream_t stream);

// Cross-entropy of each row r < n T of logits [n T, v] against its target
// windows[(r / T)(T + 1) + r % T + 1]: row_loss[r] = max + log(sum ExpF(l -
// max)) - l[target] (the sum and the rest in double); with `gradients` the
// row becomes (softmax - onehot) / denom.
cudaError_t LaunchCrossEntropy(float* logits, const int32_t* windows, int64_t n, int64_t t_len,
                               int64_t v, double denom, bool gradients, double* row_loss,
                               cudaStream_t stream);

// dwte[windows[b (T + 1) + t], :] += dx[b T + t, :] in window then position
// order (float adds; one thread per column, so repeated tokens do not race).
cudaError_t LaunchGptEmbedBackward(const int32_t* windows, int64_t n, int64_t t_len, int64_t c,
                                   const float* dx, float* dwte, cudaStream_t stream);

// dwpe[t, :] = sum over windows b of dx[b T + t, :] (double) for t < T, 0 for
// T <= t < block_size.
cudaError_t LaunchPositionGrads(const float* dx, int64_t n, int64_t t_len, int64_t c,
                                int64_t block_size, float* dwpe, cudaStream_t stream);

}  // namespace muonmesh::cuda::internal
