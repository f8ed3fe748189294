// The reference trainer (reference_trainer.h) is itself tested: its
// gradient against finite differences, its optimizer steps and a short run
// against the production pieces (worker/model, worker/math) as two
// independent implementations, and its loss going down on a teacher problem.

#include "tests/worker/model/reference_trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "gtest/gtest.h"
#include "tests/worker/model/central_difference.h"
#include "worker/math/adamw.h"
#include "worker/math/muon.h"
#include "core/optim/types.h"
#include "worker/model/mlp.h"
#include "worker/model/rng.h"

namespace muonmesh::reference {
namespace {

using worker::Mlp;

Tensors ToDouble(const std::vector<std::vector<float>>& t) {
  Tensors out;
  for (const auto& v : t) out.emplace_back(v.begin(), v.end());
  return out;
}

std::vector<double> ToDouble(const std::vector<float>& v) { return {v.begin(), v.end()}; }

std::vector<double> RandomVector(size_t n, uint64_t seed) {
  std::vector<double> v(n);
  for (size_t k = 0; k < n; ++k) v[k] = worker::UniformAt(seed, 0, k);
  return v;
}

TEST(ReferenceTrainerTest, GradientMatchesFiniteDifferences) {
  const std::vector<int64_t> dims = {3, 5, 4, 2};
  absl::StatusOr<Mlp> mlp = Mlp::FromTeacher(dims, 3, 6);
  ASSERT_TRUE(mlp.ok());
  absl::StatusOr<std::vector<std::vector<float>>> init = worker::MlpInitialParams(dims, 40);
  ASSERT_TRUE(init.ok());
  Tensors p = ToDouble(*init);
  const std::vector<double> x = ToDouble(mlp->x());
  const std::vector<double> y = ToDouble(mlp->y());
  const std::vector<int64_t> batch = {5, 0, 2, 2};
  Tensors grads;
  const double loss = MlpLossAndGrad(dims, p, x, y, batch, &grads);
  EXPECT_GT(loss, 1e-3);
  ExpectGradientsMatchCentralDifferences(
      [&](const Tensors& q) { return MlpLossAndGrad(dims, q, x, y, batch, nullptr); }, p, grads);
}

TEST(ReferenceTrainerTest, GradientAgreesWithTheWorkload) {
  const std::vector<int64_t> dims = {6, 12, 7, 3};
  absl::StatusOr<Mlp> mlp = Mlp::FromTeacher(dims, 5, 32);
  ASSERT_TRUE(mlp.ok());
  absl::StatusOr<std::vector<std::vector<float>>> params = worker::MlpInitialParams(dims, 9);
  ASSERT_TRUE(params.ok());
  std::vector<std::vector<float>> grads = *params;
  std::vector<const float*> pp;
  std::vector<float*> gp;
  for (auto& v : *params) pp.push_back(v.data());
  for (auto& v : grads) gp.push_back(v.data());
  const std::vector<int64_t> batch = {31, 0, 7, 8, 9, 1, 30, 12};
  absl::StatusOr<double> loss = mlp->ForwardBackward(0, pp, batch, gp);
  ASSERT_TRUE(loss.ok());
  Tensors ref_grads;
  const double ref_loss = MlpLossAndGrad(dims, ToDouble(*params), ToDouble(mlp->x()),
                                         ToDouble(mlp->y()), batch, &ref_grads);
  EXPECT_NEAR(*loss, ref_loss, 1e-6 * ref_loss);
  for (size_t i = 0; i < grads.size(); ++i) {
    for (size_t k = 0; k < grads[i].size(); ++k) {
      EXPECT_NEAR(grads[i][k], ref_grads[i][k], 1e-7 + 1e-5 * std::abs(ref_grads[i][k]));
    }
  }
}

TEST(ReferenceTrainerTest, NewtonSchulzOnEqualSingularValues) {
  // u = 5 [I_m | 0] (and its transpose): normalised, every singular value is
  // 1/sqrt(m), and each iteration maps a singular value s to
  // a s + b s^3 + c s^5, so the result is f^5(1/sqrt(m)) [I_m | 0] exactly.
  constexpr int64_t kM = 4, kN = 9;
  double s = 1.0 / std::sqrt(static_cast<double>(kM));
  for (int k = 0; k < 5; ++k) s = 3.4445 * s - 4.7750 * s * s * s + 2.0315 * s * s * s * s * s;
  EXPECT_GT(s, 0.6);
  EXPECT_LT(s, 1.3);
  for (bool transpose : {false, true}) {
    const int64_t rows = transpose ? kN : kM;
    const int64_t cols = transpose ? kM : kN;
    std::vector<double> u(static_cast<size_t>(rows * cols), 0.0);
    for (int64_t i = 0; i < kM; ++i) u[i * cols + i] = 5.0;
    const std::vector<double> o = NewtonSchulz(u, rows, cols, RefMuonOptions{});
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        EXPECT_NEAR(o[r * cols + c], r == c ? s : 0.0, 1e-12) << r << " " << c;
      }
    }
  }
}

TEST(ReferenceTrainerTest, OptimizerStepsAgreeWithWorkerMath) {
  // Muon: a 6 x 10 and a 10 x 6 matrix, three steps, weight decay on.
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{6, 10}, {10, 6}}) {
    const size_t n = static_cast<size_t>(rows * cols);
    RefMuonOptions ref;
    ref.lr = 0.05;
    ref.weight_decay = 0.1;
    optim::MuonOptions opt;
    opt.lr = ref.lr;
    opt.momentum = ref.momentum;
    opt.nesterov = ref.nesterov;
    opt.weight_decay = ref.weight_decay;
    std::vector<double> p = RandomVector(n, 1), m(n, 0.0);
    std::vector<float> pf(p.begin(), p.end()), mf(n, 0.0f);
    math::Muon muon;
    for (int step = 0; step < 3; ++step) {
      const std::vector<double> g = RandomVector(n, 10 + step);
      const std::vector<float> gf(g.begin(), g.end());
      MuonStep(ref, rows, cols, g, &m, &p);
      ASSERT_TRUE(muon.Step(opt, rows, cols, gf, absl::MakeSpan(mf), absl::MakeSpan(pf)).ok());
    }
    for (size_t k = 0; k < n; ++k) {
      EXPECT_NEAR(pf[k], p[k], 2e-5) << k;
      EXPECT_NEAR(mf[k], m[k], 1e-6) << k;
    }
  }
  // AdamW: three steps.
  const size_t n = 17;
  RefAdamWOptions ref;
  ref.lr = 0.01;
  ref.weight_decay = 0.1;
  optim::AdamWOptions opt;
  opt.lr = ref.lr;
  opt.beta1 = ref.beta1;
  opt.beta2 = ref.beta2;
  opt.eps = ref.eps;
  opt.weight_decay = ref.weight_decay;
  std::vector<double> p = RandomVector(n, 2), m(n, 0.0), v(n, 0.0);
  std::vector<float> pf(p.begin(), p.end()), mf(n, 0.0f), vf(n, 0.0f);
  for (int step = 1; step <= 3; ++step) {
    const std::vector<double> g = RandomVector(n, 20 + step);
    const std::vector<float> gf(g.begin(), g.end());
    AdamWStep(ref, step, g, &m, &v, &p);
    ASSERT_TRUE(
        math::AdamWStep(opt, step, gf, absl::MakeSpan(mf), absl::MakeSpan(vf), absl::MakeSpan(pf))
            .ok());
  }
  for (size_t k = 0; k < n; ++k) EXPECT_NEAR(pf[k], p[k], 1e-6) << k;
}

TEST(ReferenceTrainerTest, LossDecreasesOnATeacherProblem) {
  const std::vector<int64_t> dims = {8, 32, 32, 4};
  absl::StatusOr<Mlp> mlp = Mlp::FromTeacher(dims, 11, 256);
  ASSERT_TRUE(mlp.ok());
  absl::StatusOr<std::vector<std::vector<float>>> init = worker::MlpInitialParams(dims, 7);
  ASSERT_TRUE(init.ok());
  RefMuonOptions muon;
  muon.lr = 0.02;
  RefAdamWOptions adamw;
  adamw.lr = 1e-3;
  const RefTrainResult r = ReferenceTrain(dims, ToDouble(*init), ToDouble(mlp->x()),
                                          ToDouble(mlp->y()), 256, 100, 32, muon, adamw);
  ASSERT_EQ(r.losses.size(), 100u);
  double last = 0;
  for (size_t s = 90; s < 100; ++s) last += r.losses[s] / 10;
  EXPECT_LT(last, 0.3 * r.losses[0]) << "first " << r.losses[0] << " last " << last;
  std::printf("reference training: loss %.4g at step 0, %.4g over steps 90-99\n", r.losses[0],
              last);
  // The final weights' loss on the whole dataset is lower than the initial.
  std::vector<int64_t> all(256);
  for (int64_t i = 0; i < 256; ++i) all[i] = i;
  const double before =
      MlpLossAndGrad(dims, ToDouble(*init), ToDouble(mlp->x()), ToDouble(mlp->y()), all, nullptr);
  const double after =
      MlpLossAndGrad(dims, r.params, ToDouble(mlp->x()), ToDouble(mlp->y()), all, nullptr);
  EXPECT_LT(after, 0.3 * before);
}

TEST(ReferenceTrainerTest, ShortRunAgreesWithTheProductionPieces) {
  // The same 5 steps with the fp32 workload and worker/math: what the
  // runtime's single-rank run does, without the runtime. Batches wrap
  // (N = 40, B = 16) so repeats and the mod are exercised.
  const std::vector<int64_t> dims = {5, 12, 3};
  constexpr int64_t kN = 40, kB = 16, kSteps = 5;
  absl::StatusOr<Mlp> mlp = Mlp::FromTeacher(dims, 2, kN);  // teacher seed 3
  ASSERT_TRUE(mlp.ok());
  absl::StatusOr<std::vector<std::vector<float>>> init = worker::MlpInitialParams(dims, 13);
  ASSERT_TRUE(init.ok());
  RefMuonOptions ref_muon;
  ref_muon.lr = 0.02;
  ref_muon.weight_decay = 0.01;
  RefAdamWOptions ref_adamw;
  ref_adamw.lr = 3e-3;
  ref_adamw.weight_decay = 0.01;
  const RefTrainResult ref =
      ReferenceTrain(dims, ToDouble(*init), ToDouble(mlp->x()), ToDouble(mlp->y()), kN, kSteps, kB,
                     ref_muon, ref_adamw);

  optim::MuonOptions muon_opt;
  muon_opt.lr = ref_muon.lr;
  muon_opt.momentum = ref_muon.momentum;
  muon_opt.weight_decay = ref_muon.weight_decay;
  optim::AdamWOptions adamw_opt;
  adamw_opt.lr = ref_adamw.lr;
  adamw_opt.weight_decay = ref_adamw.weight_decay;
  std::vector<std::vector<float>> p = *init, g = *init, m1 = *init, m2 = *init;
  for (auto* t : {&m1, &m2}) {
    for (auto& v : *t) std::fill(v.begin(), v.end(), 0.0f);
  }
  std::vector<const float*> pp;
  std::vector<float*> gp;
  for (auto& v : p) pp.push_back(v.data());
  for (auto& v : g) gp.push_back(v.data());
  math::Muon muon;
  for (int64_t s = 0; s < kSteps; ++s) {
    std::vector<int64_t> batch(kB);
    for (int64_t j = 0; j < kB; ++j) batch[j] = (s * kB + j) % kN;
    absl::StatusOr<double> loss = mlp->ForwardBackward(s, pp, batch, gp);
    ASSERT_TRUE(loss.ok());
    EXPECT_NEAR(*loss, ref.losses[s], 1e-5 * ref.losses[s]) << "step " << s;
    for (size_t i = 0; i < p.size(); ++i) {
      if (i % 2 == 0) {
        ASSERT_TRUE(muon.Step(muon_opt, dims[i / 2 + 1], dims[i / 2], g[i], absl::MakeSpan(m1[i]),
                              absl::MakeSpan(p[i]))
                        .ok());
      } else {
        ASSERT_TRUE(math::AdamWStep(adamw_opt, s + 1, g[i], absl::MakeSpan(m1[i]),
                                    absl::MakeSpan(m2[i]), absl::MakeSpan(p[i]))
                        .ok());
      }
    }
  }
  double max_diff = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    for (size_t k = 0; k < p[i].size(); ++k) {
      EXPECT_NEAR(p[i][k], ref.params[i][k], 1e-4) << "param " << i << " element " << k;
      max_diff = std::max(max_diff, std::abs(p[i][k] - ref.params[i][k]));
    }
  }
  std::printf("fp32 pieces vs reference after %d steps: max |weight difference| %.3g\n",
              static_cast<int>(kSteps), max_diff);
}

TEST(ReferenceTrainerTest, RejectsWrongSizes) {
  const std::vector<int64_t> dims = {2, 3};
  Tensors init = {std::vector<double>(6), std::vector<double>(3)};
  const std::vector<double> x(4), y(6);
  EXPECT_NO_THROW(ReferenceTrain(dims, init, x, y, 2, 1, 2, {}, {}));
  EXPECT_THROW(ReferenceTrain(dims, init, x, y, 3, 1, 2, {}, {}), std::invalid_argument);
  init[1].pop_back();
  EXPECT_THROW(ReferenceTrain(dims, init, x, y, 2, 1, 2, {}, {}), std::invalid_argument);
}

}  // namespace
}  // namespace muonmesh::reference
