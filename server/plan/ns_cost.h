#pragma once

// Newton-Schulz coefficients, what one orthogonalisation of a rows x cols
// matrix costs in each of its two forms, and which form runs: the planner
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

#include <algorithm>
#include <array>
#include <cstdint>
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

// The form that runs for `algorithm` on this shape: kAuto takes the Gram
// form where it needs fewer FLOPs (ties go to the standard form).
template <class LeadingCoefficient>
NsAlgorithm ChooseNsForm(NsAlgorithm algorithm, int64_t rows, int64_t cols, int64_t steps,
                         LeadingCoefficient a) {
  if (algorithm != NsAlgorithm::kAuto) return algorithm;
  return GramNsFlops(rows, cols, steps, a) < StandardNsFlops(rows, cols, steps)
             ? NsAlgorithm::kGram
             : NsAlgorithm::kStandard;
}

inline NsAlgorithm ChooseNsForm(NsAlgorithm algorithm, int64_t rows, int64_t cols,
                                int64_t steps, NsTable table) {
  return ChooseNsForm(algorithm, rows, cols, steps,
                      [table](int64_t t) { return NsTableRow(table, t).a; });
}

// FLOPs of the form that runs.
template <class LeadingCoefficient>
double NsFlops(NsAlgorithm algorithm, int64_t rows, int64_t cols, int64_t steps,
               LeadingCoefficient a) {
  const double standard = StandardNsFlops(rows, cols, steps);
  if (algorithm == NsAlgorithm::kStandard) return standard;
  const double gram = GramNsFlops(rows, cols, steps, a);
  return algorithm == NsAlgorithm::kGram ? gram : std::min(gram, standard);
}

inline double NsFlops(NsAlgorithm algorithm, int64_t rows, int64_t cols, int64_t steps,
                      NsTable table) {
  return NsFlops(algorithm, rows, cols, steps,
                 [table](int64_t t) { return NsTableRow(table, t).a; });
}

// "auto" | "standard" | "gram".
inline const char* NsAlgorithmName(NsAlgorithm algorithm) {
  switch (algorithm) {
    case NsAlgorithm::kStandard:
      return "standard";
    case NsAlgorithm::kGram:
      return "gram";
    case NsAlgorithm::kAuto:
      break;
  }
  return "auto";
}

// Parses a config value; false for anything else. Empty means auto.
// Why `algorithm` cannot run on `device` ("cpu" or "cuda"), or null when it
// can: the CUDA Gram form (worker/cuda/newton_schulz_cuda.h) is accurate but,
// measured on an H200, 3-12x slower than the standard form on every shape
// (its m x m products run in fp32, off the tensor cores; BENCHMARKS.md), so
// gram runs on the CPU only and auto means standard on cuda. The planner and
// the job validator report this under their own field names.
inline const char* NsFormUnavailable(NsAlgorithm algorithm, std::string_view device) {
  if (algorithm == NsAlgorithm::kGram && device != "cpu") {
    return "gram runs on the CPU only (on a GPU its CUDA form measured 3-12x slower than "
           "standard); use auto or standard on cuda";
  }
  return nullptr;
}

inline bool ParseNsAlgorithm(std::string_view text, NsAlgorithm* out) {
  if (text.empty() || text == "auto") {
    *out = NsAlgorithm::kAuto;
  } else if (text == "standard") {
    *out = NsAlgorithm::kStandard;
  } else if (text == "gram") {
    *out = NsAlgorithm::kGram;
  } else {
    return false;
  }
  return true;
}

}  // namespace muonmesh::plan
