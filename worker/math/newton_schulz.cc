#include "worker/math/newton_schulz.h"

#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <new>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/plan/ns_cost.h"
#include "core/optim/ns_coefficients.h"

// LAPACK (OpenBLAS carries it): eigenvalues w and, with jobz "V", the
// eigenvectors (over a, column-major) of the symmetric n x n matrix a,
// divide and conquer.
extern "C" void dsyevd_(const char* jobz, const char* uplo, const int* n, double* a,
                        const int* lda, double* w, double* work, const int* lwork, int* iwork,
                        const int* liwork, int* info);

namespace muonmesh::math {
namespace internal {

namespace {
constexpr std::align_val_t kAlignment{64};
}  // namespace

template <class T>
void AlignedArray<T>::Free::operator()(T* p) const {
  ::operator delete[](p, kAlignment);
}

template <class T>
bool AlignedArray<T>::Reserve(size_t count) {
  if (count <= capacity_) return true;
  if (count > SIZE_MAX / sizeof(T)) return false;
  data_.reset();
  capacity_ = 0;
  auto* p = static_cast<T*>(::operator new[](count * sizeof(T), kAlignment, std::nothrow));
  if (p == nullptr) return false;
  data_.reset(p);
  capacity_ = count;
  return true;
}

template class AlignedArray<float>;
template class AlignedArray<double>;
template class AlignedArray<int>;

}  // namespace internal

namespace {

// Tile edge for the cache-blocked transposes; 32 floats = two cache lines.
constexpr int64_t kTile = 32;

absl::Status CheckShape(int64_t rows, int64_t cols) {
  // OpenBLAS (LP64) takes int dimensions and leading dimensions.
  if (rows < 0 || cols < 0 || rows > INT_MAX || cols > INT_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("Newton-Schulz: shape ", rows, " x ", cols, " outside [0, INT_MAX]"));
  }
  return absl::OkStatus();
}

// dst (cols x rows) = src (rows x cols)^T, both row-major.
void TransposeCopy(const float* src, int64_t rows, int64_t cols, float* dst) {
  for (int64_t i0 = 0; i0 < rows; i0 += kTile) {
    const int64_t i1 = std::min(rows, i0 + kTile);
    for (int64_t j0 = 0; j0 < cols; j0 += kTile) {
      const int64_t j1 = std::min(cols, j0 + kTile);
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = j0; j < j1; ++j) dst[j * rows + i] = src[i * cols + j];
      }
    }
  }
}

// Sum of squares in double with four interleaved accumulators (a fixed order,
// so deterministic). Each square of a float is exact in double. Infinite or
// NaN exactly when some element is: finite floats cannot overflow it.
double SumSquares(const float* x, size_t count) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  size_t i = 0;
  for (; i + 4 <= count; i += 4) {
    for (int k = 0; k < 4; ++k) {
      const double v = x[i + k];
      s[k] += v * v;
    }
  }
  for (; i < count; ++i) {
    const double v = x[i];
    s[0] += v * v;
  }
  return (s[0] + s[1]) + (s[2] + s[3]);
}

bool AllFinite(const float* x, size_t count) { return std::isfinite(SumSquares(x, count)); }

// Copies the upper triangle of the row-major m x m matrix a onto its lower
// triangle, tile by tile.
void MirrorUpperToLower(float* a, int64_t m) {
  for (int64_t i0 = 0; i0 < m; i0 += kTile) {
    const int64_t i1 = std::min(m, i0 + kTile);
    for (int64_t j0 = 0; j0 <= i0; j0 += kTile) {
      const int64_t j1 = std::min(m, j0 + kTile);
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = j0; j < std::min(j1, i); ++j) a[i * m + j] = a[j * m + i];
      }
    }
  }
}

// Row-block height of SymmetricProduct: its upper triangle took 0.57-0.61 of
// ssymm's time for the full product at m = 1024 and 2048, 0.66 at 512 (2
// cores, OpenBLAS 0.3.21, Haswell kernels); 96 beat 48-192 there by 2-7 %.
constexpr int64_t kProductRows = 96;

// c = a b for full m x m matrices a and b that are symmetric and commute (in
// exact arithmetic: here polynomials in one matrix), so the product is
// symmetric: its upper triangle block row by block row (about 0.56 of the
// full product's multiply-adds), mirrored onto the lower one.
void SymmetricProduct(const float* a, const float* b, int64_t m, float* c) {
  const int im = static_cast<int>(m);
  for (int64_t i0 = 0; i0 < m; i0 += kProductRows) {
    const int rows = static_cast<int>(std::min(kProductRows, m - i0));
    const int cols = static_cast<int>(m - i0);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, cols, im, 1.0f, a + i0 * m, im,
                b + i0, im, 0.0f, c + i0 * m + i0, im);
  }
  MirrorUpperToLower(c, m);
}

// out (upper triangle) = a I + b A + c A A for the full symmetric m x m A:
// A A = A A^T is a rank-k update.
void PolynomialOf(const float* a, int64_t m, const optim::NsCoefficientSet& k, float* out) {
  const int im = static_cast<int>(m);
  std::memcpy(out, a, static_cast<size_t>(m) * static_cast<size_t>(m) * sizeof(float));
  cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, im, im, static_cast<float>(k.c), a, im,
              static_cast<float>(k.b), out, im);
  const float ka = static_cast<float>(k.a);
  for (int64_t i = 0; i < m; ++i) out[i * m + i] += ka;
}

// Columns of X_0 the spectral form converts to double for one rank-k update
// of G (its buffer is m x kSpectralBlock doubles).
constexpr int64_t kSpectralBlock = 512;

// LAPACK dsyevd's work sizes for eigenvectors of an m x m matrix.
int64_t EigenWorkDoubles(int64_t m) { return 1 + 6 * m + 2 * m * m; }
int64_t EigenWorkInts(int64_t m) { return 3 + 5 * m; }

// The spectral form's fp64 work beyond G: eigenvalues, the block, LAPACK's.
int64_t SpectralWorkDoubles(int64_t m) { return m + m * kSpectralBlock + EigenWorkDoubles(m); }

}  // namespace

absl::Status NewtonSchulz::Reserve(int64_t rows, int64_t cols, plan::NsAlgorithm form) {
  MUONMESH_RETURN_IF_ERROR(CheckShape(rows, cols));
  const size_t m = static_cast<size_t>(std::min(rows, cols));
  const size_t n = static_cast<size_t>(std::max(rows, cols));
  if (m != 0 && n > SIZE_MAX / sizeof(double) / m) {
    return absl::ResourceExhaustedError("Newton-Schulz: workspace size overflows");
  }
  bool ok = x0_.Reserve(m * n) && x1_.Reserve(m * n) && a_.Reserve(m * m) && b_.Reserve(m * m) &&
            q_.Reserve(m * m) && c_.Reserve(m * m);
  if (ok && form == plan::NsAlgorithm::kSpectral) {
    const auto im = static_cast<int64_t>(m);
    ok = g_.Reserve(m * m) && dwork_.Reserve(static_cast<size_t>(SpectralWorkDoubles(im))) &&
         iwork_.Reserve(static_cast<size_t>(EigenWorkInts(im)));
  }
  if (!ok) {
    return absl::ResourceExhaustedError(
        absl::StrCat("Newton-Schulz: cannot allocate the workspace for ", rows, " x ", cols));
  }
  return absl::OkStatus();
}

void NsWorkspaceBound::Add(int64_t rows, int64_t cols, plan::NsAlgorithm form) {
  const int64_t m = std::min(rows, cols);
  const auto um = static_cast<size_t>(m);
  mn_ = std::max(mn_, um * static_cast<size_t>(std::max(rows, cols)));
  mm_ = std::max(mm_, um * um);
  if (form == plan::NsAlgorithm::kSpectral) spectral_m_ = std::max(spectral_m_, m);
}

size_t NsWorkspaceBound::bytes() const {
  size_t bytes = (2 * mn_ + 4 * mm_) * sizeof(float);  // x0_, x1_; a_, b_, q_, c_
  if (spectral_m_ > 0) {
    const auto m = static_cast<size_t>(spectral_m_);
    bytes += (m * m + static_cast<size_t>(SpectralWorkDoubles(spectral_m_))) * sizeof(double) +
             static_cast<size_t>(EigenWorkInts(spectral_m_)) * sizeof(int);
  }
  return bytes;
}

size_t NewtonSchulz::WorkspaceBytes(int64_t rows, int64_t cols, plan::NsAlgorithm form) {
  NsWorkspaceBound bound;
  bound.Add(rows, cols, form);
  return bound.bytes();
}

size_t NewtonSchulz::workspace_bytes() const {
  return (x0_.capacity() + x1_.capacity() + a_.capacity() + b_.capacity() + q_.capacity() +
          c_.capacity()) *
             sizeof(float) +
         (g_.capacity() + dwork_.capacity()) * sizeof(double) + iwork_.capacity() * sizeof(int);
}

absl::Status NewtonSchulz::Run(float* x, int64_t rows, int64_t cols, const optim::NsOptions& options) {
  MUONMESH_RETURN_IF_ERROR(optim::ValidateNsOptions(options));
  MUONMESH_RETURN_IF_ERROR(CheckShape(rows, cols));
  return RunValidated(x, rows, cols, options);
}

absl::Status NewtonSchulz::RunBatched(float* x, int64_t count, int64_t rows, int64_t cols,
                                      const optim::NsOptions& options) {
  MUONMESH_RETURN_IF_ERROR(optim::ValidateNsOptions(options));
  MUONMESH_RETURN_IF_ERROR(CheckShape(rows, cols));
  if (count < 0) return absl::InvalidArgumentError("Newton-Schulz: negative batch count");
  const size_t size = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  // All inputs are checked before any is written (all or nothing on input).
  for (int64_t e = 0; e < count; ++e) {
    if (!AllFinite(x + e * size, size)) {
      return absl::InvalidArgumentError(
          absl::StrCat("Newton-Schulz: batch matrix ", e, " holds a NaN or infinity"));
    }
  }
  for (int64_t e = 0; e < count; ++e) {
    MUONMESH_RETURN_IF_ERROR(RunValidated(x + e * size, rows, cols, options), "batch matrix ", e);
  }
  return absl::OkStatus();
}

absl::Status NewtonSchulz::RunValidated(float* x, int64_t rows, int64_t cols,
                                        const optim::NsOptions& options) {
  if (rows == 0 || cols == 0) return absl::OkStatus();
  const plan::NsAlgorithm form = optim::NsFormFor(options, rows, cols);
  if (form == plan::NsAlgorithm::kSpectral) {
    // The message only when refusing: a call that runs allocates nothing.
    const double gain = plan::NsTotalGain(options.steps, [&](int64_t t) {
      return optim::NsCoefficientsForStep(options, static_cast<int>(t)).a;
    });
    if (gain > plan::kSpectralGainLimit) {
      const std::string what = absl::StrCat(options.steps, " iterations of these coefficients");
      return absl::InvalidArgumentError(
          absl::StrCat("Newton-Schulz: ", plan::SpectralGainProblem(gain, what)));
    }
  }
  if (form == plan::NsAlgorithm::kSpectral &&
      std::min(rows, cols) > plan::kSpectralMaxShortSide) {
    return absl::InvalidArgumentError(
        absl::StrCat("Newton-Schulz: the spectral form takes matrices whose short side is at most ",
                     plan::kSpectralMaxShortSide, " (LAPACK's work size), not ", rows, " x ",
                     cols, ": use gram or standard"));
  }
  MUONMESH_RETURN_IF_ERROR(Reserve(rows, cols, form));

  const bool transpose = rows > cols;
  const int64_t m = std::min(rows, cols);
  const int64_t n = std::max(rows, cols);
  const size_t mn = static_cast<size_t>(m) * static_cast<size_t>(n);
  float* xa = x0_.data();

  // Lay the working m x n matrix out first, so that x and x^T give identical
  // bits from here on (a wide x is already laid out: its norm is summed in
  // place and it is copied while it is scaled).
  if (transpose) TransposeCopy(x, rows, cols, xa);
  const float* laid_out = transpose ? xa : x;
  const double sum_squares = SumSquares(laid_out, mn);
  if (!std::isfinite(sum_squares)) {
    return absl::InvalidArgumentError("Newton-Schulz: input holds a NaN or infinity");
  }
  const double inv_norm = 1.0 / std::max(std::sqrt(sum_squares), options.eps);
  for (size_t i = 0; i < mn; ++i) xa[i] = static_cast<float>(laid_out[i] * inv_norm);

  const float* result = nullptr;
  if (form == plan::NsAlgorithm::kSpectral) {
    MUONMESH_ASSIGN_OR_RETURN(const float* spectral, EvaluateSpectral(m, n, options));
    result = spectral;
  } else {
    result = form == plan::NsAlgorithm::kGram ? IterateGram(m, n, options)
                                              : IterateStandard(m, n, options);
  }
  if (!AllFinite(result, mn)) {
    return absl::InvalidArgumentError(
        "Newton-Schulz: the iteration produced a NaN or infinity (diverging coefficients?)");
  }
  if (transpose) {
    TransposeCopy(result, m, n, x);
  } else {
    std::memcpy(x, result, mn * sizeof(float));
  }
  return absl::OkStatus();
}

const float* NewtonSchulz::IterateStandard(int64_t m, int64_t n, const optim::NsOptions& options) {
  float* xa = x0_.data();
  float* xb = x1_.data();
  float* a = a_.data();
  float* b = b_.data();
  const int im = static_cast<int>(m);
  const int in = static_cast<int>(n);
  for (int t = 0; t < options.steps; ++t) {
    const optim::NsCoefficientSet k = optim::NsCoefficientsForStep(options, t);
    // A = X X^T (upper triangle), then made full: the next rank-k update
    // reads A as a general matrix.
    cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, im, in, 1.0f, xa, in, 0.0f, a, im);
    MirrorUpperToLower(a, m);
    // B = b A + c A A^T (= c A A: A is symmetric), upper triangle.
    PolynomialOf(a, m, k, b);
    cblas_ssymm(CblasRowMajor, CblasLeft, CblasUpper, im, in, 1.0f, b, im, xa, in, 0.0f, xb, in);
    std::swap(xa, xb);
  }
  return xa;
}

// The Gram form (plan/ns_cost.h): R, P, Q and a scratch matrix are m x m and
// kept full and symmetric (the products read them as general matrices);
// every product of two of them is a product of commuting symmetric matrices
// (SymmetricProduct), and P^2 = P P^T is a rank-k update. X_0 stays in x0_
// until a restart replaces it with Q X_0; the result lands in x1_ (or x0_
// after an odd number of restarts).
const float* NewtonSchulz::IterateGram(int64_t m, int64_t n, const optim::NsOptions& options) {
  float* x_start = x0_.data();
  float* x_other = x1_.data();
  float* r = a_.data();
  float* p = b_.data();
  float* q = q_.data();
  float* scratch = c_.data();
  const int im = static_cast<int>(m);
  const int in = static_cast<int>(n);
  const size_t mm = static_cast<size_t>(m) * static_cast<size_t>(m);
  plan::GramRestartRule rule;
  bool starts = rule.Next(optim::NsCoefficientsForStep(options, 0).a);
  for (int t = 0; t < options.steps; ++t) {
    if (starts) {
      if (t > 0) {  // restart: X = Q X_0 becomes the new X_0
        cblas_ssymm(CblasRowMajor, CblasLeft, CblasUpper, im, in, 1.0f, q, im, x_start, in, 0.0f,
                    x_other, in);
        std::swap(x_start, x_other);
      }
      cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, im, in, 1.0f, x_start, in, 0.0f, r, im);
      MirrorUpperToLower(r, m);
    }
    const optim::NsCoefficientSet k = optim::NsCoefficientsForStep(options, t);
    PolynomialOf(r, m, k, p);  // P = a I + b R + c R^2, upper triangle
    MirrorUpperToLower(p, m);
    if (starts) {
      std::memcpy(q, p, mm * sizeof(float));
    } else {
      SymmetricProduct(p, q, m, scratch);
      std::swap(q, scratch);
    }
    // R is needed again unless this is the last iteration or the next one
    // restarts from a fresh X X^T.
    starts = t + 1 < options.steps && rule.Next(optim::NsCoefficientsForStep(options, t + 1).a);
    if (t + 1 < options.steps && !starts) {
      // R <- P^2 R: P^2 = P P^T (upper triangle, then full) into scratch.
      cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, im, im, 1.0f, p, im, 0.0f, scratch, im);
      MirrorUpperToLower(scratch, m);
      SymmetricProduct(scratch, r, m, p);
      std::swap(r, p);
    }
  }
  // X_T = Q X_0.
  cblas_ssymm(CblasRowMajor, CblasLeft, CblasUpper, im, in, 1.0f, q, im, x_start, in, 0.0f,
              x_other, in);
  return x_other;
}

// The spectral form (plan/ns_cost.h) on the normalised X_0 in x0_: G =
// X_0 X_0^T in double (rank-k updates over blocks of X_0's columns converted
// to double; the upper triangle), G = V diag(l) V^T by dsyevd, q_T(l) per
// eigenvalue in double (l clamped at 0: G is positive semi-definite, its
// computed small eigenvalues may dip below), then in fp32 Q = V diag(q) V^T
// (a_ holds V^T, b_ holds diag(q) V^T) and X_T = Q X_0 in x1_.
absl::StatusOr<const float*> NewtonSchulz::EvaluateSpectral(int64_t m, int64_t n,
                                                            const optim::NsOptions& options) {
  const float* x0 = x0_.data();
  double* g = g_.data();
  double* eigenvalues = dwork_.data();
  double* block = eigenvalues + m;
  double* work = block + m * kSpectralBlock;
  const int im = static_cast<int>(m);
  for (int64_t j0 = 0; j0 < n; j0 += kSpectralBlock) {
    const int64_t width = std::min(kSpectralBlock, n - j0);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < width; ++j) block[i * width + j] = x0[i * n + j0 + j];
    }
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, im, static_cast<int>(width), 1.0,
                block, static_cast<int>(width), j0 == 0 ? 0.0 : 1.0, g, im);
  }
  // The row-major upper triangle is the column-major lower one; on return
  // column k of the column-major V, eigenvector k, is row k of g.
  const int lwork = static_cast<int>(EigenWorkDoubles(m));
  const int liwork = static_cast<int>(EigenWorkInts(m));
  int info = 0;
  dsyevd_("V", "L", &im, g, &im, eigenvalues, work, &lwork, iwork_.data(), &liwork, &info);
  if (info != 0) {
    return absl::InternalError(absl::StrCat(
        "Newton-Schulz (spectral): the eigensolver failed (LAPACK dsyevd info ", info, ")"));
  }
  float* vt = a_.data();
  float* scaled = b_.data();
  for (int64_t k = 0; k < m; ++k) {
    double r = std::max(eigenvalues[k], 0.0);
    double q = 1.0;
    for (int t = 0; t < options.steps; ++t) {
      const optim::NsCoefficientSet c = optim::NsCoefficientsForStep(options, t);
      const double p = c.a + r * (c.b + r * c.c);
      q *= p;
      r *= p * p;
    }
    for (int64_t i = 0; i < m; ++i) {
      vt[k * m + i] = static_cast<float>(g[k * m + i]);
      scaled[k * m + i] = static_cast<float>(g[k * m + i] * q);
    }
  }
  float* q = q_.data();
  float* out = x1_.data();
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, im, im, im, 1.0f, vt, im, scaled, im, 0.0f,
              q, im);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, im, static_cast<int>(n), im, 1.0f, q, im,
              x0, static_cast<int>(n), 0.0f, out, static_cast<int>(n));
  return out;
}

}  // namespace muonmesh::math
