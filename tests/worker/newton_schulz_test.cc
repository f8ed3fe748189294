#include "worker/math/newton_schulz.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "core/plan/ns_cost.h"
#include "worker/math/blas_threads.h"
#include "worker/math/orthogonality.h"
#include "core/optim/ns_coefficients.h"
#include "tests/worker/ns_reference.h"

namespace muonmesh::math {
namespace {

using testing::Gaussian;
using testing::IllConditioned;
using testing::kPolarExpress;
using testing::kQuintic;
using testing::ReferenceNewtonSchulz;
using testing::RelativeFrobenius;
using testing::SingularValues;
using testing::TransposedFloats;
using testing::Triple;

struct Shape {
  int64_t rows;
  int64_t cols;
};

optim::NsOptions Quintic(int steps = 5, plan::NsAlgorithm algorithm = plan::NsAlgorithm::kStandard) {
  optim::NsOptions o;
  o.steps = steps;
  o.algorithm = algorithm;
  return o;
}

optim::NsOptions PolarExpress(int steps, plan::NsAlgorithm algorithm = plan::NsAlgorithm::kStandard) {
  optim::NsOptions o;
  o.steps = steps;
  o.coefficients = optim::NsCoefficients::kPolarExpress;
  o.algorithm = algorithm;
  return o;
}

constexpr plan::NsAlgorithm kGram = plan::NsAlgorithm::kGram;
constexpr plan::NsAlgorithm kSpectral = plan::NsAlgorithm::kSpectral;

// The fp32 OpenBLAS kernel against the plain fp64 loops of ns_reference.h.
// Achieved errors are printed so regressions in accuracy are visible.
TEST(NewtonSchulzTest, MatchesFp64Reference) {
  const Shape shapes[] = {{16, 48}, {48, 16}, {64, 64}, {33, 70}, {70, 33}, {1, 40}, {40, 1}};
  NewtonSchulz ns;
  uint64_t seed = 1;
  for (const Shape& s : shapes) {
    for (int variant = 0; variant < 3; ++variant) {
      const std::vector<float> x = Gaussian(s.rows * s.cols, seed++);
      optim::NsOptions options;
      std::vector<Triple> coeffs;
      if (variant == 0) {
        options = Quintic(5);
        coeffs = {kQuintic};
      } else if (variant == 1) {
        options = PolarExpress(5);
        coeffs = kPolarExpress;
      } else {
        options = PolarExpress(10);  // past the table: the last row repeats
        coeffs = kPolarExpress;
      }
      std::vector<float> y = x;
      ASSERT_TRUE(ns.Run(y.data(), s.rows, s.cols, options).ok());
      const testing::Mat ref =
          ReferenceNewtonSchulz(testing::FromFloats(x, s.rows, s.cols), options.steps, coeffs);
      const double err = RelativeFrobenius(y, ref);
      EXPECT_LE(err, 1e-5) << s.rows << "x" << s.cols << " variant " << variant;
      std::printf("fp32 vs fp64: %3lldx%-3lld variant %d (steps %d)  rel err %.2e\n",
                  static_cast<long long>(s.rows), static_cast<long long>(s.cols), variant,
                  options.steps, err);
    }
  }
}

// The Gram form, iterated and spectral, against the fp64 reference of the
// *standard* iteration: aspect ratios 1:1 to 1:16, wide and tall, quintic
// and Polar Express (5 and past the table), on Gaussian, ill-conditioned
// (singular values spread geometrically over 1e-6 .. 1) and rank-deficient
// inputs.
class NewtonSchulzGramFormsTest : public ::testing::TestWithParam<plan::NsAlgorithm> {};

TEST_P(NewtonSchulzGramFormsTest, MatchesTheStandardFp64Reference) {
  const plan::NsAlgorithm form = GetParam();
  const Shape shapes[] = {{32, 32}, {32, 64}, {16, 64}, {16, 128}, {8, 128},
                          {64, 16}, {128, 8}, {24, 200}, {48, 96}};
  NewtonSchulz ns;
  uint64_t seed = 500;
  double worst = 0;
  double worst_of_bound[3] = {0, 0, 0};  // per variant: error / its bound
  for (const Shape& s : shapes) {
    const int64_t m = std::min(s.rows, s.cols);
    for (int input = 0; input < 3; ++input) {
      std::vector<float> x;
      if (input == 0) {
        x = Gaussian(s.rows * s.cols, seed++);
      } else {
        x = IllConditioned(s.rows, s.cols, seed++, input == 2 ? m / 2 : -1);
      }
      for (int variant = 0; variant < 3; ++variant) {
        optim::NsOptions options = variant == 0   ? Quintic(5, form)
                            : variant == 1 ? PolarExpress(5, form)
                                           : PolarExpress(10, form);
        if (form == kSpectral && variant == 2) {
          // Past its gain limit (plan::kSpectralGainLimit; ns_cost.h has the
          // errors that set it): refused, x untouched.
          std::vector<float> refused = x;
          EXPECT_EQ(ns.Run(refused.data(), s.rows, s.cols, options).code(),
                    absl::StatusCode::kInvalidArgument);
          EXPECT_EQ(refused, x);
          continue;
        }
        const std::vector<Triple> coeffs =
            variant == 0 ? std::vector<Triple>{kQuintic} : kPolarExpress;
        std::vector<float> y = x;
        ASSERT_TRUE(ns.Run(y.data(), s.rows, s.cols, options).ok());
        optim::NsOptions standard_options = options;
        standard_options.algorithm = plan::NsAlgorithm::kStandard;
        std::vector<float> z = x;
        ASSERT_TRUE(ns.Run(z.data(), s.rows, s.cols, standard_options).ok());
        const testing::Mat ref =
            ReferenceNewtonSchulz(testing::FromFloats(x, s.rows, s.cols), options.steps, coeffs);
        const double err = RelativeFrobenius(y, ref);
        const double standard_err = RelativeFrobenius(z, ref);
        worst = std::max(worst, err);
        // 1e-4; where the standard form's own fp32 rounding is already near
        // that (10 Polar Express iterations on ill-conditioned inputs reach
        // 3e-4), no worse than 1.5 times it.
        const double bound = std::max(1e-4, 1.5 * standard_err);
        worst_of_bound[variant] = std::max(worst_of_bound[variant], err / bound);
        EXPECT_LE(err, bound)
            << s.rows << "x" << s.cols << " input " << input << " variant " << variant
            << " (standard form: " << standard_err << ")";
      }
    }
  }
  char last[32] = "refused";
  if (form != kSpectral) std::snprintf(last, sizeof(last), "%.2f", worst_of_bound[2]);
  std::printf(
      "%s form fp32 vs standard fp64: worst rel err %.2e; worst error / bound: quintic %.2f, "
      "polar_express 5 %.2f, 10 %s\n",
      plan::NsAlgorithmName(form), worst, worst_of_bound[0], worst_of_bound[1], last);
}

// The Gram form's recurrence written here in float loops (no BLAS), with
// restarts (X = Q X_0, R = X X^T, Q = I) at the given iterations. Like the
// form as it runs, it keeps every m x m product symmetric (its upper
// triangle, mirrored) unless told not to: in floating point P and Q commute
// only approximately, and this is what makes the restarts necessary as often
// as they are (TheDriftLimitSitsBetweenItsMeasuredSides).
std::vector<float> FloatGram(const std::vector<float>& x, int64_t m, int64_t n, int steps,
                             const std::vector<Triple>& coeffs, const std::vector<int>& restarts,
                             bool keep_symmetric = true) {
  auto mul = [](const std::vector<float>& a, const std::vector<float>& b, int64_t r, int64_t k,
                int64_t c) {
    std::vector<float> out(static_cast<size_t>(r * c), 0.0f);
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < k; ++j)
        for (int64_t l = 0; l < c; ++l) out[i * c + l] += a[i * k + j] * b[j * c + l];
    return out;
  };
  double norm = 0;
  for (float v : x) norm += static_cast<double>(v) * v;
  norm = std::sqrt(norm);
  std::vector<float> x0(x.size());
  for (size_t i = 0; i < x.size(); ++i) x0[i] = static_cast<float>(x[i] / norm);
  auto symmetric = [m, keep_symmetric](std::vector<float> a) {
    if (!keep_symmetric) return a;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < i; ++j) a[i * m + j] = a[j * m + i];
    return a;
  };
  std::vector<float> r, q;
  for (int t = 0; t < steps; ++t) {
    if (t == 0 || std::find(restarts.begin(), restarts.end(), t) != restarts.end()) {
      if (t > 0) x0 = mul(q, x0, m, m, n);
      r = symmetric(mul(x0, TransposedFloats(x0, m, n), m, n, m));
      q.assign(static_cast<size_t>(m * m), 0.0f);
      for (int64_t i = 0; i < m; ++i) q[i * m + i] = 1.0f;
    }
    const Triple k = coeffs[std::min<size_t>(t, coeffs.size() - 1)];
    const std::vector<float> r2 = symmetric(mul(r, r, m, m, m));
    std::vector<float> p(r.size());
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] = static_cast<float>(k[1] * r[i] + k[2] * r2[i]);
    }
    for (int64_t i = 0; i < m; ++i) p[i * m + i] += static_cast<float>(k[0]);
    q = symmetric(mul(p, q, m, m, m));
    r = symmetric(mul(symmetric(mul(p, p, m, m, m)), r, m, m, m));
  }
  return mul(q, x0, m, m, n);
}

// The restart is what keeps the Gram form accurate: the same ill-conditioned
// inputs, once through the form as it runs and once through FloatGram without
// restarts, against the fp64 reference (printed): restarted, it stays within
// 1.5x of the standard form's own fp32 error (or 1e-4); without restarts it
// is 100x worse.
TEST(NewtonSchulzGramTest, RestartBoundsTheDrift) {
  const int64_t m = 48, n = 192;
  const std::vector<float> x = IllConditioned(m, n, 77);
  const testing::Mat ref = ReferenceNewtonSchulz(testing::FromFloats(x, m, n), 8, kPolarExpress);
  std::vector<float> y = x, z = x;
  NewtonSchulz ns;
  ASSERT_TRUE(ns.Run(y.data(), m, n, PolarExpress(8, kGram)).ok());
  const double restarted = RelativeFrobenius(y, ref);
  ASSERT_TRUE(ns.Run(z.data(), m, n, PolarExpress(8)).ok());
  const double standard = RelativeFrobenius(z, ref);
  const double drifted = RelativeFrobenius(FloatGram(x, m, n, 8, kPolarExpress, {}), ref);
  std::printf("8 Polar Express steps, 48x192, sv 1e-6..1: Gram restarted %.2e, never "
              "restarted %.2e; standard form %.2e\n",
              restarted, drifted, standard);
  EXPECT_LE(restarted, std::max(1e-4, 1.5 * standard));
  EXPECT_LT(100 * restarted, drifted);
}

// The drift limit (plan::kGramDriftLimit) sits between two measured sides,
// on ill-conditioned and rank-deficient 16x128 inputs in FloatGram: the
// quintic's segments of 3 (its R amplified by a^4 = 141) stay well within
// the accuracy bound, while Polar Express with iterations 2-4 in one segment
// (R amplified by 165) exceeds it on some input. The rule restarts them
// accordingly. That segment fails because the products are kept symmetric:
// with the full products it stays within the bound.
TEST(NewtonSchulzGramTest, TheDriftLimitSitsBetweenItsMeasuredSides) {
  const auto restarts = [](const std::vector<Triple>& coeffs, int steps) {
    const auto lead = [&](int64_t t) { return coeffs[std::min<size_t>(t, coeffs.size() - 1)][0]; };
    std::vector<int> out;
    for (int t = 1; t < steps; ++t) {
      if (plan::GramStartsAt(t, lead)) out.push_back(t);
    }
    return out;
  };
  ASSERT_EQ(restarts({kQuintic}, 5), std::vector<int>{3});
  ASSERT_EQ(restarts(kPolarExpress, 5), (std::vector<int>{2, 4}));

  const int64_t m = 16, n = 128;
  double quintic_worst = 0, polar_worst = 0, polar_full_worst = 0;
  for (uint64_t seed = 900; seed < 904; ++seed) {
    const std::vector<float> x = IllConditioned(m, n, seed, seed % 2 == 0 ? m : m / 2);
    const testing::Mat x64 = testing::FromFloats(x, m, n);
    const testing::Mat quintic_ref = ReferenceNewtonSchulz(x64, 5, {kQuintic});
    const testing::Mat polar_ref = ReferenceNewtonSchulz(x64, 5, kPolarExpress);
    std::vector<float> z = x, w = x;
    NewtonSchulz ns;
    ASSERT_TRUE(ns.Run(z.data(), m, n, Quintic(5)).ok());
    ASSERT_TRUE(ns.Run(w.data(), m, n, PolarExpress(5)).ok());
    const double quintic_bound = std::max(1e-4, 1.5 * RelativeFrobenius(z, quintic_ref));
    const double polar_bound = std::max(1e-4, 1.5 * RelativeFrobenius(w, polar_ref));
    quintic_worst = std::max(
        quintic_worst,
        RelativeFrobenius(FloatGram(x, m, n, 5, {kQuintic}, {3}), quintic_ref) / quintic_bound);
    polar_worst = std::max(
        polar_worst,
        RelativeFrobenius(FloatGram(x, m, n, 5, kPolarExpress, {2}), polar_ref) / polar_bound);
    polar_full_worst = std::max(
        polar_full_worst,
        RelativeFrobenius(FloatGram(x, m, n, 5, kPolarExpress, {2}, false), polar_ref) /
            polar_bound);
  }
  std::printf("16x128, sv 1e-6..1, error / bound: quintic restarted at 3 %.2f, Polar Express "
              "restarted at 2 only %.2f (full products %.2f)\n",
              quintic_worst, polar_worst, polar_full_worst);
  EXPECT_LT(quintic_worst, 0.25);
  EXPECT_GT(polar_worst, 1.0);
  EXPECT_LT(polar_full_worst, 1.0);
}

// The restart limit was measured on small matrices and checked on larger
// ones (BENCHMARKS.md): the largest of them here, ill-conditioned and
// rank-deficient, quintic and Polar Express, within the same bound.
TEST_P(NewtonSchulzGramFormsTest, ALargerShapeStaysWithinTheBound) {
  const int64_t m = 256, n = 2048;
  NewtonSchulz ns;
  for (int64_t rank : {m, m / 2}) {
    const std::vector<float> x = IllConditioned(m, n, 1300 + static_cast<uint64_t>(rank), rank);
    for (const optim::NsOptions& gram : {Quintic(5, GetParam()), PolarExpress(5, GetParam())}) {
      const std::vector<Triple> coeffs =
          gram.coefficients == optim::NsCoefficients::kQuintic ? std::vector<Triple>{kQuintic}
                                                        : kPolarExpress;
      const testing::Mat ref = ReferenceNewtonSchulz(testing::FromFloats(x, m, n), 5, coeffs);
      optim::NsOptions standard = gram;
      standard.algorithm = plan::NsAlgorithm::kStandard;
      std::vector<float> y = x, z = x;
      ASSERT_TRUE(ns.Run(y.data(), m, n, gram).ok());
      ASSERT_TRUE(ns.Run(z.data(), m, n, standard).ok());
      const double err = RelativeFrobenius(y, ref);
      const double standard_err = RelativeFrobenius(z, ref);
      std::printf("256x2048 rank %lld %s: %s %.2e, standard %.2e\n",
                  static_cast<long long>(rank), coeffs.size() == 1 ? "quintic" : "polar_express",
                  plan::NsAlgorithmName(GetParam()), err, standard_err);
      EXPECT_LE(err, std::max(1e-4, 1.5 * standard_err));
    }
  }
}

TEST_P(NewtonSchulzGramFormsTest, TransposeCommutesAndZeroStaysZero) {
  NewtonSchulz ns;
  const std::vector<float> x = Gaussian(20 * 70, 8);
  std::vector<float> y = x;
  std::vector<float> yt = TransposedFloats(x, 20, 70);
  ASSERT_TRUE(ns.Run(y.data(), 20, 70, Quintic(5, GetParam())).ok());
  ASSERT_TRUE(ns.Run(yt.data(), 70, 20, Quintic(5, GetParam())).ok());
  EXPECT_EQ(TransposedFloats(y, 20, 70), yt);
  std::vector<float> zero(20 * 70, 0.0f);
  ASSERT_TRUE(ns.Run(zero.data(), 20, 70, Quintic(5, GetParam())).ok());
  EXPECT_EQ(zero, std::vector<float>(20 * 70, 0.0f));
}

INSTANTIATE_TEST_SUITE_P(Forms, NewtonSchulzGramFormsTest, ::testing::Values(kGram, kSpectral),
                         [](const ::testing::TestParamInfo<plan::NsAlgorithm>& info) {
                           return std::string(plan::NsAlgorithmName(info.param));
                         });

// auto runs exactly what its choice (plan::ChooseNsForm) names: bit for bit
// the spectral form on a very wide matrix (at 5 quintic iterations it needs
// the fewest FLOPs there; on narrower small ones its eigensolver's m^2 term
// leaves them to the Gram iteration) and the standard form on a square one.
TEST(NewtonSchulzGramTest, AutoRunsTheChosenForm) {
  NewtonSchulz ns;
  for (const Shape s : {Shape{16, 8192}, Shape{8192, 16}, Shape{40, 40}}) {
    const std::vector<float> x = Gaussian(s.rows * s.cols, 3);
    const plan::NsAlgorithm chosen =
        plan::ChooseNsForm(plan::NsAlgorithm::kAuto, s.rows, s.cols, 5, plan::NsTable::kQuintic);
    EXPECT_EQ(chosen, s.rows == s.cols ? plan::NsAlgorithm::kStandard : kSpectral);
    std::vector<float> automatic = x, fixed = x;
    ASSERT_TRUE(
        ns.Run(automatic.data(), s.rows, s.cols, Quintic(5, plan::NsAlgorithm::kAuto)).ok());
    ASSERT_TRUE(ns.Run(fixed.data(), s.rows, s.cols, Quintic(5, chosen)).ok());
    EXPECT_EQ(automatic, fixed) << s.rows << "x" << s.cols;
    // And the two forms differ in their rounding, so the check means something.
    std::vector<float> other = x;
    const plan::NsAlgorithm other_form =
        chosen == plan::NsAlgorithm::kStandard ? kGram : plan::NsAlgorithm::kStandard;
    ASSERT_TRUE(ns.Run(other.data(), s.rows, s.cols, Quintic(5, other_form)).ok());
    EXPECT_NE(automatic, other) << s.rows << "x" << s.cols;
  }
}

// auto prices the spectral form's eigensolver for the threads it is told
// (plan/ns_cost.h: on two threads the Gram iteration wins up to n / m =
// 13.64 at m = 1024, and further at smaller m); SetBlasThreads sets OpenBLAS's count and returns the one before.
TEST(NewtonSchulzGramTest, AutoFollowsTheThreadsItIsPricedFor) {
  optim::NsOptions options = Quintic(5, plan::NsAlgorithm::kAuto);
  EXPECT_EQ(optim::NsFormFor(options, 1024, 4096), kSpectral);
  options.threads = 2;
  EXPECT_EQ(optim::NsFormFor(options, 1024, 4096), kGram);
  EXPECT_EQ(optim::NsFormFor(options, 4096, 1024), kGram);
  EXPECT_EQ(optim::NsFormFor(options, 64, 1024), kGram);       // 16:1, small
  EXPECT_EQ(optim::NsFormFor(options, 64, 8192), kSpectral);  // 128:1
  EXPECT_DOUBLE_EQ(optim::NsFlopsFor(options, 1024, 4096),
                   plan::GramNsFlops(1024, 4096, 5, plan::NsTable::kQuintic));
  const int before = SetBlasThreads(3);
  const int limit = BlasThreads();  // below 3 only in a build for fewer threads
  EXPECT_EQ(SetBlasThreads(0), limit);  // clamped to one
  EXPECT_EQ(BlasThreads(), 1);
  SetBlasThreads(before);
  if (limit < 3) GTEST_SKIP() << "this OpenBLAS runs at most " << limit << " threads";
  EXPECT_EQ(limit, 3);
}

TEST(NewtonSchulzTest, BatchedEqualsPerMatrixBitForBit) {
  for (const Shape s : {Shape{24, 40}, Shape{40, 24}, Shape{17, 17}}) {
    const int64_t count = 5;
    const int64_t size = s.rows * s.cols;
    const std::vector<float> stack = Gaussian(count * size, 99);
    // Every form (the Gram forms forced even on the square shape).
    for (const optim::NsOptions& options :
         {Quintic(), PolarExpress(9), Quintic(5, kGram), PolarExpress(9, kGram),
          Quintic(5, kSpectral), PolarExpress(5, kSpectral)}) {
      std::vector<float> batched = stack;
      NewtonSchulz ns_batched;
      // A larger matrix first, so stale workspace contents would show.
      std::vector<float> big = Gaussian(60 * 70, 5);
      ASSERT_TRUE(ns_batched.Run(big.data(), 60, 70, options).ok());
      ASSERT_TRUE(ns_batched.RunBatched(batched.data(), count, s.rows, s.cols, options).ok());
      for (int64_t e = 0; e < count; ++e) {
        NewtonSchulz ns_single;
        std::vector<float> one(stack.begin() + e * size, stack.begin() + (e + 1) * size);
        ASSERT_TRUE(ns_single.Run(one.data(), s.rows, s.cols, options).ok());
        EXPECT_EQ(0, std::memcmp(one.data(), batched.data() + e * size, size * sizeof(float)))
            << "matrix " << e << " of " << s.rows << "x" << s.cols;
      }
    }
  }
}

TEST(NewtonSchulzTest, TransposeCommutes) {
  NewtonSchulz ns;
  for (const Shape s : {Shape{20, 52}, Shape{52, 20}, Shape{31, 31}}) {
    const std::vector<float> x = Gaussian(s.rows * s.cols, 7);
    std::vector<float> y = x;
    std::vector<float> yt = TransposedFloats(x, s.rows, s.cols);
    ASSERT_TRUE(ns.Run(y.data(), s.rows, s.cols, Quintic()).ok());
    ASSERT_TRUE(ns.Run(yt.data(), s.cols, s.rows, Quintic()).ok());
    const std::vector<float> y_t = TransposedFloats(y, s.rows, s.cols);
    if (s.rows != s.cols) {
      // Exactly: the tall orientation is transposed into the workspace, so
      // both are laid out identically before any arithmetic.
      EXPECT_EQ(y_t, yt) << s.rows << "x" << s.cols;
    } else {
      // Square matrices are not transposed: X X^T and X^T X round
      // differently, so only to fp32 accuracy.
      EXPECT_LE(RelativeFrobenius(yt, testing::FromFloats(y_t, s.rows, s.cols)), 1e-5);
    }
  }
}

// Aspect ratio >= 4: the Marchenko-Pastur spread is at most 3:1, and five
// quintic steps bring all of it into [0.6, 1.25].
TEST(NewtonSchulzTest, WideGaussianSingularValuesInBand) {
  const Shape shapes[] = {{16, 64}, {64, 16}, {32, 128}, {128, 32}, {64, 256}, {10, 100}};
  NewtonSchulz ns;
  uint64_t seed = 100;
  for (const Shape& s : shapes) {
    std::vector<float> x = Gaussian(s.rows * s.cols, seed++);
    ASSERT_TRUE(ns.Run(x.data(), s.rows, s.cols, Quintic()).ok());
    const std::vector<double> sv = SingularValues(x, s.rows, s.cols);
    EXPECT_GE(sv.front(), 0.6) << s.rows << "x" << s.cols;
    EXPECT_LE(sv.back(), 1.25) << s.rows << "x" << s.cols;
  }
}

// Any input, however conditioned: the largest singular value stays <= 1.25.
TEST(NewtonSchulzTest, AnyInputLargestSingularValueBounded) {
  std::vector<std::pair<Shape, std::vector<float>>> inputs;
  inputs.push_back({{48, 48}, Gaussian(48 * 48, 1)});   // square: tiny sigma_min
  inputs.push_back({{30, 50}, Gaussian(30 * 50, 2, 1e-6)});   // small (norm > eps)
  inputs.push_back({{30, 50}, Gaussian(30 * 50, 3, 1e20)});   // huge scale
  {
    std::vector<float> rank1(40 * 24);  // u v^T
    for (int i = 0; i < 40; ++i)
      for (int j = 0; j < 24; ++j) rank1[i * 24 + j] = static_cast<float>((i + 1) * (j % 5 - 2));
    inputs.push_back({{40, 24}, rank1});
  }
  {
    std::vector<float> eye(32 * 32, 0.0f);  // all singular values equal
    for (int i = 0; i < 32; ++i) eye[i * 32 + i] = 1.0f;
    inputs.push_back({{32, 32}, eye});
  }
  {
    std::vector<float> spread(24 * 36, 0.0f);  // sigma from 1e-6 to 1e3
    for (int i = 0; i < 24; ++i) spread[i * 36 + i] = static_cast<float>(std::pow(10.0, -6.0 + 9.0 * i / 23));
    inputs.push_back({{24, 36}, spread});
  }
  {
    std::vector<float> single(20 * 30, 0.0f);
    single[7 * 30 + 11] = -3.0f;
    inputs.push_back({{20, 30}, single});
  }
  inputs.push_back({{1, 64}, Gaussian(64, 4)});
  inputs.push_back({{64, 1}, Gaussian(64, 5)});
  inputs.push_back({{12, 60}, std::vector<float>(12 * 60, 1.0f)});
  NewtonSchulz ns;
  for (auto& [s, x] : inputs) {
    ASSERT_TRUE(ns.Run(x.data(), s.rows, s.cols, Quintic()).ok());
    const std::vector<double> sv = SingularValues(x, s.rows, s.cols);
    EXPECT_LE(sv.back(), 1.25) << s.rows << "x" << s.cols;
    EXPECT_GT(sv.back(), 0.5) << s.rows << "x" << s.cols;  // it did something
  }
  // Norm below eps (1e-7): divided by eps, not by the norm, as in torch; the
  // result stays small and bounded.
  std::vector<float> tiny = Gaussian(30 * 50, 2, 1e-20);
  ASSERT_TRUE(ns.Run(tiny.data(), 30, 50, Quintic()).ok());
  EXPECT_LE(SingularValues(tiny, 30, 50).back(), 1e-6);
}

TEST(NewtonSchulzTest, NonFiniteInputRefusedAndUntouched) {
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  NewtonSchulz ns;
  for (float b : bad) {
    for (const Shape s : {Shape{8, 12}, Shape{12, 8}}) {
      std::vector<float> x = Gaussian(s.rows * s.cols, 3);
      x[17] = b;
      const std::vector<float> before = x;
      const absl::Status status = ns.Run(x.data(), s.rows, s.cols, Quintic());
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_EQ(0, std::memcmp(before.data(), x.data(), x.size() * sizeof(float)));
    }
    // Batched: a bad value in the last matrix leaves every matrix untouched.
    std::vector<float> stack = Gaussian(4 * 6 * 10, 4);
    stack.back() = b;
    const std::vector<float> before = stack;
    EXPECT_EQ(ns.RunBatched(stack.data(), 4, 6, 10, Quintic()).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(0, std::memcmp(before.data(), stack.data(), stack.size() * sizeof(float)));
  }
}

// The spectral form past its limits is refused before anything is touched
// or allocated: a short side over LAPACK's (checked without the memory such
// a matrix would take: the shape is refused first).
TEST(NewtonSchulzTest, SpectralPastItsShortSideIsRefused) {
  NewtonSchulz ns;
  float x = 1.0f;
  const absl::Status s =
      ns.Run(&x, plan::kSpectralMaxShortSide + 1, plan::kSpectralMaxShortSide + 1,
             Quintic(5, kSpectral));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("short side"), std::string::npos) << s;
  EXPECT_EQ(ns.workspace_bytes(), 0u);
}

TEST(NewtonSchulzTest, DivergingTableRefusedAndUntouched) {
  optim::NsOptions options;
  options.coefficients = optim::NsCoefficients::kTable;
  options.table = {{1e12, 0.0, 0.0}};
  options.steps = 10;  // 1e120 overflows float
  std::vector<float> x = Gaussian(6 * 9, 8);
  const std::vector<float> before = x;
  NewtonSchulz ns;
  EXPECT_EQ(ns.Run(x.data(), 6, 9, options).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(before, x);
}

TEST(NewtonSchulzTest, ZeroMatrixStaysZero) {
  NewtonSchulz ns;
  for (const Shape s : {Shape{5, 9}, Shape{9, 5}, Shape{1, 1}}) {
    std::vector<float> x(s.rows * s.cols, 0.0f);
    ASSERT_TRUE(ns.Run(x.data(), s.rows, s.cols, Quintic()).ok());
    for (float v : x) EXPECT_EQ(v, 0.0f);
  }
}

// A vector has one singular value, 1 after normalisation, which each step
// maps through s -> a s + b s^3 + c s^5: NS(v) = s_T v / ||v||.
TEST(NewtonSchulzTest, RowAndColumnVectors) {
  const std::vector<float> v = Gaussian(37, 12);
  double norm = 0.0;
  for (float e : v) norm += static_cast<double>(e) * e;
  norm = std::sqrt(norm);
  for (int steps : {1, 5}) {
    double s = 1.0;
    for (int t = 0; t < steps; ++t) s = testing::ScalarIteration(s, kQuintic);
    NewtonSchulz ns;
    for (const Shape shape : {Shape{1, 37}, Shape{37, 1}}) {
      std::vector<float> x = v;
      ASSERT_TRUE(ns.Run(x.data(), shape.rows, shape.cols, Quintic(steps)).ok());
      for (size_t i = 0; i < v.size(); ++i) {
        EXPECT_NEAR(x[i], s * v[i] / norm, 1e-6) << i;
      }
    }
  }
}

TEST(NewtonSchulzTest, EmptyIsNoOp) {
  NewtonSchulz ns;
  EXPECT_TRUE(ns.Run(nullptr, 0, 16, Quintic()).ok());
  EXPECT_TRUE(ns.Run(nullptr, 16, 0, Quintic()).ok());
  EXPECT_TRUE(ns.RunBatched(nullptr, 0, 8, 8, Quintic()).ok());
  EXPECT_TRUE(ns.RunBatched(nullptr, 3, 0, 8, Quintic()).ok());
  EXPECT_EQ(ns.workspace_bytes(), 0u);
}

TEST(NewtonSchulzTest, InvalidOptionsAndShapesRefused) {
  NewtonSchulz ns;
  std::vector<float> x = Gaussian(4 * 6, 2);
  const std::vector<float> before = x;
  optim::NsOptions zero_steps = Quintic(0);
  EXPECT_EQ(ns.Run(x.data(), 4, 6, zero_steps).code(), absl::StatusCode::kInvalidArgument);
  optim::NsOptions empty_table;
  empty_table.coefficients = optim::NsCoefficients::kTable;
  EXPECT_EQ(ns.Run(x.data(), 4, 6, empty_table).code(), absl::StatusCode::kInvalidArgument);
  optim::NsOptions bad_eps;
  bad_eps.eps = 0.0;
  EXPECT_EQ(ns.Run(x.data(), 4, 6, bad_eps).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ns.Run(x.data(), -1, 6, Quintic()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(before, x);
}

TEST(NewtonSchulzTest, CoefficientChoices) {
  const std::vector<float> x = Gaussian(12 * 20, 21);
  NewtonSchulz ns;
  std::vector<float> quintic = x, table = x, polar = x;
  ASSERT_TRUE(ns.Run(quintic.data(), 12, 20, Quintic()).ok());
  optim::NsOptions as_table;
  as_table.coefficients = optim::NsCoefficients::kTable;
  as_table.table = {{3.4445, -4.7750, 2.0315}};
  as_table.algorithm = plan::NsAlgorithm::kStandard;
  ASSERT_TRUE(ns.Run(table.data(), 12, 20, as_table).ok());
  EXPECT_EQ(quintic, table);  // one row, repeated: the quintic, bit for bit
  ASSERT_TRUE(ns.Run(polar.data(), 12, 20, PolarExpress(5)).ok());
  EXPECT_NE(quintic, polar);
  // Polar Express lands closer to orthogonal than the quintic in 5 steps.
  const std::vector<double> sq = SingularValues(quintic, 12, 20);
  const std::vector<double> sp = SingularValues(polar, 12, 20);
  double dq = 0.0, dp = 0.0;
  for (size_t i = 0; i < sq.size(); ++i) {
    dq = std::max(dq, std::fabs(sq[i] - 1.0));
    dp = std::max(dp, std::fabs(sp[i] - 1.0));
  }
  EXPECT_LT(dp, dq);
}

// A named table maps to the planner's name and back; a custom one has none.
TEST(NewtonSchulzTest, NamedTablesMapToThePlannersNames) {
  for (plan::NsTable t : {plan::NsTable::kQuintic, plan::NsTable::kPolarExpress}) {
    EXPECT_EQ(optim::NsTableOf(optim::NsCoefficientsOf(t)), t);
  }
  EXPECT_EQ(optim::NsCoefficientsOf(plan::NsTable::kPolarExpress), optim::NsCoefficients::kPolarExpress);
  EXPECT_EQ(optim::NsTableOf(optim::NsCoefficients::kTable), std::nullopt);
}

TEST(NewtonSchulzTest, ReserveAvoidsGrowth) {
  NewtonSchulz ns;
  ASSERT_TRUE(ns.Reserve(30, 80).ok());
  const size_t bytes = ns.workspace_bytes();
  // Both forms' buffers: two m x n, four m x m.
  EXPECT_EQ(bytes, (2 * 30 * 80 + 4 * 30 * 30) * sizeof(float));
  std::vector<float> x = Gaussian(80 * 30, 1);
  ASSERT_TRUE(ns.Run(x.data(), 80, 30, Quintic()).ok());  // other orientation
  ASSERT_TRUE(ns.Run(x.data(), 80, 30, Quintic(5, kGram)).ok());
  ASSERT_TRUE(ns.Run(x.data(), 20, 40, Quintic()).ok());  // smaller
  EXPECT_EQ(ns.workspace_bytes(), bytes);
  // The spectral form adds G (m x m), its eigenvalues, a block of X_0 (m x
  // 512) and LAPACK dsyevd's work (1 + 6 m + 2 m^2 doubles, 3 + 5 m ints).
  ASSERT_TRUE(ns.Reserve(30, 80, kSpectral).ok());
  const size_t spectral_bytes = ns.workspace_bytes();
  EXPECT_EQ(spectral_bytes, bytes + (30 * 30 + 30 + 30 * 512 + 1 + 6 * 30 + 2 * 30 * 30) * 8 +
                                (3 + 5 * 30) * 4);
  EXPECT_EQ(spectral_bytes, NewtonSchulz::WorkspaceBytes(80, 30, kSpectral));
  ASSERT_TRUE(ns.Run(x.data(), 80, 30, Quintic(5, kSpectral)).ok());
  EXPECT_EQ(ns.workspace_bytes(), spectral_bytes);
}

// What the memory estimate counts for a rank's matrices is what one object
// really holds after running them: each buffer at its own largest size, the
// spectral buffers from any spectral matrix on.
TEST(NewtonSchulzTest, TheWorkspaceBoundIsWhatRunningTheShapesHolds) {
  struct Shape {
    int64_t rows, cols;
    plan::NsAlgorithm form;
  };
  const Shape shapes[] = {{24, 200, kSpectral}, {96, 96, plan::NsAlgorithm::kStandard},
                          {40, 80, kGram}, {160, 48, kSpectral}, {8, 16, kSpectral}};
  NewtonSchulz ns;
  NsWorkspaceBound bound;
  size_t largest_single = 0;
  uint64_t seed = 900;
  for (const Shape& s : shapes) {
    std::vector<float> x = Gaussian(s.rows * s.cols, seed++);
    ASSERT_TRUE(ns.Run(x.data(), s.rows, s.cols, Quintic(5, s.form)).ok());
    bound.Add(s.rows, s.cols, s.form);
    EXPECT_EQ(ns.workspace_bytes(), bound.bytes()) << s.rows << "x" << s.cols;
    largest_single =
        std::max(largest_single, NewtonSchulz::WorkspaceBytes(s.rows, s.cols, s.form));
  }
  // The wide spectral matrix and the square one together hold more than
  // either alone, which the largest single workspace missed.
  EXPECT_GT(bound.bytes(), largest_single);
}

// OrthogonalityError against matrices whose singular values are known: a
// scaled permutation-with-signs (every singular value s) gives
// sqrt(m (s^2 - 1)^2 / m) = |s^2 - 1| on either side; a matrix with
// singular values s_i (orthogonal rows of those lengths) gives
// sqrt(sum (s_i^2 - 1)^2 / m); bad shapes are refused.
TEST(OrthogonalityErrorTest, KnownSingularValues) {
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{3, 7}, {7, 3}, {5, 5}}) {
    const int64_t m = std::min(rows, cols);
    for (double s : {1.0, 0.5, 1.25}) {
      std::vector<float> x(static_cast<size_t>(rows * cols), 0.0f);
      for (int64_t i = 0; i < m; ++i) {
        const int64_t r = rows <= cols ? i : (i * 2) % rows;
        const int64_t c = rows <= cols ? (i * 3) % cols : i;
        x[r * cols + c] = static_cast<float>(i % 2 == 0 ? s : -s);
      }
      absl::StatusOr<double> err = OrthogonalityError(x.data(), rows, cols);
      ASSERT_TRUE(err.ok()) << err.status();
      EXPECT_NEAR(*err, std::abs(s * s - 1.0), 1e-6) << rows << "x" << cols << " s " << s;
    }
  }
  // Rows (1, 1, 0, 0) / sqrt 2 * 2 and (0, 0, 1, -1) / sqrt 2 * 0.5: lengths 2 and 0.5.
  const float a = static_cast<float>(2.0 / std::sqrt(2.0));
  const float b = static_cast<float>(0.5 / std::sqrt(2.0));
  const std::vector<float> x = {a, a, 0, 0, 0, 0, b, -b};
  const double want = std::sqrt((9.0 + 0.5625) / 2.0);  // (4 - 1)^2 + (0.25 - 1)^2
  absl::StatusOr<double> err = OrthogonalityError(x.data(), 2, 4);
  ASSERT_TRUE(err.ok());
  EXPECT_NEAR(*err, want, 1e-6);
  EXPECT_FALSE(OrthogonalityError(x.data(), 0, 4).ok());
  EXPECT_FALSE(OrthogonalityError(nullptr, 2, 4).ok());
}

}  // namespace
}  // namespace muonmesh::math
