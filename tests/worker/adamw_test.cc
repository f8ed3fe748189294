#include "worker/math/adamw.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "tests/worker/ns_reference.h"

namespace muonmesh::math {
namespace {

using testing::Gaussian;

optim::AdamWOptions Options() {
  optim::AdamWOptions o;
  o.lr = 0.1;
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.eps = 1e-8;
  o.weight_decay = 0.01;
  return o;
}

// Step 1 from zero state, p = 1, g = 0.5:
//   p = 1 (1 - 0.1 * 0.01) = 0.999; m = 0.05; v = 0.001 * 0.25 = 2.5e-4;
//   m / (1 - 0.9) = 0.5; sqrt(v / (1 - 0.999)) = 0.5;
//   p = 0.999 - 0.1 * 0.5 / (0.5 + 1e-8) = 0.899 (+2e-9).
// Step 2, g = -0.25:
//   p = 0.899 * 0.999 = 0.898101; m = 0.9 * 0.05 + 0.1 * -0.25 = 0.02;
//   v = 0.999 * 2.5e-4 + 0.001 * 0.0625 = 3.12250e-4;
//   m_hat = 0.02 / 0.19 = 0.105263; v_hat = 3.1225e-4 / 0.001999 = 0.156203;
//   p = 0.898101 - 0.1 * 0.105263 / (0.395225 + 1e-8) = 0.871467.
TEST(AdamWTest, HandComputedTwoSteps) {
  std::vector<float> p = {1.0f}, m = {0.0f}, v = {0.0f};
  ASSERT_TRUE(AdamWStep(Options(), 1, std::vector<float>{0.5f}, absl::MakeSpan(m),
                        absl::MakeSpan(v), absl::MakeSpan(p)).ok());
  EXPECT_NEAR(p[0], 0.899, 1e-6);
  EXPECT_NEAR(m[0], 0.05, 1e-8);
  EXPECT_NEAR(v[0], 2.5e-4, 1e-10);
  ASSERT_TRUE(AdamWStep(Options(), 2, std::vector<float>{-0.25f}, absl::MakeSpan(m),
                        absl::MakeSpan(v), absl::MakeSpan(p)).ok());
  EXPECT_NEAR(m[0], 0.02, 1e-8);
  EXPECT_NEAR(v[0], 3.1225e-4, 1e-10);
  EXPECT_NEAR(p[0], 0.871467, 2e-6);
}

// eps is added after the square root: with g = 1e-6 at step 1 the update is
// lr * 1e-6 / (1e-6 + 1e-8) = 0.0990 lr; inside the root it would be
// lr * 1e-6 / sqrt(1e-12 + 1e-8) = 0.0100 lr.
TEST(AdamWTest, EpsOutsideSquareRoot) {
  optim::AdamWOptions o = Options();
  o.weight_decay = 0.0;
  std::vector<float> p = {0.0f}, m = {0.0f}, v = {0.0f};
  ASSERT_TRUE(AdamWStep(o, 1, std::vector<float>{1e-6f}, absl::MakeSpan(m), absl::MakeSpan(v),
                        absl::MakeSpan(p)).ok());
  EXPECT_NEAR(p[0], -0.1 * 1e-6 / (1e-6 + 1e-8), 1e-7);
}

// Twenty steps on a vector against an fp64 restatement of torch.optim.AdamW.
TEST(AdamWTest, MatchesFp64ReferenceOverSteps) {
  const size_t n = 257;
  const optim::AdamWOptions o = Options();
  std::vector<float> p = Gaussian(n, 1), m(n, 0.0f), v(n, 0.0f);
  std::vector<double> rp(p.begin(), p.end()), rm(n, 0.0), rv(n, 0.0);
  for (int t = 1; t <= 20; ++t) {
    const std::vector<float> g = Gaussian(n, 100 + t);
    ASSERT_TRUE(AdamWStep(o, t, g, absl::MakeSpan(m), absl::MakeSpan(v), absl::MakeSpan(p)).ok());
    for (size_t i = 0; i < n; ++i) {
      rp[i] *= 1.0 - o.lr * o.weight_decay;
      rm[i] = o.beta1 * rm[i] + (1.0 - o.beta1) * g[i];
      rv[i] = o.beta2 * rv[i] + (1.0 - o.beta2) * g[i] * g[i];
      const double mhat = rm[i] / (1.0 - std::pow(o.beta1, t));
      const double vhat = rv[i] / (1.0 - std::pow(o.beta2, t));
      rp[i] -= o.lr * mhat / (std::sqrt(vhat) + o.eps);
    }
  }
  for (size_t i = 0; i < n; ++i) EXPECT_NEAR(p[i], rp[i], 1e-5 * std::max(1.0, std::fabs(rp[i])));
}

TEST(AdamWTest, NonFiniteRefusesStepAndWritesNothing) {
  const size_t n = 16;
  const std::vector<float> p0 = Gaussian(n, 1), m0 = Gaussian(n, 2, 0.1);
  std::vector<float> v0(n, 0.01f);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    std::vector<float> g = Gaussian(n, 3);
    g[n - 1] = bad;
    std::vector<float> p = p0, m = m0, v = v0;
    EXPECT_EQ(AdamWStep(Options(), 3, g, absl::MakeSpan(m), absl::MakeSpan(v), absl::MakeSpan(p))
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(0, std::memcmp(p.data(), p0.data(), n * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(m.data(), m0.data(), n * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(v.data(), v0.data(), n * sizeof(float)));
  }
  // Finite inputs, overflowing second moment: refused, nothing written.
  std::vector<float> g(n, 1.0f), p = p0, m = m0, v = v0;
  g[2] = 3e38f;
  EXPECT_EQ(AdamWStep(Options(), 1, g, absl::MakeSpan(m), absl::MakeSpan(v), absl::MakeSpan(p))
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p, p0);
  EXPECT_EQ(v, v0);
}

TEST(AdamWTest, InvalidArguments) {
  std::vector<float> g(3, 1.0f), p(3, 1.0f), m(3, 0.0f), v(3, 0.0f), short_v(2, 0.0f);
  EXPECT_EQ(AdamWStep(Options(), 0, g, absl::MakeSpan(m), absl::MakeSpan(v), absl::MakeSpan(p))
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AdamWStep(Options(), 1, g, absl::MakeSpan(m), absl::MakeSpan(short_v),
                      absl::MakeSpan(p)).code(),
            absl::StatusCode::kInvalidArgument);
  optim::AdamWOptions o = Options();
  o.beta2 = 1.0;
  EXPECT_EQ(AdamWStep(o, 1, g, absl::MakeSpan(m), absl::MakeSpan(v), absl::MakeSpan(p)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p, std::vector<float>(3, 1.0f));
  // An empty shard is fine.
  std::vector<float> none;
  EXPECT_TRUE(AdamWStep(Options(), 1, none, absl::MakeSpan(none), absl::MakeSpan(none),
                        absl::MakeSpan(none)).ok());
}

}  // namespace
}  // namespace muonmesh::math
