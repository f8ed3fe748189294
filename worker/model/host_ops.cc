#include "worker/model/host_ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "worker/math/elementwise.h"

namespace muonmesh::worker {

void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, float beta) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta,
              c, static_cast<int>(ldc));
}

void LinearNoBias(int64_t rows, int64_t in, int64_t out, const float* x, const float* w, float* y) {
  Gemm(false, true, rows, out, in, 1.0f, x, in, w, in, y, out);
}

void LinearNoBiasBackward(int64_t rows, int64_t in, int64_t out, const float* dy, const float* x,
                          const float* w, float* dw, float* dx, bool add) {
  Gemm(true, false, out, in, rows, 1.0f, dy, out, x, in, dw, in);
  Gemm(false, false, rows, in, out, 1.0f, dy, out, w, in, dx, in, add ? 1.0f : 0.0f);
}

namespace {

// Sums in double over four interleaved partial sums (j mod 4), combined as
// (s0 + s1) + (s2 + s3): a fixed order, so every clone and every layout gets
// the same bits, and four independent chains instead of one, so the loop
// runs at the adder's throughput rather than its latency. Inlined into the
// (cloned) callers.
inline double DotInDouble(const float* a, const float* b, int64_t n) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int k = 0; k < 4; ++k) s[k] += static_cast<double>(a[j + k]) * b[j + k];
  }
  for (; j < n; ++j) s[j % 4] += static_cast<double>(a[j]) * b[j];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// The same for sum_j a_j b_j c_j, each term (a_j b_j) c_j in double.
inline double DotInDouble(const float* a, const float* b, const float* c, int64_t n) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int k = 0; k < 4; ++k) s[k] += static_cast<double>(a[j + k]) * b[j + k] * c[j + k];
  }
  for (; j < n; ++j) s[j % 4] += static_cast<double>(a[j]) * b[j] * c[j];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

}  // namespace

MUONMESH_VECTOR_CLONES void RmsNormRows(int64_t rows, int64_t c, const float* x, const float* w, double eps, float* y,
                 float* r) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* xr = x + i * c;
    const double ss = DotInDouble(xr, xr, c);
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(c) + eps));
    r[i] = inv;
    float* yr = y + i * c;
    for (int64_t j = 0; j < c; ++j) yr[j] = xr[j] * inv * w[j];
  }
}

MUONMESH_VECTOR_CLONES void RmsNormRowsBackward(int64_t rows, int64_t c, const float* x, const float* r, const float* w,
                         const float* dy, float* dx, float* dw, double* acc) {
  std::fill(acc, acc + c, 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    const float* xr = x + i * c;
    const float* dyr = dy + i * c;
    float* dxr = dx + i * c;
    const double inv = r[i];
    const double dot = DotInDouble(dyr, w, xr, c);
    for (int64_t j = 0; j < c; ++j) acc[j] += static_cast<double>(dyr[j]) * xr[j] * inv;
    const double k = inv * inv * inv * dot / static_cast<double>(c);
    for (int64_t j = 0; j < c; ++j) {
      dxr[j] += static_cast<float>(inv * w[j] * dyr[j] - xr[j] * k);
    }
  }
  for (int64_t j = 0; j < c; ++j) dw[j] = static_cast<float>(acc[j]);
}

namespace {
float Sigmoid(float x) { return 1.0f / (1.0f + math::ExpF(-x)); }
}  // namespace

MUONMESH_VECTOR_CLONES void SwiGlu(int64_t n, const float* gate, const float* up, float* m) {
  for (int64_t i = 0; i < n; ++i) m[i] = gate[i] * Sigmoid(gate[i]) * up[i];
}

MUONMESH_VECTOR_CLONES void SwiGluBackward(int64_t n, const float* gate, const float* up, const float* dm, float* dgate,
                    float* dup) {
  for (int64_t i = 0; i < n; ++i) {
    const float d = dm[i];
    const float s = Sigmoid(gate[i]);
    dup[i] = d * gate[i] * s;
    dgate[i] = d * up[i] * s * (1.0f + gate[i] * (1.0f - s));
  }
}

namespace {

// SumInDouble's body, inlined into the (cloned) softmax.
inline double SumLanes(const float* e, int64_t n) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int k = 0; k < 4; ++k) s[k] += static_cast<double>(e[j + k]);
  }
  for (; j < n; ++j) s[j % 4] += static_cast<double>(e[j]);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// The largest of n >= 1 floats (branch-free, so it vectorises; a -0 against
// a +0 may come out either way, which the shifted exponentials do not see).
inline float MaxOf(const float* x, int64_t n) {
  float m = x[0];
  for (int64_t j = 1; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

}  // namespace

double SumInDouble(const float* e, int64_t n) { return SumLanes(e, n); }

void ShiftedExps(const float* row, int64_t n, float max, float* e) {
  for (int64_t j = 0; j < n; ++j) e[j] = math::ExpF(row[j] - max);
}

MUONMESH_VECTOR_CLONES float CausalSoftmax(int64_t t_len, float* s, float* e) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < t_len; ++t) {
    float* row = s + t * t_len;
    const float max = MaxOf(row, t + 1);
    top = std::max(top, max);
    for (int64_t j = 0; j <= t; ++j) e[j] = math::ExpF(row[j] - max);
    const double sum = SumLanes(e, t + 1);
    for (int64_t j = 0; j <= t; ++j) row[j] = static_cast<float>(static_cast<double>(e[j]) / sum);
    std::fill(row + t + 1, row + t_len, 0.0f);
  }
  return top;
}

MUONMESH_VECTOR_CLONES void CausalSoftmaxBackward(int64_t t_len, const float* p, float* d) {
  for (int64_t t = 0; t < t_len; ++t) {
    const float* pr = p + t * t_len;
    float* dr = d + t * t_len;
    const double dot = DotInDouble(pr, dr, t + 1);
    for (int64_t j = 0; j <= t; ++j) {
      dr[j] = static_cast<float>(static_cast<double>(pr[j]) * (static_cast<double>(dr[j]) - dot));
    }
    std::fill(dr + t + 1, dr + t_len, 0.0f);
  }
}

double WindowCrossEntropy(int64_t n, int64_t t_len, int64_t v, const int32_t* windows,
                          float* logits, float* e, bool gradients) {
  const int64_t rows = n * t_len;
  const double denom = static_cast<double>(rows);
  double loss = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = logits + r * v;
    const int64_t target = windows[(r / t_len) * (t_len + 1) + r % t_len + 1];
    const float max = *std::max_element(row, row + v);
    ShiftedExps(row, v, max, e);
    const double sum = SumInDouble(e, v);
    loss += static_cast<double>(max) + std::log(sum) - static_cast<double>(row[target]);
    if (!gradients) continue;
    for (int64_t j = 0; j < v; ++j) row[j] = static_cast<float>(static_cast<double>(e[j]) / sum / denom);
    row[target] = static_cast<float>((static_cast<double>(e[target]) / sum - 1.0) / denom);
  }
  return loss;
}

}  // namespace muonmesh::worker
