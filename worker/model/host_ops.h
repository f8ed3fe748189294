#pragma once

// The host arithmetic the language models share (gpt, transformer): sgemm
// through OpenBLAS, the transformer's bias-free linear layers, RMSNorm and
// SwiGLU, the causal softmax of attention scores and its backward
// pass, and the softmax cross-entropy of a batch of windows, each with the
// summation order the models' tests hold them to (sums of exps in double,
// four chains). Row-major fp32 throughout.

#include <cstdint>

namespace muonmesh::worker {

// c [m, n] = alpha op(a) op(b) + beta c, row-major (beta 0 overwrites c).
void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, float beta = 0.0f);

// y [rows, out] = x [rows, in] W^T for W [out, in]: a bias-free linear
// layer (the transformer's).
void LinearNoBias(int64_t rows, int64_t in, int64_t out, const float* x, const float* w, float* y);
// Its gradients from dy [rows, out]: dW = dy^T x (overwritten) and dx = dy W
// (overwritten, or added to dx when `add`).
void LinearNoBiasBackward(int64_t rows, int64_t in, int64_t out, const float* dy, const float* x,
                          const float* w, float* dw, float* dx, bool add);
// RMSNorm of each row of x [rows, c]: y = x / sqrt(mean(x^2) + eps) w, the
// mean and the inverse root in double, rounded once (r keeps it per row).
void RmsNormRows(int64_t rows, int64_t c, const float* x, const float* w, double eps, float* y,
                 float* r);
// Its backward pass: dx += r w dy - x r^3 / c sum_j dy_j w_j x_j per row;
// dw = sum over rows of dy x r (overwritten; summed in double in `acc`, c
// entries, rounded once).
void RmsNormRowsBackward(int64_t rows, int64_t c, const float* x, const float* r, const float* w,
                         const float* dy, float* dx, float* dw, double* acc);
// SwiGLU's product m = silu(gate) up over n elements, and its backward pass
// from dm (which dgate may alias).
void SwiGlu(int64_t n, const float* gate, const float* up, float* m);
void SwiGluBackward(int64_t n, const float* gate, const float* up, const float* dm, float* dgate,
                    float* dup);

// sum of e[0, n) in double: four partial sums s_k over j = k mod 4, in
// order, then (s_0 + s_1) + (s_2 + s_3) (four chains instead of one).
double SumInDouble(const float* e, int64_t n);

// e[j] = ExpF(row[j] - max) for j < n.
void ShiftedExps(const float* row, int64_t n, float max, float* e);

// Row t of s [T, T] (scores) becomes softmax over j <= t, 0 above: e_j =
// ExpF(s_j - max) in float (`e`, T entries), their sum in double
// (SumInDouble), p_j = float(e_j / sum). Returns the largest score over the
// causal positions (QK-clip's S).
float CausalSoftmax(int64_t t_len, float* s, float* e);

// d [T, T] = dL/dp becomes dL/dscores: p_j (d_j - sum_k p_k d_k), 0 above.
void CausalSoftmaxBackward(int64_t t_len, const float* p, float* d);

// The cross-entropy summed over the n T positions of `logits` [n T, V] whose
// targets are windows[b (T + 1) + t + 1] (windows [n, T + 1]): per row
// max + log(sum of exps) - logit of the target, in double. With
// `gradients`, the logits become dL/dlogits of the mean over the rows,
// (softmax - onehot) / (n T). `e` is scratch of V floats.
double WindowCrossEntropy(int64_t n, int64_t t_len, int64_t v, const int32_t* windows,
                          float* logits, float* e, bool gradients);

}  // namespace muonmesh::worker
