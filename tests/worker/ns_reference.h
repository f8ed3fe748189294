#pragma once

// Independent fp64 references for the numerics tests: plain loops, no BLAS,
// no code shared with worker/math/ (the coefficients are restated here too).
// Header-only and dependency-free so the self-contained CUDA test binary can
// use it as well.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace muonmesh::math::testing {

using Triple = std::array<double, 3>;

inline const Triple kQuintic = {3.4445, -4.7750, 2.0315};

// Polar Express, docs/architecture.md §5; the last row repeats.
inline const std::vector<Triple> kPolarExpress = {
    {8.2051, -22.9019, 16.4607}, {4.0664, -2.8612, 0.5184}, {3.9096, -2.8234, 0.5250},
    {3.2856, -2.4153, 0.4853},   {2.2779, -1.6198, 0.3985}, {1.8726, -1.2307, 0.3585},
    {1.8564, -1.2132, 0.3568},   {1.8750, -1.2500, 0.3750},
};

// Row-major r x c matrix of doubles.
struct Mat {
  int64_t r = 0;
  int64_t c = 0;
  std::vector<double> v;
  Mat(int64_t rows, int64_t cols) : r(rows), c(cols), v(static_cast<size_t>(rows * cols), 0.0) {}
  double& operator()(int64_t i, int64_t j) { return v[static_cast<size_t>(i * c + j)]; }
  double operator()(int64_t i, int64_t j) const { return v[static_cast<size_t>(i * c + j)]; }
};

inline Mat Transposed(const Mat& x) {
  Mat t(x.c, x.r);
  for (int64_t i = 0; i < x.r; ++i)
    for (int64_t j = 0; j < x.c; ++j) t(j, i) = x(i, j);
  return t;
}

inline Mat Multiply(const Mat& x, const Mat& y) {
  Mat z(x.r, y.c);
  for (int64_t i = 0; i < x.r; ++i)
    for (int64_t k = 0; k < x.c; ++k) {
      const double xik = x(i, k);
      for (int64_t j = 0; j < y.c; ++j) z(i, j) += xik * y(k, j);
    }
  return z;
}

inline Mat FromFloats(const std::vector<float>& x, int64_t rows, int64_t cols) {
  Mat m(rows, cols);
  for (size_t i = 0; i < m.v.size(); ++i) m.v[i] = x[i];
  return m;
}

// The Newton-Schulz iteration, literally: X = x (x^T when rows > cols),
// X /= max(||X||_F, eps), then per step A = X X^T, B = b A + c A A,
// X = a X + B X; transposed back at the end. coeffs[t] for step t, the last
// row repeating.
inline Mat ReferenceNewtonSchulz(const Mat& x, int steps, const std::vector<Triple>& coeffs,
                                 double eps = 1e-7) {
  const bool transpose = x.r > x.c;
  Mat X = transpose ? Transposed(x) : x;
  double ss = 0.0;
  for (double e : X.v) ss += e * e;
  const double norm = std::max(std::sqrt(ss), eps);
  for (double& e : X.v) e /= norm;
  for (int t = 0; t < steps; ++t) {
    const Triple& k = coeffs[std::min<size_t>(static_cast<size_t>(t), coeffs.size() - 1)];
    const Mat A = Multiply(X, Transposed(X));
    const Mat AA = Multiply(A, A);
    Mat B(A.r, A.c);
    for (size_t i = 0; i < B.v.size(); ++i) B.v[i] = k[1] * A.v[i] + k[2] * AA.v[i];
    const Mat BX = Multiply(B, X);
    for (size_t i = 0; i < X.v.size(); ++i) X.v[i] = k[0] * X.v[i] + BX.v[i];
  }
  return transpose ? Transposed(X) : X;
}

// ||x - y||_F / ||y||_F.
inline double RelativeFrobenius(const std::vector<float>& x, const Mat& y) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < y.v.size(); ++i) {
    const double d = static_cast<double>(x[i]) - y.v[i];
    num += d * d;
    den += y.v[i] * y.v[i];
  }
  return std::sqrt(num) / std::sqrt(den);
}

// Eigenvalues of a symmetric matrix by cyclic Jacobi rotations, ascending.
inline std::vector<double> SymmetricEigenvalues(Mat a) {
  const int64_t n = a.r;
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0.0, total = 0.0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        total += a(i, j) * a(i, j);
        if (i != j) off += a(i, j) * a(i, j);
      }
    if (off <= 1e-30 * total || off == 0.0) break;
    for (int64_t p = 0; p < n; ++p)
      for (int64_t q = p + 1; q < n; ++q) {
        const double apq = a(p, q);
        if (apq == 0.0) continue;
        // Rotation that zeroes a(p, q) (Golub & Van Loan, Algorithm 8.4.1).
        const double tau = (a(q, q) - a(p, p)) / (2.0 * apq);
        const double t = (tau >= 0.0 ? 1.0 : -1.0) / (std::fabs(tau) + std::sqrt(1.0 + tau * tau));
        const double c = 1.0 / std::sqrt(1.0 + t * t);
        const double s = t * c;
        for (int64_t k = 0; k < n; ++k) {  // columns p, q
          const double akp = a(k, p), akq = a(k, q);
          a(k, p) = c * akp - s * akq;
          a(k, q) = s * akp + c * akq;
        }
        for (int64_t k = 0; k < n; ++k) {  // rows p, q
          const double apk = a(p, k), aqk = a(q, k);
          a(p, k) = c * apk - s * aqk;
          a(q, k) = s * apk + c * aqk;
        }
      }
  }
  std::vector<double> ev(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ev[static_cast<size_t>(i)] = a(i, i);
  std::sort(ev.begin(), ev.end());
  return ev;
}

// Singular values (ascending) of a row-major rows x cols float matrix: the
// square roots of the eigenvalues of the smaller Gram matrix.
inline std::vector<double> SingularValues(const std::vector<float>& x, int64_t rows, int64_t cols) {
  Mat m = FromFloats(x, rows, cols);
  if (rows > cols) m = Transposed(m);
  std::vector<double> ev = SymmetricEigenvalues(Multiply(m, Transposed(m)));
  for (double& e : ev) e = std::sqrt(std::max(e, 0.0));
  return ev;
}

inline std::vector<float> Gaussian(int64_t count, uint64_t seed, double stddev = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, stddev);
  std::vector<float> v(static_cast<size_t>(count));
  for (float& e : v) e = static_cast<float>(dist(rng));
  return v;
}

inline std::vector<float> TransposedFloats(const std::vector<float>& x, int64_t rows,
                                           int64_t cols) {
  std::vector<float> t(x.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      t[static_cast<size_t>(j * rows + i)] = x[static_cast<size_t>(i * cols + j)];
  return t;
}

// The scalar map one iteration applies to each singular value:
// s -> a s + b s^3 + c s^5.
inline double ScalarIteration(double s, const Triple& k) {
  return k[0] * s + k[1] * s * s * s + k[2] * s * s * s * s * s;
}

// Rows of a k x n matrix with orthonormal rows (k <= n): Gaussian rows,
// orthogonalised by modified Gram-Schmidt twice, in double.
inline Mat OrthonormalRows(int64_t k, int64_t n, uint64_t seed) {
  const std::vector<float> g = Gaussian(k * n, seed);
  Mat q = FromFloats(g, k, n);
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t j = 0; j < i; ++j) {
        double dot = 0;
        for (int64_t c = 0; c < n; ++c) dot += q(i, c) * q(j, c);
        for (int64_t c = 0; c < n; ++c) q(i, c) -= dot * q(j, c);
      }
      double norm = 0;
      for (int64_t c = 0; c < n; ++c) norm += q(i, c) * q(i, c);
      norm = std::sqrt(norm);
      for (int64_t c = 0; c < n; ++c) q(i, c) /= norm;
    }
  }
  return q;
}

// A rows x cols float matrix U diag(sv) V^T with random orthonormal U and V
// and the given singular values (min(rows, cols) of them).
inline std::vector<float> WithSingularValues(int64_t rows, int64_t cols,
                                             const std::vector<double>& sv, uint64_t seed) {
  const int64_t m = std::min(rows, cols);
  const Mat u = OrthonormalRows(m, rows, seed);      // columns of U, as rows
  const Mat v = OrthonormalRows(m, cols, seed + 1);  // columns of V, as rows
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      double sum = 0;
      for (int64_t k = 0; k < m; ++k) sum += u(k, i) * sv[k] * v(k, j);
      x[static_cast<size_t>(i * cols + j)] = static_cast<float>(sum);
    }
  }
  return x;
}

// A rows x cols matrix whose singular values spread geometrically over
// 1e-6 .. 1 (just 1 for a vector); with 0 <= rank < min(rows, cols), the
// smallest min(rows, cols) - rank of them are zero.
inline std::vector<float> IllConditioned(int64_t rows, int64_t cols, uint64_t seed,
                                         int64_t rank = -1) {
  const int64_t m = std::min(rows, cols);
  std::vector<double> sv(static_cast<size_t>(m));
  for (int64_t k = 0; k < m; ++k) {
    sv[k] = m == 1 ? 1.0 : std::pow(1e-6, static_cast<double>(k) / static_cast<double>(m - 1));
    if (rank >= 0 && k >= rank) sv[k] = 0.0;
  }
  return WithSingularValues(rows, cols, sv, seed);
}

}  // namespace muonmesh::math::testing
