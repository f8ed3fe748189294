#include "worker/math/muon.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "tests/worker/ns_reference.h"

namespace muonmesh::math {
namespace {

using testing::Gaussian;
using testing::kQuintic;
using testing::ScalarIteration;

// s_T: where T quintic steps take a singular value s.
double Iterate(double s, int steps) {
  for (int t = 0; t < steps; ++t) s = ScalarIteration(s, kQuintic);
  return s;
}

optim::MuonOptions Options() {
  optim::MuonOptions o;
  o.lr = 0.1;
  o.momentum = 0.9;
  o.nesterov = true;
  o.weight_decay = 0.01;
  return o;
}

// 1 x 1: m' = 0.2 + 0.1 (0.5 - 0.2) = 0.23; u = 0.5 + 0.9 (0.23 - 0.5) =
// 0.257; NS(u) = s_5(1) (u / |u| = 1); scale sqrt(max(1, 1)) = 1;
// p = 1 (1 - 0.1 * 0.01) - 0.1 * s_5(1).
TEST(MuonTest, HandComputedScalar) {
  std::vector<float> p = {1.0f}, m = {0.2f};
  const std::vector<float> g = {0.5f};
  Muon muon;
  ASSERT_TRUE(muon.Step(Options(), 1, 1, g, absl::MakeSpan(m), absl::MakeSpan(p)).ok());
  EXPECT_NEAR(m[0], 0.23, 1e-7);
  EXPECT_NEAR(p[0], 0.999 - 0.1 * Iterate(1.0, 5), 1e-6);

  // Without Nesterov the input is m' itself: same sign, same NS result.
  optim::MuonOptions plain = Options();
  plain.nesterov = false;
  std::vector<float> u(1);
  ASSERT_TRUE(MuonPrepare(plain, g, std::vector<float>{0.2f}, absl::MakeSpan(u)).ok());
  EXPECT_NEAR(u[0], 0.23, 1e-7);
  ASSERT_TRUE(MuonPrepare(Options(), g, std::vector<float>{0.2f}, absl::MakeSpan(u)).ok());
  EXPECT_NEAR(u[0], 0.257, 1e-7);
}

// 2 x 2 diagonal, momentum 0, no Nesterov: u = m' = 0.1 g = diag(0.3, 0.4),
// ||u||_F = 0.5, so NS sees diag(0.6, 0.8), and each diagonal entry follows
// the scalar map on its own. match_rms_adamw scale: 0.2 sqrt(2).
TEST(MuonTest, HandComputedDiagonal) {
  optim::MuonOptions o = Options();
  o.nesterov = false;
  o.weight_decay = 0.0;
  o.scale = optim::MuonScale::kMatchRmsAdamW;
  std::vector<float> p = {1.0f, 2.0f, 3.0f, 4.0f}, m(4, 0.0f);
  const std::vector<float> g = {3.0f, 0.0f, 0.0f, 4.0f};
  Muon muon;
  ASSERT_TRUE(muon.Step(o, 2, 2, g, absl::MakeSpan(m), absl::MakeSpan(p)).ok());
  const double step = 0.1 * 0.2 * std::sqrt(2.0);
  EXPECT_NEAR(p[0], 1.0 - step * Iterate(0.6, 5), 2e-6);
  EXPECT_NEAR(p[1], 2.0, 1e-6);
  EXPECT_NEAR(p[2], 3.0, 1e-6);
  EXPECT_NEAR(p[3], 4.0 - step * Iterate(0.8, 5), 2e-6);
  EXPECT_NEAR(m[0], 0.3, 1e-7);
  EXPECT_NEAR(m[3], 0.4, 1e-7);
}

// 4 x 1: a column has one singular value; original scale sqrt(4 / 1) = 2.
TEST(MuonTest, HandComputedTallColumnScale) {
  optim::MuonOptions o = Options();
  o.momentum = 0.0;  // u = g
  o.weight_decay = 0.0;
  std::vector<float> p(4, 0.0f), m(4, 0.0f);
  const std::vector<float> g = {1.0f, -2.0f, 2.0f, 4.0f};  // norm 5
  Muon muon;
  ASSERT_TRUE(muon.Step(o, 4, 1, g, absl::MakeSpan(m), absl::MakeSpan(p)).ok());
  const double s5 = Iterate(1.0, 5);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(p[i], -0.1 * 2.0 * s5 * g[i] / 5.0, 1e-6) << i;
}

TEST(MuonTest, UpdateScale) {
  EXPECT_DOUBLE_EQ(optim::MuonUpdateScale(optim::MuonScale::kOriginal, 1024, 256), 2.0);
  EXPECT_DOUBLE_EQ(optim::MuonUpdateScale(optim::MuonScale::kOriginal, 256, 1024), 1.0);
  EXPECT_DOUBLE_EQ(optim::MuonUpdateScale(optim::MuonScale::kMatchRmsAdamW, 256, 1024), 0.2 * 32.0);
  EXPECT_DOUBLE_EQ(optim::MuonUpdateScale(optim::MuonScale::kMatchRmsAdamW, 1024, 256), 0.2 * 32.0);
}

// The sharded runtime's path (prepare on row shards, NS on the gathered
// matrix, apply on row shards) equals the whole-matrix step bit for bit.
TEST(MuonTest, ShardedPhasesEqualWholeMatrixStep) {
  const int64_t rows = 10, cols = 6;
  const std::vector<float> g = Gaussian(rows * cols, 1);
  const std::vector<float> m0 = Gaussian(rows * cols, 2, 0.1);
  const std::vector<float> p0 = Gaussian(rows * cols, 3);
  const optim::MuonOptions o = Options();

  std::vector<float> p_whole = p0, m_whole = m0;
  Muon muon;
  ASSERT_TRUE(muon.Step(o, rows, cols, g, absl::MakeSpan(m_whole), absl::MakeSpan(p_whole)).ok());

  std::vector<float> p = p0, m = m0, u(rows * cols);
  const int64_t cut = 4 * cols;  // shard 0: rows 0..3, shard 1: rows 4..9
  auto sub = [&](auto& v, int64_t b, int64_t e) { return absl::MakeSpan(v.data() + b, e - b); };
  auto csub = [&](const auto& v, int64_t b, int64_t e) {
    return absl::MakeConstSpan(v.data() + b, e - b);
  };
  const int64_t n = rows * cols;
  ASSERT_TRUE(MuonPrepare(o, csub(g, 0, cut), csub(m, 0, cut), sub(u, 0, cut)).ok());
  ASSERT_TRUE(MuonPrepare(o, csub(g, cut, n), csub(m, cut, n), sub(u, cut, n)).ok());
  NewtonSchulz ns;
  ASSERT_TRUE(ns.Run(u.data(), rows, cols, o.ns).ok());
  ASSERT_TRUE(MuonApply(o, rows, cols, csub(g, 0, cut), csub(u, 0, cut), sub(m, 0, cut),
                        sub(p, 0, cut)).ok());
  ASSERT_TRUE(MuonApply(o, rows, cols, csub(g, cut, n), csub(u, cut, n), sub(m, cut, n),
                        sub(p, cut, n)).ok());
  EXPECT_EQ(p, p_whole);
  EXPECT_EQ(m, m_whole);
}

// Three steps against an fp64 restatement of torch.optim.Muon.
TEST(MuonTest, MatchesFp64ReferenceOverSteps) {
  const int64_t rows = 12, cols = 20;
  optim::MuonOptions o = Options();
  std::vector<float> p = Gaussian(rows * cols, 4), m(rows * cols, 0.0f);
  std::vector<double> rp(p.begin(), p.end()), rm(rows * cols, 0.0);
  Muon muon;
  for (int step = 0; step < 3; ++step) {
    const std::vector<float> g = Gaussian(rows * cols, 50 + step);
    ASSERT_TRUE(muon.Step(o, rows, cols, g, absl::MakeSpan(m), absl::MakeSpan(p)).ok());
    testing::Mat u(rows, cols);
    for (size_t i = 0; i < rm.size(); ++i) {
      rm[i] = rm[i] + (1.0 - o.momentum) * (g[i] - rm[i]);
      u.v[i] = g[i] + o.momentum * (rm[i] - g[i]);
    }
    const testing::Mat ortho = testing::ReferenceNewtonSchulz(u, 5, {kQuintic});
    for (size_t i = 0; i < rp.size(); ++i) {
      rp[i] = rp[i] * (1.0 - o.lr * o.weight_decay) - o.lr * 1.0 * ortho.v[i];
    }
  }
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < rp.size(); ++i) {
    num += (p[i] - rp[i]) * (p[i] - rp[i]);
    den += rp[i] * rp[i];
  }
  EXPECT_LE(std::sqrt(num / den), 1e-6);
}

TEST(MuonTest, BatchedEqualsPerMatrix) {
  const int64_t count = 3, rows = 8, cols = 5, size = rows * cols;
  const std::vector<float> g = Gaussian(count * size, 7);
  std::vector<float> p = Gaussian(count * size, 8), m = Gaussian(count * size, 9, 0.1);
  std::vector<float> p1 = p, m1 = m;
  Muon muon;
  ASSERT_TRUE(
      muon.StepBatched(Options(), count, rows, cols, g, absl::MakeSpan(m), absl::MakeSpan(p)).ok());
  for (int64_t e = 0; e < count; ++e) {
    Muon single;
    ASSERT_TRUE(single
                    .Step(Options(), rows, cols, absl::MakeConstSpan(g.data() + e * size, size),
                          absl::MakeSpan(m1.data() + e * size, size),
                          absl::MakeSpan(p1.data() + e * size, size))
                    .ok());
  }
  EXPECT_EQ(p, p1);
  EXPECT_EQ(m, m1);
}

TEST(MuonTest, NonFiniteRefusesStepAndWritesNothing) {
  const int64_t rows = 6, cols = 4, n = rows * cols;
  const std::vector<float> p0 = Gaussian(n, 1), m0 = Gaussian(n, 2, 0.1);
  Muon muon;
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> g = Gaussian(n, 3);
    g[5] = bad;
    std::vector<float> p = p0, m = m0;
    EXPECT_EQ(muon.Step(Options(), rows, cols, g, absl::MakeSpan(m), absl::MakeSpan(p)).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(0, std::memcmp(p.data(), p0.data(), n * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(m.data(), m0.data(), n * sizeof(float)));

    // A bad orthogonalised update arriving from the owner.
    std::vector<float> o = Gaussian(n, 4);
    o[n - 1] = bad;
    EXPECT_EQ(MuonApply(Options(), rows, cols, Gaussian(n, 3), o, absl::MakeSpan(m),
                        absl::MakeSpan(p)).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(0, std::memcmp(p.data(), p0.data(), n * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(m.data(), m0.data(), n * sizeof(float)));
  }
  // A finite update that would overflow a weight: refused as a whole.
  std::vector<float> p = p0, m = m0;
  p[0] = std::numeric_limits<float>::max();
  const std::vector<float> p_before = p;
  optim::MuonOptions huge = Options();
  huge.lr = 1e38;
  huge.weight_decay = 0.0;
  std::vector<float> o(n, -1.0f);
  EXPECT_EQ(MuonApply(huge, rows, cols, Gaussian(n, 3), o, absl::MakeSpan(m), absl::MakeSpan(p))
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p, p_before);
  EXPECT_EQ(0, std::memcmp(m.data(), m0.data(), n * sizeof(float)));
}

TEST(MuonTest, ZeroGradientAndEmptyShards) {
  // Zero gradient and momentum: NS(0) = 0, only weight decay acts.
  std::vector<float> p = {1.0f, -2.0f, 3.0f, 0.5f}, m(4, 0.0f);
  Muon muon;
  ASSERT_TRUE(muon.Step(Options(), 2, 2, std::vector<float>(4, 0.0f), absl::MakeSpan(m),
                        absl::MakeSpan(p)).ok());
  EXPECT_FLOAT_EQ(p[1], -2.0f * 0.999f);
  // A rank holding no rows of the matrix: both phases are no-ops.
  std::vector<float> none;
  EXPECT_TRUE(MuonPrepare(Options(), none, none, absl::MakeSpan(none)).ok());
  EXPECT_TRUE(MuonApply(Options(), 8, 4, none, none, absl::MakeSpan(none), absl::MakeSpan(none)).ok());
  EXPECT_TRUE(muon.Step(Options(), 0, 4, none, absl::MakeSpan(none), absl::MakeSpan(none)).ok());
}

TEST(MuonTest, InvalidOptionsAndSizes) {
  std::vector<float> g(4, 1.0f), m(4, 0.0f), p(4, 1.0f), u(3);
  optim::MuonOptions o = Options();
  o.momentum = 1.0;
  EXPECT_EQ(MuonPrepare(o, g, m, absl::MakeSpan(g.data(), 4)).code(),
            absl::StatusCode::kInvalidArgument);
  o = Options();
  o.lr = -1.0;
  EXPECT_EQ(MuonApply(o, 2, 2, g, g, absl::MakeSpan(m), absl::MakeSpan(p)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MuonPrepare(Options(), g, m, absl::MakeSpan(u)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MuonApply(Options(), 2, 3, g, g, absl::MakeSpan(m), absl::MakeSpan(p)).code(),
            absl::StatusCode::kInvalidArgument);  // 4 values are not whole rows of 3
  Muon muon;
  EXPECT_EQ(muon.Step(Options(), 3, 3, g, absl::MakeSpan(m), absl::MakeSpan(p)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p, std::vector<float>(4, 1.0f));
}

}  // namespace
}  // namespace muonmesh::math
