// The synthetic workload: documented scaling rule, gradients and weights
// that are a function of (seed, step, parameter, element) only.

#include "worker/model/synthetic.h"

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/model/rng.h"
#include "tests/testing/model_specs.h"

namespace muonmesh::worker {
namespace {

using ::testing::HasSubstr;

std::vector<std::vector<float>> Buffers(const Synthetic& w, float fill = 0.0f) {
  std::vector<std::vector<float>> out;
  for (int64_t n : w.param_elements()) out.emplace_back(static_cast<size_t>(n), fill);
  return out;
}

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

plan::ModelSpec SmallSpec() {
  plan::ModelSpec spec;
  spec.name = "small";
  spec.units.push_back({"u0",
                        {{"u0.w", {10, 6}, "muon", false},
                         {"u0.b", {10}, "adamw", false},
                         {"u0.experts", {6, 4, 2}, "muon", true}}});
  spec.units.push_back({"u1", {{"u1.w", {5, 3}, "muon", false}}});
  return spec;
}

std::string SpecPath(const std::string& name) {
  return std::string(MUONMESH_SPECS_DIR) + "/" + name + ".json";
}

TEST(SyntheticTest, ScaleDimRoundsHalvesAwayAndKeepsOne) {
  EXPECT_EQ(ScaleDim(768, 0.125), 96);
  EXPECT_EQ(ScaleDim(50257, 0.125), 6282);  // 6282.125
  EXPECT_EQ(ScaleDim(5, 0.5), 3);           // 2.5 -> 3
  EXPECT_EQ(ScaleDim(3, 0.5), 2);           // 1.5 -> 2
  EXPECT_EQ(ScaleDim(7, 0.01), 1);          // 0.07 -> 0 -> at least 1
  EXPECT_EQ(ScaleDim(7, 1.0), 7);
  EXPECT_EQ(ScaleDim(7, 2.0), 14);
}

TEST(SyntheticTest, ScalesEveryDimAndRoundsExpertsUpToTheDivisor) {
  absl::StatusOr<plan::ModelSpec> s = ScaleModelSpec(SmallSpec(), 0.5, 4);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->name, "small");
  ASSERT_EQ(s->units.size(), 2u);
  const auto& u0 = s->units[0].params;
  EXPECT_EQ(u0[0].shape, (std::vector<int64_t>{5, 3}));
  EXPECT_EQ(u0[1].shape, (std::vector<int64_t>{5}));
  // E = 6 -> 3 -> up to a multiple of 4 = 4; [4, 2] -> [2, 1].
  EXPECT_EQ(u0[2].shape, (std::vector<int64_t>{4, 2, 1}));
  EXPECT_TRUE(u0[2].expert);
  EXPECT_EQ(u0[2].name, "u0.experts");
  EXPECT_EQ(u0[2].optimizer, "muon");
  EXPECT_EQ(s->units[1].params[0].shape, (std::vector<int64_t>{3, 2}));  // 2.5, 1.5

  s = ScaleModelSpec(SmallSpec(), 0.5, 3);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->units[0].params[2].shape[0], 3);
  s = ScaleModelSpec(SmallSpec(), 1.0, 4);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->units[0].params[2].shape, (std::vector<int64_t>{8, 4, 2}));
  EXPECT_EQ(s->units[0].params[0].shape, (std::vector<int64_t>{10, 6}));
}

TEST(SyntheticTest, Gpt2SpecScalesToExpectedShapes) {
  const std::string path = SpecPath("gpt2-124m");
  ASSERT_TRUE(muonmesh::testing::ModelSpecExists(path));
  absl::StatusOr<Synthetic> w = Synthetic::FromSpecFile(path, 0.125, 1, 0);
  ASSERT_TRUE(w.ok()) << w.status();
  const plan::ModelSpec& spec = w->spec();
  EXPECT_EQ(spec.name, "gpt2-124m");
  ASSERT_EQ(spec.units.size(), 14u);  // embed, h.0..h.11, head
  int64_t count = 0;
  for (const auto& u : spec.units) count += static_cast<int64_t>(u.params.size());
  EXPECT_EQ(count, 148);
  EXPECT_EQ(static_cast<int64_t>(w->param_elements().size()), 148);

  const auto find = [&](const std::string& name) -> const plan::ParamSpec* {
    for (const auto& u : spec.units) {
      for (const auto& p : u.params) {
        if (p.name == name) return &p;
      }
    }
    return nullptr;
  };
  // 50257 x 768 -> 6282 x 96; 1024 -> 128; 2304 -> 288; 3072 -> 384.
  const struct {
    const char* name;
    std::vector<int64_t> shape;
    const char* optimizer;
  } kExpected[] = {
      {"wte.weight", {6282, 96}, "adamw"},
      {"wpe.weight", {128, 96}, "adamw"},
      {"h.0.ln_1.weight", {96}, "adamw"},
      {"h.0.attn.c_attn.weight", {288, 96}, "muon"},
      {"h.0.attn.c_attn.bias", {288}, "adamw"},
      {"h.11.attn.c_proj.weight", {96, 96}, "muon"},
      {"h.5.mlp.c_fc.weight", {384, 96}, "muon"},
      {"h.5.mlp.c_proj.weight", {96, 384}, "muon"},
      {"ln_f.bias", {96}, "adamw"},
  };
  for (const auto& e : kExpected) {
    const plan::ParamSpec* p = find(e.name);
    ASSERT_NE(p, nullptr) << e.name;
    EXPECT_EQ(p->shape, e.shape) << e.name;
    EXPECT_EQ(p->optimizer, e.optimizer) << e.name;
  }
  // Per layer: 4 * 96 (ln) + 288*96 + 288 + 96*96 + 96 + 384*96 + 384 + 96*384 + 96.
  const int64_t layer = 4 * 96 + 288 * 96 + 288 + 96 * 96 + 96 + 384 * 96 + 384 + 96 * 384 + 96;
  EXPECT_EQ(w->total_elements(), 6282 * 96 + 128 * 96 + 12 * layer + 2 * 96);
}

TEST(SyntheticTest, DeepSeekExpertsStayDivisible) {
  const std::string path = SpecPath("deepseek-v3");
  ASSERT_TRUE(muonmesh::testing::ModelSpecExists(path));
  for (int64_t divisor : {1, 2, 4, 8}) {
    absl::StatusOr<Synthetic> w = Synthetic::FromSpecFile(path, 0.01, divisor, 0);
    ASSERT_TRUE(w.ok()) << w.status();
    int experts = 0;
    for (const auto& u : w->spec().units) {
      for (const auto& p : u.params) {
        if (!p.expert) continue;
        ++experts;
        // 256 * 0.01 = 2.56 -> 3, rounded up to the divisor.
        const int64_t e = (3 + divisor - 1) / divisor * divisor;
        EXPECT_EQ(p.shape[0], e) << p.name;
        EXPECT_EQ(p.shape[0] % divisor, 0);
        // 2048 -> 20, 7168 -> 72.
        EXPECT_TRUE((p.shape == std::vector<int64_t>{e, 20, 72}) ||
                    (p.shape == std::vector<int64_t>{e, 72, 20}))
            << p.name;
      }
    }
    EXPECT_GT(experts, 0);
  }
}

TEST(SyntheticTest, GradientsFollowTheFormulaWhateverIsAsked) {
  absl::StatusOr<Synthetic> w = Synthetic::Create(SmallSpec(), 1.0, 1, 1234);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->num_samples(), 1);
  auto params = Buffers(*w, 3.0f);
  auto grads = Buffers(*w);
  for (int64_t step : {0, 1, 7}) {
    absl::StatusOr<double> loss = w->ForwardBackward(step, ConstPtrs(params), {{0}}, Ptrs(grads));
    ASSERT_TRUE(loss.ok()) << loss.status();
    const uint64_t seed = 1234 ^ (static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ULL);
    double sum = 0;
    int64_t count = 0;
    for (size_t p = 0; p < grads.size(); ++p) {
      for (size_t k = 0; k < grads[p].size(); ++k) {
        const float expected = static_cast<float>(UniformAt(seed, p, k) * 0.01);
        ASSERT_EQ(grads[p][k], expected) << "step " << step << " param " << p << " elem " << k;
        sum += static_cast<double>(expected) * expected;
        ++count;
      }
    }
    EXPECT_DOUBLE_EQ(*loss, 0.5 * sum / count);
  }

  // Independent of the parameters, the number of samples, and of which
  // other parameters the spec holds: a spec with only u0.w (parameter 0)
  // gets the same values for it.
  auto other_params = Buffers(*w, -1.0f);
  auto grads2 = Buffers(*w);
  ASSERT_TRUE(w->ForwardBackward(7, ConstPtrs(other_params), {{0, 0, 0}}, Ptrs(grads2)).ok());
  EXPECT_EQ(grads, grads2);
  plan::ModelSpec only_first;
  only_first.units.push_back({"u0", {{"u0.w", {10, 6}, "muon", false}}});
  absl::StatusOr<Synthetic> w1 = Synthetic::Create(only_first, 1.0, 1, 1234);
  ASSERT_TRUE(w1.ok());
  auto p1 = Buffers(*w1);
  auto g1 = Buffers(*w1);
  ASSERT_TRUE(w1->ForwardBackward(7, ConstPtrs(p1), {{0}}, Ptrs(g1)).ok());
  EXPECT_EQ(g1[0], grads[0]);

  // Another step or seed gives other gradients.
  ASSERT_TRUE(w->ForwardBackward(8, ConstPtrs(params), {{0}}, Ptrs(grads2)).ok());
  EXPECT_NE(grads, grads2);
  absl::StatusOr<Synthetic> w2 = Synthetic::Create(SmallSpec(), 1.0, 1, 1235);
  ASSERT_TRUE(w2.ok());
  ASSERT_TRUE(w2->ForwardBackward(7, ConstPtrs(params), {{0}}, Ptrs(grads2)).ok());
  EXPECT_NE(grads, grads2);
}

TEST(SyntheticTest, InitialWeightsFollowTheFormula) {
  absl::StatusOr<Synthetic> w = Synthetic::Create(SmallSpec(), 1.0, 1, 0);
  ASSERT_TRUE(w.ok());
  auto a = Buffers(*w);
  auto b = Buffers(*w);
  ASSERT_TRUE(w->Initialize(77, Ptrs(a)).ok());
  ASSERT_TRUE(w->Initialize(77, Ptrs(b)).ok());
  EXPECT_EQ(a, b);
  double max_abs = 0;
  for (size_t p = 0; p < a.size(); ++p) {
    for (size_t k = 0; k < a[p].size(); ++k) {
      EXPECT_EQ(a[p][k], static_cast<float>(UniformAt(77, p + (1u << 20), k) * 0.02));
      max_abs = std::max(max_abs, std::abs(static_cast<double>(a[p][k])));
    }
  }
  EXPECT_LE(max_abs, 0.02);
  EXPECT_GT(max_abs, 0.01);
}

TEST(SyntheticTest, RejectsBadSpecsAndScales) {
  constexpr auto kBad = absl::StatusCode::kInvalidArgument;
  const auto code = [](const absl::StatusOr<plan::ModelSpec>& s) { return s.status().code(); };
  EXPECT_EQ(code(ScaleModelSpec(SmallSpec(), 0.0, 1)), kBad);
  EXPECT_EQ(code(ScaleModelSpec(SmallSpec(), -0.5, 1)), kBad);
  EXPECT_EQ(code(ScaleModelSpec(SmallSpec(), std::numeric_limits<double>::quiet_NaN(), 1)), kBad);
  EXPECT_EQ(code(ScaleModelSpec(SmallSpec(), std::numeric_limits<double>::infinity(), 1)), kBad);
  EXPECT_EQ(code(ScaleModelSpec(SmallSpec(), 0.5, 0)), kBad);
  EXPECT_EQ(code(ScaleModelSpec(SmallSpec(), 1e12, 1)), kBad);  // 1e13 x 6e12 elements
  EXPECT_EQ(code(ScaleModelSpec(plan::ModelSpec{}, 1.0, 1)), kBad);

  plan::ModelSpec bad = SmallSpec();
  bad.units[1].params[0].shape[1] = 0;
  absl::StatusOr<plan::ModelSpec> s = ScaleModelSpec(bad, 1.0, 1);
  EXPECT_EQ(code(s), kBad);
  EXPECT_THAT(s.status().message(), HasSubstr("units[1].params[0].shape[1]"));
  bad = SmallSpec();
  bad.units[0].params[1].shape.clear();
  EXPECT_EQ(code(ScaleModelSpec(bad, 1.0, 1)), kBad);
  bad = SmallSpec();
  bad.units[0].params[2].shape = {6};
  EXPECT_EQ(code(ScaleModelSpec(bad, 1.0, 1)), kBad);

  EXPECT_EQ(Synthetic::FromSpecFile("/nonexistent/spec.json", 1.0, 1, 0).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(SyntheticTest, ForwardBackwardRejectsBadInputAndWritesNothing) {
  absl::StatusOr<Synthetic> w = Synthetic::Create(SmallSpec(), 1.0, 1, 0);
  ASSERT_TRUE(w.ok());
  auto params = Buffers(*w);
  auto grads = Buffers(*w, 42.0f);
  const auto sentinel = grads;
  const auto run = [&](int64_t step, std::vector<int64_t> samples) {
    return w->ForwardBackward(step, ConstPtrs(params), samples, Ptrs(grads)).status().code();
  };
  constexpr auto kBad = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(run(0, {}), kBad);
  EXPECT_EQ(run(0, {1}), kBad);
  EXPECT_EQ(run(0, {0, -1}), kBad);
  EXPECT_EQ(run(-1, {0}), kBad);
  std::vector<float*> few = Ptrs(grads);
  few.pop_back();
  EXPECT_EQ(w->ForwardBackward(0, ConstPtrs(params), {{0}}, few).status().code(), kBad);
  std::vector<float*> null_grad = Ptrs(grads);
  null_grad[0] = nullptr;
  EXPECT_EQ(w->ForwardBackward(0, ConstPtrs(params), {{0}}, null_grad).status().code(), kBad);
  EXPECT_EQ(grads, sentinel);
  EXPECT_EQ(w->Initialize(0, few).code(), kBad);
}

}  // namespace
}  // namespace muonmesh::worker
