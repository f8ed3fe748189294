#pragma once

// Newton-Schulz coefficients, what one orthogonalisation of a rows x cols
// matrix costs in each of its three forms, and which form runs: the planner
// balances owners on these FLOPs and the runtime (worker/math) runs the form
// chosen here, so the two agree by construction. Header-only, no
// dependencies.
//
// With m = min(rows, cols), n = max(rows, cols) and T iterations, FLOPs are
// counted as general matrix products (2 m k n for an m x k by k x n product),
// even where a symmetric kernel does half of them:
//  - standard: T (4 m^2 n + 2 m^3)  (X X^T, (b A + c A^2) X, A^2).
//  - Gram: the iteration on the m x m matrices R = X X^T and Q (X_k = Q X_0):
//        R = X_0 X_0^T,  P = a I + b R + c R^2,
//        Q <- P Q (Q = P after a (re)start),  R <- P^2 R,
//    and X_T = Q X_0 once at the end. In floating point the recurrence for R
//    multiplies the rounding errors already in R, in the directions of small
//    singular values, by about a_t^2 per iteration t, so the form restarts
//    (forms X = Q X_0, recomputes R = X X^T, Q = I) before an iteration whose
//    R would carry errors amplified by more than kGramDriftLimit: the product
//    of a_s^2 over the iterations s of the segment before it. The quintic
//    (a^2 = 11.86) runs segments of 3 (the third iteration's R amplified by
//    141), Polar Express (a_t^2 = 67.3, 16.5, 15.3, 10.8, 5.19, 3.51, ...)
//    restarts at iterations 2, 4, 8 and 12. The limit is measured, not
//    derived: on ill-conditioned and rank-deficient inputs against the fp64
//    reference (tests/worker/newton_schulz_test.cc), quintic segments of 3
//    reach at most about a fifth (0.21) of the 1e-4 bound while segments of
//    4 (R amplified by 1670) exceed it, and Polar Express's iterations 2-4
//    in one segment (R amplified by 165) exceed it 1.4-2.4 times, so the
//    limit sits between 141 and 165. A custom table is held to the same
//    limit. That Polar Express side is a property of the CPU form, which
//    keeps every m x m product symmetric (its upper triangle): with drifted
//    R, P and Q commute only approximately, and with the full products (as
//    the CUDA form computes them) that segment stays within the bound
//    (tests/worker/newton_schulz_test.cc, FloatGram), as do these restarts.
//    One segment of L iterations between (re)starts costs 2 m^3 for L = 1
//    (R^2; Q = P) and 2 m^3 (4 L - 3) otherwise (R^2 each iteration, P^2 and
//    P^2 R all but the last, P Q all but the first); each segment also costs
//    4 m^2 n (its X X^T and its final Q X_0).
//  - spectral (CPU only): the Gram form's Q_T = q_T(G), a polynomial in
//    G = X_0 X_0^T, evaluated on G's eigenvalues instead of iterated: G in
//    fp64, its eigendecomposition G = V diag(l) V^T (LAPACK dsyevd), for each
//    eigenvalue the scalar recurrence q <- p_t(r) q, r <- p_t(r)^2 r in
//    double (p_t(r) = a_t + b_t r + c_t r^2, r = l, q = 1), then
//    Q = V diag(q) V^T and X_T = Q X_0 in fp32. No recurrence on matrices, so
//    no drift and no restarts; the cost does not grow with T. Counted as
//    kSpectralM2n m^2 n + kSpectralM3 m^3 + kSpectralM2 m^2, constants
//    fitted to its measured time against the iterative forms' on one
//    OpenBLAS thread (the m^2 term is the eigensolver's scalar part, which
//    makes the form a poor choice for small matrices). The
//    eigensolver (kSpectralEigenShare of the m^3 term) barely speeds up with
//    more threads while the products, and the other forms, do: on a rank of
//    T threads (TrainingConfig.threads_per_rank) that share is charged
//    T / kSpectralEigenSpeedup times over (the speed-up measured at two
//    threads, assumed not to grow beyond; BENCHMARKS.md, BM_SpectralPhases),
//    so auto leaves it to the Gram iteration at 1:4 on two threads (measured
//    8% faster there) and to all but very wide matrices on more. Its
//    accuracy has a limit the iterations do not: the fp32 rounding of
//    Q = V diag(q) V^T and of Q X_0 is multiplied by the largest q, the
//    iterations' total gain on the smallest singular values, the product of
//    a_t over all T (485 for 5 quintic iterations, 976 for 5 Polar Express,
//    2.2e4 for 10); the iterative form restarts instead (above). Against
//    the fp64 reference (tests/worker/newton_schulz_test.cc) its worst
//    errors were 0.15 and 0.29 of the bound at gains 485 and 976 and 2.7
//    times it at 2.2e4, so it runs only up to kSpectralGainLimit: auto does
//    not pick it beyond, and the validators refuse it there.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace muonmesh::plan {

// One iteration X <- a X + (b A + c A^2) X with A = X X^T.
struct NsCoefficientSet {
  double a = 0.0;
  double b = 0.0;
  double c = 0.0;
};

// Keller Jordan's quintic (torch.optim.Muon's default), every iteration.
inline constexpr NsCoefficientSet kQuinticCoefficients{3.4445, -4.7750, 2.0315};

// Polar Express (arXiv 2505.16932) as NVIDIA Emerging-Optimizers tabulates
// it: row t for iteration t, the last row repeating.
inline constexpr std::array<NsCoefficientSet, 8> kPolarExpressCoefficients{{
    {8.2051, -22.9019, 16.4607},
    {4.0664, -2.8612, 0.5184},
    {3.9096, -2.8234, 0.5250},
    {3.2856, -2.4153, 0.4853},
    {2.2779, -1.6198, 0.3985},
    {1.8726, -1.2307, 0.3585},
    {1.8564, -1.2132, 0.3568},
    {1.8750, -1.2500, 0.3750},
}};

// The named tables a job can pick (MuonConfig.coefficients).
enum class NsTable { kQuintic, kPolarExpress };

inline NsCoefficientSet NsTableRow(NsTable table, int64_t step) {
  if (table == NsTable::kQuintic) return kQuinticCoefficients;
  return kPolarExpressCoefficients[static_cast<size_t>(
      std::min<int64_t>(step, kPolarExpressCoefficients.size() - 1))];
}

// "quintic" (also empty) | "polar_express"; false for anything else.
inline bool ParseNsTable(std::string_view text, NsTable* out) {
  if (text.empty() || text == "quintic") {
    *out = NsTable::kQuintic;
  } else if (text == "polar_express") {
    *out = NsTable::kPolarExpress;
  } else {
    return false;
  }
  return true;
}

inline const char* NsTableName(NsTable table) {
  return table == NsTable::kQuintic ? "quintic" : "polar_express";
}

// Which Newton-Schulz form runs (the Muon config's ns_algorithm).
enum class NsAlgorithm {
  kAuto,      // the form with fewer FLOPs, per matrix (the default)
  kStandard,  // X <- a X + (b A + c A^2) X on the m x n matrix
  kGram,      // the iteration on X X^T, as above
  kSpectral,  // the Gram form on the eigenvalues of X X^T, as above (CPU only)
};

// The bound on the amplification (product of a_s^2 over a segment's earlier
// iterations) of the rounding errors in the R an iteration of the Gram form
// uses.
inline constexpr double kGramDriftLimit = 150.0;

// Whether the Gram form (re)starts from a fresh X X^T at iteration `step`;
// `a(t)` is iteration t's leading coefficient. Iteration 0 always starts.
// The rule above one iteration at a time: Next(a_t), called for t = 0, 1,
// ... in order, says whether iteration t (re)starts.
class GramRestartRule {
 public:
  bool Next(double a) {
    const bool starts = first_ || growth_ > kGramDriftLimit;
    first_ = false;
    growth_ = (starts ? 1.0 : growth_) * a * a;
    return starts;
  }

 private:
  bool first_ = true;
  double growth_ = 1.0;
};

template <class LeadingCoefficient>
bool GramStartsAt(int64_t step, LeadingCoefficient a) {
  GramRestartRule rule;
  bool starts = true;
  for (int64_t t = 0; t <= step; ++t) starts = rule.Next(a(t));
  return starts;
}

inline double StandardNsFlops(int64_t rows, int64_t cols, int64_t steps) {
  const double m = static_cast<double>(std::min(rows, cols));
  const double n = static_cast<double>(std::max(rows, cols));
  return static_cast<double>(steps) * (4 * m * m * n + 2 * m * m * m);
}

template <class LeadingCoefficient>
double GramNsFlops(int64_t rows, int64_t cols, int64_t steps, LeadingCoefficient a) {
  const double m = static_cast<double>(std::min(rows, cols));
  const double n = static_cast<double>(std::max(rows, cols));
  if (steps <= 0 || m == 0) return 0;
  const auto segment = [&](int64_t length) {
    return 4 * m * m * n + 2 * m * m * m * (length == 1 ? 1.0 : 4.0 * length - 3);
  };
  // One pass: a segment ends where the next one starts, or at the end.
  GramRestartRule rule;
  double total = 0;
  int64_t length = 0;
  for (int64_t t = 0; t < steps; ++t) {
    if (rule.Next(a(t)) && length > 0) {
      total += segment(length);
      length = 0;
    }
    ++length;
  }
  return total + segment(length);
}

inline double GramNsFlops(int64_t rows, int64_t cols, int64_t steps, NsTable table) {
  return GramNsFlops(rows, cols, steps, [table](int64_t t) { return NsTableRow(table, t).a; });
}

// The spectral form's cost in the counted FLOPs of the others (see the top).
inline constexpr double kSpectralM2n = 6.0;
inline constexpr double kSpectralM3 = 30.0;
// The eigensolver's cost that does not shrink with m^3: dsyevd's
// divide-and-conquer solves a secular equation per eigenvalue at every merge
// (dlaed4), O(m^2) work at a scalar rate, which dominates the spectral form's
// time at small m. Fitted to where the Gram iteration and the spectral form
// cost the same on one thread (BENCHMARKS.md, "Newton-Schulz on small
// matrices"): about 1:13 at m = 128, 1:6 at 256, below 1:3 at 768, where the
// m^3 and m^2 n terms alone put it at 1:1 for every m; with this term at
// 1:(1 + 1500 / m). Charged like the eigensolver's share on several threads.
inline constexpr double kSpectralM2 = 3000.0;

// The most Newton-Schulz iterations a job, a plan or a call may ask for,
// and how many they run when they do not say (the one default: the
// planner, the job file and the numerics read it from here).
inline constexpr int64_t kMaxNsSteps = 100;
inline constexpr int64_t kDefaultNsSteps = 5;

// The largest total gain (product of |a_t| over the iterations) at which
// the spectral form keeps its accuracy (see the top).
inline constexpr double kSpectralGainLimit = 2000.0;

// The largest short side the spectral form takes: LAPACK's dsyevd counts its
// work (1 + 6 m + 2 m^2 doubles) in a 32-bit int.
inline constexpr int64_t kSpectralMaxShortSide = 32766;

template <class LeadingCoefficient>
double NsTotalGain(int64_t steps, LeadingCoefficient a) {
  double gain = 1.0;
  for (int64_t t = 0; t < steps; ++t) gain *= a(t) < 0 ? -a(t) : a(t);
  return gain;
}

template <class LeadingCoefficient>
bool SpectralFits(int64_t steps, LeadingCoefficient a) {
  return NsTotalGain(steps, a) <= kSpectralGainLimit;
}

inline double NsTotalGain(int64_t steps, NsTable table) {
  return NsTotalGain(steps, [table](int64_t t) { return NsTableRow(table, t).a; });
}

// Why the spectral form cannot run coefficients (named `what`) whose total
// gain is `gain`, or empty when it can (within kSpectralGainLimit).
inline std::string SpectralGainProblem(double gain, std::string_view what) {
  if (gain <= kSpectralGainLimit) return "";
  // As a double: the gain of a long or custom table may pass any integer
  // type (or be infinite).
  char shown[32];
  std::snprintf(shown, sizeof(shown), gain < 1e15 ? "%.0f" : "%.3g", gain);
  return "spectral keeps its accuracy up to a total gain (the product of a over the "
         "iterations) of " +
         std::to_string(static_cast<int64_t>(kSpectralGainLimit)) + "; " + std::string(what) +
         " gives " + shown + ": use gram, standard or auto";
}

// The same for `table` run `steps` iterations; the validators report it under
// their own field names. Steps outside [1, kMaxNsSteps] are the steps' own
// violation, and the gain (a loop over them) is not computed for them.
inline std::string SpectralGainProblem(int64_t steps, NsTable table) {
  if (steps < 1 || steps > kMaxNsSteps) return "";
  return SpectralGainProblem(NsTotalGain(steps, table),
                             std::string(NsTableName(table)) + " with " + std::to_string(steps) +
                                 " iterations");
}

// The part of the spectral form's m^3 term that is the eigensolver (dsyevd;
// the rest is Q = V diag(q) V^T by sgemm): about 176 of 198 ms at m = 1024
// on one thread (BM_SpectralPhases).
inline constexpr double kSpectralEigenShare = 0.89;

// How much faster the eigensolver runs on two OpenBLAS threads than on one
// (measured 1.14 at m = 1024: dsytrd 1.23, dstedc 1.15, dormtr 1.09), taken
// as its speed-up on any number T >= 2, where the products speed up about T.
inline constexpr double kSpectralEigenSpeedup = 1.14;

// The most threads a rank may run (TrainingConfig.threads_per_rank).
inline constexpr int64_t kMaxThreadsPerRank = 256;

// The spectral form's cost on a rank of `threads` OpenBLAS threads, in the
// counted FLOPs of the other forms at that thread count (see the top),
// rounded to whole FLOPs as the other forms' counts are: sums of whole
// numbers below 2^53 are exact in any order, and the runtime's check that
// it executed what the plan charged compares such sums exactly.
inline double SpectralNsFlops(int64_t rows, int64_t cols, int64_t threads = 1) {
  const double m = static_cast<double>(std::min(rows, cols));
  const double n = static_cast<double>(std::max(rows, cols));
  const double eigen_slowdown =
      threads <= 1 ? 1.0 : static_cast<double>(threads) / kSpectralEigenSpeedup;
  const double m3 = (1.0 - kSpectralEigenShare) + kSpectralEigenShare * eigen_slowdown;
  return std::nearbyint(kSpectralM2n * m * m * n + kSpectralM3 * m3 * m * m * m +
                        kSpectralM2 * eigen_slowdown * m * m);
}

// The form that runs for `algorithm` on this shape, on a rank of `threads`
// OpenBLAS threads: kAuto takes the form with the fewest FLOPs (ties go to
// the standard form, then to the Gram iteration), the spectral one only
// within kSpectralGainLimit and kSpectralMaxShortSide.
template <class LeadingCoefficient>
NsAlgorithm ChooseNsForm(NsAlgorithm algorithm, int64_t rows, int64_t cols, int64_t steps,
                         LeadingCoefficient a, int64_t threads = 1) {
  if (algorithm != NsAlgorithm::kAuto) return algorithm;
  NsAlgorithm best = NsAlgorithm::kStandard;
  double cost = StandardNsFlops(rows, cols, steps);
  if (const double gram = GramNsFlops(rows, cols, steps, a); gram < cost) {
    best = NsAlgorithm::kGram;
    cost = gram;
  }
  if (SpectralNsFlops(rows, cols, threads) < cost && SpectralFits(steps, a) &&
      std::min(rows, cols) <= kSpectralMaxShortSide) {
    best = NsAlgorithm::kSpectral;
  }
  return best;
}

inline NsAlgorithm ChooseNsForm(NsAlgorithm algorithm, int64_t rows, int64_t cols,
                                int64_t steps, NsTable table, int64_t threads = 1) {
  return ChooseNsForm(
      algorithm, rows, cols, steps, [table](int64_t t) { return NsTableRow(table, t).a; },
      threads);
}

// FLOPs of the form that runs (on a rank of `threads` OpenBLAS threads).
template <class LeadingCoefficient>
double NsFlops(NsAlgorithm algorithm, int64_t rows, int64_t cols, int64_t steps,
               LeadingCoefficient a, int64_t threads = 1) {
  switch (ChooseNsForm(algorithm, rows, cols, steps, a, threads)) {
    case NsAlgorithm::kGram:
      return GramNsFlops(rows, cols, steps, a);
    case NsAlgorithm::kSpectral:
      return SpectralNsFlops(rows, cols, threads);
    case NsAlgorithm::kStandard:
    case NsAlgorithm::kAuto:
      break;
  }
  return StandardNsFlops(rows, cols, steps);
}

inline double NsFlops(NsAlgorithm algorithm, int64_t rows, int64_t cols, int64_t steps,
                      NsTable table, int64_t threads = 1) {
  return NsFlops(
      algorithm, rows, cols, steps, [table](int64_t t) { return NsTableRow(table, t).a; },
      threads);
}

// "auto" | "standard" | "gram" | "spectral".
inline const char* NsAlgorithmName(NsAlgorithm algorithm) {
  switch (algorithm) {
    case NsAlgorithm::kStandard:
      return "standard";
    case NsAlgorithm::kGram:
      return "gram";
    case NsAlgorithm::kSpectral:
      return "spectral";
    case NsAlgorithm::kAuto:
      break;
  }
  return "auto";
}

// Why `algorithm` cannot run on `device` ("cpu" or "cuda"), or null when it
// can: the CUDA Gram form (worker/cuda/newton_schulz_cuda.h) is accurate but,
// measured on an H200, 3-12x slower than the standard form on every shape
// (its m x m products run in fp32, off the tensor cores; BENCHMARKS.md), so
// gram runs on the CPU only and auto means standard on cuda; spectral has no
// CUDA form. The planner and the job validator report this under their own
// field names.
inline const char* NsFormUnavailable(NsAlgorithm algorithm, std::string_view device) {
  if (device == "cpu") return nullptr;
  if (algorithm == NsAlgorithm::kGram) {
    return "gram runs on the CPU only (on a GPU its CUDA form measured 3-12x slower than "
           "standard); use auto or standard on cuda";
  }
  if (algorithm == NsAlgorithm::kSpectral) {
    return "spectral runs on the CPU only (it has no CUDA form); use auto or standard on cuda";
  }
  return nullptr;
}

// Parses a config value; false for anything else. Empty means auto.
inline bool ParseNsAlgorithm(std::string_view text, NsAlgorithm* out) {
  if (text.empty() || text == "auto") {
    *out = NsAlgorithm::kAuto;
  } else if (text == "standard") {
    *out = NsAlgorithm::kStandard;
  } else if (text == "gram") {
    *out = NsAlgorithm::kGram;
  } else if (text == "spectral") {
    *out = NsAlgorithm::kSpectral;
  } else {
    return false;
  }
  return true;
}

}  // namespace muonmesh::plan
