// The moe_mlp reference (moe_reference_trainer.h) is itself tested: its
// hand-written gradient against central differences of its own loss, and
// its loss and gradient against the MoeMlp workload's (two independent
// implementations of one definition).

#include "tests/worker/model/moe_reference_trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "gtest/gtest.h"
#include "tests/worker/model/central_difference.h"
#include "worker/model/moe_mlp.h"

namespace muonmesh::reference {
namespace {

constexpr RefMoeDims kDims{3, 5, 4, 3, 2};
constexpr int64_t kN = 12;

// Smooth, deterministic data and weights (no worker/ code involved); the
// router is scaled up so that the samples spread over the experts.
std::vector<double> Data(int64_t n, double phase) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = std::sin(0.61 * static_cast<double>(i) + phase);
  return v;
}

Tensors Params() {
  const int64_t sizes[7] = {kDims.d * kDims.d_in, kDims.d, kDims.experts * kDims.d,
                            kDims.experts * kDims.d_e * kDims.d,
                            kDims.experts * kDims.d * kDims.d_e, kDims.d_out * kDims.d,
                            kDims.d_out};
  Tensors p(7);
  for (int i = 0; i < 7; ++i) {
    p[i].resize(static_cast<size_t>(sizes[i]));
    for (int64_t k = 0; k < sizes[i]; ++k) {
      p[i][k] = (i == 2 ? 2.0 : 0.5) * std::sin(1.3 * static_cast<double>(k) + 0.7 * i + 0.2);
    }
  }
  return p;
}

TEST(MoeReferenceTrainerTest, GradientMatchesCentralDifferences) {
  const std::vector<double> x = Data(kN * kDims.d_in, 0.1);
  const std::vector<double> y = Data(kN * kDims.d_out, 1.9);
  const std::vector<int64_t> batch = {0, 3, 5, 7, 7, 11, 2, 9};
  Tensors p = Params();
  Tensors grads;
  double gap = 1e300;
  const double loss = MoeLossAndGrad(kDims, p, x, y, batch, &grads, &gap);
  EXPECT_GT(loss, 1e-2);
  // Steps of 1e-6 (the central difference's) cannot change a routing
  // decision this far from a tie.
  ASSERT_GT(gap, 1e-3);
  const std::vector<double> largest = ExpectGradientsMatchCentralDifferences(
      [&](const Tensors& q) { return MoeLossAndGrad(kDims, q, x, y, batch, nullptr); }, p, grads);
  // Every parameter has a gradient to check (the batch uses every expert).
  for (size_t i = 0; i < largest.size(); ++i) EXPECT_GT(largest[i], 1e-4) << "param " << i;
}

TEST(MoeReferenceTrainerTest, AgreesWithTheWorkload) {
  const std::vector<double> xd = Data(kN * kDims.d_in, 0.1);
  const std::vector<double> yd = Data(kN * kDims.d_out, 1.9);
  absl::StatusOr<worker::MoeMlp> moe = worker::MoeMlp::Create(
      {kDims.d_in, kDims.d, kDims.d_e, kDims.experts, kDims.d_out},
      std::vector<float>(xd.begin(), xd.end()), std::vector<float>(yd.begin(), yd.end()));
  ASSERT_TRUE(moe.ok()) << moe.status();
  const Tensors pd = Params();
  std::vector<std::vector<float>> pf, gf;
  std::vector<const float*> pp;
  std::vector<float*> gp;
  for (const auto& t : pd) {
    pf.emplace_back(t.begin(), t.end());
    gf.emplace_back(t.size(), 0.0f);
  }
  for (auto& t : pf) pp.push_back(t.data());
  for (auto& t : gf) gp.push_back(t.data());
  const std::vector<int64_t> batch = {0, 3, 5, 7, 7, 11, 2, 9};
  // The reference on the fp32-rounded inputs the workload sees.
  Tensors rounded;
  for (const auto& t : pf) rounded.emplace_back(t.begin(), t.end());
  const std::vector<double> xr(moe->x().begin(), moe->x().end());
  const std::vector<double> yr(moe->y().begin(), moe->y().end());
  Tensors grads;
  double gap = 1e300;
  const double want = MoeLossAndGrad(kDims, rounded, xr, yr, batch, &grads, &gap);
  ASSERT_GT(gap, 1e-3);
  absl::StatusOr<double> got = moe->ForwardBackward(0, pp, batch, gp);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_NEAR(*got, want, 1e-5 * want);
  for (size_t i = 0; i < grads.size(); ++i) {
    double scale = 0;
    for (double v : grads[i]) scale = std::max(scale, std::abs(v));
    ASSERT_GT(scale, 1e-4) << "param " << i;
    for (size_t k = 0; k < grads[i].size(); ++k) {
      EXPECT_NEAR(gf[i][k], grads[i][k], 1e-5 * scale) << "param " << i << " [" << k << "]";
    }
  }
}

TEST(MoeReferenceTrainerTest, TrainingLowersTheLossAndReportsTheRoutingGap) {
  const std::vector<double> x = Data(kN * kDims.d_in, 0.1);
  const std::vector<double> y = Data(kN * kDims.d_out, 1.9);
  RefMuonOptions muon;
  muon.lr = 0.02;
  RefAdamWOptions adamw;
  adamw.lr = 1e-2;
  double gap = 0;
  const RefTrainResult r = ReferenceTrainMoe(kDims, Params(), x, y, kN, 30, kN, muon, adamw, &gap);
  ASSERT_EQ(r.losses.size(), 30u);
  EXPECT_LT(r.losses.back(), 0.8 * r.losses.front());
  EXPECT_GT(gap, 0.0);
  EXPECT_LT(gap, 1e300);
  EXPECT_THROW(ReferenceTrainMoe(kDims, Tensors(6), x, y, kN, 1, 4, muon, adamw),
               std::invalid_argument);
}

}  // namespace
}  // namespace muonmesh::reference
