// The mlp workload against definitions written out in the test: a plain-loop
// double forward pass (for finite differences and the loss), the documented
// initialisation and teacher formulas evaluated element by element.

#include "worker/model/mlp.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/model/rng.h"

namespace muonmesh::worker {
namespace {

using ::testing::HasSubstr;

std::vector<float*> Ptrs(std::vector<std::vector<float>>& t) {
  std::vector<float*> p;
  for (auto& v : t) p.push_back(v.data());
  return p;
}

std::vector<const float*> ConstPtrs(const std::vector<std::vector<float>>& t) {
  std::vector<const float*> p;
  for (const auto& v : t) p.push_back(v.data());
  return p;
}

std::vector<std::vector<float>> ZerosLike(const plan::ModelSpec& spec) {
  std::vector<std::vector<float>> out;
  for (const auto& unit : spec.units) {
    for (const auto& p : unit.params) {
      int64_t n = 1;
      for (int64_t d : p.shape) n *= d;
      out.emplace_back(static_cast<size_t>(n), 0.0f);
    }
  }
  return out;
}

// The mlp loss of the definition, in double: h <- tanh(h W^T + b) between
// layers, mean of (y - t)^2 over the samples' elements.
double DoubleLoss(const std::vector<int64_t>& dims, const std::vector<std::vector<double>>& p,
                  const std::vector<float>& x, const std::vector<float>& y,
                  const std::vector<int64_t>& samples) {
  const size_t layers = dims.size() - 1;
  double total = 0;
  for (int64_t s : samples) {
    std::vector<double> h(x.begin() + s * dims[0], x.begin() + (s + 1) * dims[0]);
    for (size_t i = 0; i < layers; ++i) {
      std::vector<double> z(static_cast<size_t>(dims[i + 1]));
      for (int64_t o = 0; o < dims[i + 1]; ++o) {
        double acc = p[2 * i + 1][o];
        for (int64_t c = 0; c < dims[i]; ++c) acc += p[2 * i][o * dims[i] + c] * h[c];
        z[o] = i + 1 < layers ? std::tanh(acc) : acc;
      }
      h = z;
    }
    for (int64_t o = 0; o < dims.back(); ++o) {
      const double d = h[o] - y[s * dims.back() + o];
      total += d * d;
    }
  }
  return total / static_cast<double>(samples.size() * dims.back());
}

const std::vector<int64_t> kDims = {3, 5, 4, 2};

TEST(MlpTest, SpecNamesShapesAndOptimizers) {
  absl::StatusOr<plan::ModelSpec> spec = MlpSpec(kDims);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name, "mlp");
  ASSERT_EQ(spec->units.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const plan::UnitSpec& u = spec->units[i];
    EXPECT_EQ(u.name, "layers." + std::to_string(i));
    ASSERT_EQ(u.params.size(), 2u);
    EXPECT_EQ(u.params[0].name, u.name + ".weight");
    EXPECT_EQ(u.params[0].shape, (std::vector<int64_t>{kDims[i + 1], kDims[i]}));
    EXPECT_EQ(u.params[0].optimizer, "muon");
    EXPECT_EQ(u.params[1].name, u.name + ".bias");
    EXPECT_EQ(u.params[1].shape, (std::vector<int64_t>{kDims[i + 1]}));
    EXPECT_EQ(u.params[1].optimizer, "adamw");
    EXPECT_FALSE(u.params[0].expert);
  }
}

TEST(MlpTest, InitialisationFollowsTheDocumentedFormula) {
  absl::StatusOr<Mlp> mlp = Mlp::FromTeacher(kDims, 1, 4);
  ASSERT_TRUE(mlp.ok()) << mlp.status();
  std::vector<std::vector<float>> a = ZerosLike(mlp->spec());
  std::vector<std::vector<float>> b = ZerosLike(mlp->spec());
  ASSERT_TRUE(mlp->Initialize(7, Ptrs(a)).ok());
  ASSERT_TRUE(mlp->Initialize(7, Ptrs(b)).ok());
  EXPECT_EQ(a, b);  // reproducible

  // Layer 1 (in = 5): W_1[2, 3] = UniformAt(7, 2, 2 * 5 + 3) / sqrt(5);
  // Python gives 0.38653066130947217.
  EXPECT_EQ(a[2][2 * 5 + 3], static_cast<float>(0.38653066130947217));
  for (int i = 0; i < 3; ++i) {
    const int64_t in = kDims[i];
    for (int64_t k : {int64_t{0}, kDims[i + 1] * in - 1}) {
      EXPECT_EQ(a[2 * i][k],
                static_cast<float>(UniformAt(7, 2 * i, k) / std::sqrt(static_cast<double>(in))));
    }
    for (int64_t r = 0; r < kDims[i + 1]; ++r) {
      EXPECT_EQ(a[2 * i + 1][r], static_cast<float>(UniformAt(7, 2 * i + 1, r) /
                                                    std::sqrt(static_cast<double>(in))));
    }
  }
  absl::StatusOr<std::vector<std::vector<float>>> free_init = MlpInitialParams(kDims, 7);
  ASSERT_TRUE(free_init.ok());
  EXPECT_EQ(*free_init, a);

  ASSERT_TRUE(mlp->Initialize(8, Ptrs(b)).ok());
  EXPECT_NE(a, b);
}

TEST(MlpTest, TeacherDataFollowsTheDocumentedFormula) {
  constexpr uint64_t kSeed = 11;
  constexpr int64_t kN = 9;
  absl::StatusOr<Mlp> mlp = Mlp::FromTeacher(kDims, kSeed, kN);
  ASSERT_TRUE(mlp.ok()) << mlp.status();
  EXPECT_EQ(mlp->num_samples(), kN);
  ASSERT_EQ(mlp->x().size(), static_cast<size_t>(kN * 3));
  ASSERT_EQ(mlp->y().size(), static_cast<size_t>(kN * 2));
  for (int64_t n = 0; n < kN; ++n) {
    for (int64_t j = 0; j < 3; ++j) {
      EXPECT_EQ(mlp->x()[n * 3 + j], UniformAt(kSeed, 1'000'000, n * 3 + j));
    }
  }
  // y is the teacher (seed + 1) applied to x: bit for bit through MlpForward,
  // and to fp32 accuracy through the test's own double forward pass.
  absl::StatusOr<std::vector<std::vector<float>>> teacher = MlpInitialParams(kDims, kSeed + 1);
  ASSERT_TRUE(teacher.ok());
  absl::StatusOr<std::vector<float>> y = MlpForward(kDims, *teacher, mlp->x(), kN);
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(*y, mlp->y());
  std::vector<std::vector<double>> td;
  for (const auto& t : *teacher) td.emplace_back(t.begin(), t.end());
  for (int64_t n = 0; n < kN; ++n) {
    // Mean squared difference between the stored y and the double forward
    // pass of the teacher: fp32 rounding only (~1e-7 per element).
    EXPECT_LT(DoubleLoss(kDims, td, mlp->x(), mlp->y(), {n}), 1e-12);
  }
  EXPECT_GT(DoubleLoss(kDims, td, mlp->x(), std::vector<float>(kN * 2, 0.0f), {0}), 1e-4);
}

TEST(MlpTest, TeacherWeightsHaveExactlyZeroLossAndGradient) {
  constexpr uint64_t kSeed = 21;
  constexpr int64_t kN = 64;
  absl::StatusOr<Mlp> mlp = Mlp::FromTeacher({8, 16, 16, 4}, kSeed, kN);
  ASSERT_TRUE(mlp.ok()) << mlp.status();
  std::vector<std::vector<float>> params = ZerosLike(mlp->spec());
  std::vector<std::vector<float>> grads = ZerosLike(mlp->spec());
  ASSERT_TRUE(mlp->Initialize(kSeed + 1, Ptrs(params)).ok());
  std::vector<int64_t> all(kN);
  for (int64_t i = 0; i < kN; ++i) all[i] = i;
  absl::StatusOr<double> loss = mlp->ForwardBackward(0, ConstPtrs(params), all, Ptrs(grads));
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_EQ(*loss, 0.0);
  for (const auto& g : grads) {
    for (float v : g) EXPECT_EQ(v, 0.0f);
  }
  // A different student has a positive loss on the same data.
  ASSERT_TRUE(mlp->Initialize(kSeed + 2, Ptrs(params)).ok());
  loss = mlp->ForwardBackward(0, ConstPtrs(params), all, Ptrs(grads));
  ASSERT_TRUE(loss.ok());
  EXPECT_GT(*loss, 1e-3);
}

TEST(MlpTest, GradientsMatchCentralDifferencesInDouble) {
  absl::StatusOr<Mlp> mlp = Mlp::FromTeacher(kDims, 3, 7);
  ASSERT_TRUE(mlp.ok()) << mlp.status();
  std::vector<std::vector<float>> params = ZerosLike(mlp->spec());
  std::vector<std::vector<float>> grads = ZerosLike(mlp->spec());
  ASSERT_TRUE(mlp->Initialize(99, Ptrs(params)).ok());
  const std::vector<int64_t> samples = {0, 3, 5, 6, 1};
  absl::StatusOr<double> loss = mlp->ForwardBackward(0, ConstPtrs(params), samples, Ptrs(grads));
  ASSERT_TRUE(loss.ok()) << loss.status();

  std::vector<std::vector<double>> p;
  for (const auto& t : params) p.emplace_back(t.begin(), t.end());
  const double reference_loss = DoubleLoss(kDims, p, mlp->x(), mlp->y(), samples);
  EXPECT_GT(reference_loss, 1e-3);
  EXPECT_NEAR(*loss, reference_loss, 1e-6 * reference_loss);

  constexpr double kH = 1e-6;
  double max_grad = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    for (size_t k = 0; k < p[i].size(); ++k) {
      const double saved = p[i][k];
      p[i][k] = saved + kH;
      const double plus = DoubleLoss(kDims, p, mlp->x(), mlp->y(), samples);
      p[i][k] = saved - kH;
      const double minus = DoubleLoss(kDims, p, mlp->x(), mlp->y(), samples);
      p[i][k] = saved;
      const double fd = (plus - minus) / (2 * kH);
      max_grad = std::max(max_grad, std::abs(fd));
      // fp32 backward against a double central difference (truncation error
      // ~1e-12, cancellation ~1e-10): only fp32 rounding remains.
      EXPECT_NEAR(grads[i][k], fd, 1e-6 + 2e-5 * std::abs(fd)) << "param " << i << " element " << k;
    }
  }
  EXPECT_GT(max_grad, 1e-2);  // the check is not vacuous
}

TEST(MlpTest, UnionOfEqualSlicesIsTheAverage) {
  absl::StatusOr<Mlp> mlp = Mlp::FromTeacher({6, 10, 3}, 5, 20);
  ASSERT_TRUE(mlp.ok()) << mlp.status();
  std::vector<std::vector<float>> params = ZerosLike(mlp->spec());
  ASSERT_TRUE(mlp->Initialize(16, Ptrs(params)).ok());  // not the teacher (6)
  const std::vector<int64_t> a = {0, 2, 4, 6, 8, 19};
  const std::vector<int64_t> b = {1, 3, 5, 7, 9, 11};
  std::vector<int64_t> both = a;
  both.insert(both.end(), b.begin(), b.end());
  auto ga = ZerosLike(mlp->spec()), gb = ZerosLike(mlp->spec()), gab = ZerosLike(mlp->spec());
  absl::StatusOr<double> la = mlp->ForwardBackward(0, ConstPtrs(params), a, Ptrs(ga));
  absl::StatusOr<double> lb = mlp->ForwardBackward(0, ConstPtrs(params), b, Ptrs(gb));
  absl::StatusOr<double> lab = mlp->ForwardBackward(0, ConstPtrs(params), both, Ptrs(gab));
  ASSERT_TRUE(la.ok() && lb.ok() && lab.ok());
  EXPECT_NEAR(*lab, (*la + *lb) / 2, 1e-12 * *lab);
  double max_abs = 0;
  for (size_t i = 0; i < gab.size(); ++i) {
    for (size_t k = 0; k < gab[i].size(); ++k) {
      const double avg = (static_cast<double>(ga[i][k]) + gb[i][k]) / 2;
      max_abs = std::max(max_abs, std::abs(avg));
      EXPECT_NEAR(gab[i][k], avg, 1e-7 + 1e-5 * std::abs(avg));
    }
  }
  EXPECT_GT(max_abs, 1e-3);
}

TEST(MlpTest, SampleOrderAndRepeats) {
  absl::StatusOr<Mlp> mlp = Mlp::FromTeacher({4, 6, 2}, 8, 5);
  ASSERT_TRUE(mlp.ok()) << mlp.status();
  std::vector<std::vector<float>> params = ZerosLike(mlp->spec());
  ASSERT_TRUE(mlp->Initialize(19, Ptrs(params)).ok());
  auto g1 = ZerosLike(mlp->spec()), g2 = ZerosLike(mlp->spec()), g3 = ZerosLike(mlp->spec());
  absl::StatusOr<double> l1 = mlp->ForwardBackward(0, ConstPtrs(params), {{1, 4}}, Ptrs(g1));
  absl::StatusOr<double> l2 = mlp->ForwardBackward(0, ConstPtrs(params), {{4, 1}}, Ptrs(g2));
  // A batch larger than N wraps: (s B + j) mod N repeats samples.
  absl::StatusOr<double> l3 = mlp->ForwardBackward(0, ConstPtrs(params), {{1, 4, 1, 4}}, Ptrs(g3));
  ASSERT_TRUE(l1.ok() && l2.ok() && l3.ok());
  EXPECT_NEAR(*l1, *l2, 1e-12);
  EXPECT_NEAR(*l1, *l3, 1e-12);
  for (size_t i = 0; i < g1.size(); ++i) {
    for (size_t k = 0; k < g1[i].size(); ++k) {
      EXPECT_NEAR(g1[i][k], g2[i][k], 1e-6);
      EXPECT_NEAR(g1[i][k], g3[i][k], 1e-6);
    }
  }
}

TEST(MlpTest, ForwardMatchesDoubleForward) {
  absl::StatusOr<std::vector<std::vector<float>>> params = MlpInitialParams(kDims, 4);
  ASSERT_TRUE(params.ok());
  std::vector<float> x = {0.5f, -0.25f, 1.0f, -1.0f, 0.0f, 0.75f};
  absl::StatusOr<std::vector<float>> y = MlpForward(kDims, *params, x, 2);
  ASSERT_TRUE(y.ok()) << y.status();
  ASSERT_EQ(y->size(), 4u);
  std::vector<std::vector<double>> p;
  for (const auto& t : *params) p.emplace_back(t.begin(), t.end());
  // The loss against targets y itself, in double, is ~ fp32 error squared.
  EXPECT_LT(DoubleLoss(kDims, p, x, *y, {0, 1}), 1e-12);
  EXPECT_GT(DoubleLoss(kDims, p, x, std::vector<float>(4, 0.0f), {0, 1}), 1e-4);

  EXPECT_EQ(MlpForward(kDims, *params, x, 3).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<std::vector<float>> short_params = *params;
  short_params[3].pop_back();
  EXPECT_EQ(MlpForward(kDims, short_params, x, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  short_params.pop_back();
  EXPECT_EQ(MlpForward(kDims, short_params, x, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MlpTest, CreateRejectsBadData) {
  const auto code = [](absl::StatusOr<Mlp> m) { return m.status().code(); };
  constexpr auto kBad = absl::StatusCode::kInvalidArgument;
  // x [2, 3], y [2, 2] is right.
  EXPECT_TRUE(Mlp::Create(kDims, std::vector<float>(6), std::vector<float>(4)).ok());
  EXPECT_EQ(code(Mlp::Create(kDims, std::vector<float>(7), std::vector<float>(4))), kBad);
  EXPECT_EQ(code(Mlp::Create(kDims, std::vector<float>(6), std::vector<float>(6))), kBad);
  EXPECT_EQ(code(Mlp::Create(kDims, {}, {})), kBad);
  std::vector<float> nan_x(6);
  nan_x[4] = std::numeric_limits<float>::quiet_NaN();
  absl::StatusOr<Mlp> with_nan = Mlp::Create(kDims, nan_x, std::vector<float>(4));
  EXPECT_EQ(with_nan.status().code(), kBad);
  EXPECT_THAT(with_nan.status().message(), HasSubstr("x[4]"));
  std::vector<float> inf_y(4);
  inf_y[0] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(code(Mlp::Create(kDims, std::vector<float>(6), inf_y)), kBad);
  EXPECT_EQ(code(Mlp::Create({3}, std::vector<float>(6), std::vector<float>(6))), kBad);
  EXPECT_EQ(code(Mlp::Create({3, 0, 2}, std::vector<float>(6), std::vector<float>(4))), kBad);
  EXPECT_EQ(code(Mlp::Create({3, kMlpMaxDim + 1, 2}, std::vector<float>(6), std::vector<float>(4))),
            kBad);
  EXPECT_EQ(code(Mlp::FromTeacher(kDims, 1, 0)), kBad);
  EXPECT_EQ(code(Mlp::FromTeacher(kDims, 1, -3)), kBad);
  EXPECT_EQ(code(Mlp::FromTeacher({kMlpMaxDim, 1}, 1, kMlpMaxDataElements)), kBad);
}

TEST(MlpTest, ForwardBackwardRejectsBadInputAndWritesNothing) {
  absl::StatusOr<Mlp> mlp = Mlp::FromTeacher(kDims, 1, 4);
  ASSERT_TRUE(mlp.ok()) << mlp.status();
  std::vector<std::vector<float>> params = ZerosLike(mlp->spec());
  ASSERT_TRUE(mlp->Initialize(12, Ptrs(params)).ok());
  std::vector<std::vector<float>> grads = ZerosLike(mlp->spec());
  for (auto& g : grads) std::fill(g.begin(), g.end(), 42.0f);
  const auto sentinel = grads;
  const auto run = [&](std::vector<int64_t> samples) {
    return mlp->ForwardBackward(0, ConstPtrs(params), samples, Ptrs(grads)).status();
  };
  EXPECT_EQ(run({}).code(), absl::StatusCode::kInvalidArgument);
  absl::Status out_of_range = run({0, 4});
  EXPECT_EQ(out_of_range.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out_of_range.message(), HasSubstr("samples[1] = 4"));
  EXPECT_EQ(run({-1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(grads, sentinel);

  std::vector<const float*> few = ConstPtrs(params);
  few.pop_back();
  EXPECT_EQ(mlp->ForwardBackward(0, few, {{0}}, Ptrs(grads)).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float*> null_grad = Ptrs(grads);
  null_grad[2] = nullptr;
  EXPECT_EQ(mlp->ForwardBackward(0, ConstPtrs(params), {{0}}, null_grad).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(grads, sentinel);

  std::vector<float*> few_init = Ptrs(params);
  few_init.pop_back();
  EXPECT_EQ(mlp->Initialize(1, few_init).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace muonmesh::worker
