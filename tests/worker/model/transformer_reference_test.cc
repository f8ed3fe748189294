// The `transformer`'s double-precision reference (transformer_reference.h)
// against central differences of its own loss, with grouped-query attention
// and both heads (untied, tied), and with multi-head latent attention (with
// and without q_lora); and its RoPE
// and RMSNorm against values worked out by hand.

#include "tests/worker/model/transformer_reference.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/worker/model/central_difference.h"

namespace muonmesh::reference {
namespace {

// V 11, T 5, 2 layers, C 8, 4 heads over 2 kv heads of D 4, F 6; with
// `mla`, heads of dn 2 + dr 2 (v 3) from a kv rank of 5 and a q rank of
// `q_rank`.
RefTransformerDims Tiny(bool tied, bool mla = false, int64_t q_rank = 0) {
  RefTransformerDims d;
  d.vocab = 11;
  d.seq = 5;
  d.layers = 2;
  d.embd = 8;
  d.heads = 4;
  d.kv_heads = 2;
  d.head_dim = 4;
  d.ffn = 6;
  d.theta = 100.0;  // angles that turn within T positions
  d.tied = tied;
  d.mla = mla;
  d.q_rank = q_rank;
  d.kv_rank = 5;
  d.dn = 2;
  d.dr = 2;
  d.dv = 3;
  return d;
}

// Norm weights 1 + U(-0.2, 0.2), everything else U(-0.5, 0.5), from
// mt19937_64 on a 24-bit grid.
TransformerTensors Params(const RefTransformerDims& d, uint64_t seed) {
  std::mt19937_64 gen(seed);
  auto uniform = [&gen] { return static_cast<double>(gen() >> 40) * 0x1p-24 * 2.0 - 1.0; };
  std::vector<std::pair<int64_t, bool>> shapes = {{d.vocab * d.embd, false}};
  for (int64_t l = 0; l < d.layers; ++l) {
    for (const transformer_internal::Named& n : transformer_internal::LayerNames(d, l)) {
      shapes.push_back({n.size, n.name.find("norm") != std::string::npos});
    }
  }
  shapes.push_back({d.embd, true});
  if (!d.tied) shapes.push_back({d.vocab * d.embd, false});
  TransformerTensors out;
  for (auto [size, norm] : shapes) {
    std::vector<double> v(size);
    for (double& x : v) x = norm ? 1.0 + 0.2 * uniform() : 0.5 * uniform();
    out.push_back(v);
  }
  return out;
}

std::vector<int32_t> Tokens(int64_t count, int32_t vocab) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < count; ++i) t.push_back(static_cast<int32_t>((7 * i * i + 3 * i) % vocab));
  return t;
}

struct RefCase {
  const char* name;
  bool tied, mla;
  int64_t q_rank;
  int moe = 0;  // 0: dense; 1: softmax, shared, no balance loss; 2: sigmoid, balance loss
};

// Experts in layer 1 (layer 0 dense): 4 of width 3, top 2, biased.
void AddExperts(int kind, RefTransformerDims& d, MoeState& state) {
  if (kind == 0) return;
  d.experts = 4;
  d.top_k = 2;
  d.expert_ffn = 3;
  d.first_dense = 1;
  d.shared = kind == 1 ? 1 : 0;
  d.sigmoid = kind == 2;
  d.norm_topk = kind == 1;
  d.route_scale = kind == 1 ? 1.0 : 2.5;
  d.aux_coef = kind == 2 ? 0.3 : 0.0;
  state.bias = {{}, {0.01, -0.02, 0.03, 0.0}};
}

class TransformerReferenceTest : public ::testing::TestWithParam<RefCase> {};

TEST_P(TransformerReferenceTest, GradientsMatchCentralDifferences) {
  RefTransformerDims d = Tiny(GetParam().tied, GetParam().mla, GetParam().q_rank);
  MoeState state;
  AddExperts(GetParam().moe, d, state);
  TransformerTensors params = Params(d, 5);
  const std::vector<int32_t> tokens = Tokens(23, 11);
  const std::vector<int64_t> samples = {0, 3, 3};  // a repeat: gradients add up
  TransformerTensors grads;
  std::vector<double> logits;
  const double loss =
      TransformerRefLossAndGrad(d, params, tokens, samples, &grads, &logits, &state);
  EXPECT_GT(loss, 0.5);
  ASSERT_EQ(logits.size(), 8u);
  for (double m : logits) EXPECT_GT(m, -1e300);
  if (GetParam().moe != 0) {
    // Every position of every sample sends K = 2 tokens in the MoE layer.
    int64_t routed = 0;
    for (int64_t c : state.counts[1]) routed += c;
    EXPECT_EQ(routed, 2 * 5 * 3);
    EXPECT_EQ(state.counts[0], std::vector<int64_t>(4, 0));
    if (d.aux_coef > 0) {
      EXPECT_GT(state.aux, 0.0);
    }
  }
  auto f = [&](const TransformerTensors& p) {
    MoeState again = state;
    return TransformerRefLossAndGrad(d, p, tokens, samples, nullptr, nullptr, &again);
  };
  const std::vector<double> largest = ExpectGradientsMatchCentralDifferences(f, params, grads);
  for (size_t i = 0; i < largest.size(); ++i) EXPECT_GT(largest[i], 1e-4) << "param " << i;
}

INSTANTIATE_TEST_SUITE_P(Heads, TransformerReferenceTest,
                         ::testing::Values(RefCase{"untied", false, false, 0},
                                           RefCase{"tied", true, false, 0},
                                           RefCase{"mla", false, true, 0},
                                           RefCase{"mla_q_lora", true, true, 3},
                                           RefCase{"moe_softmax_shared", false, false, 0, 1},
                                           RefCase{"moe_sigmoid_aux_mla", false, true, 3, 2}),
                         [](const auto& info) { return std::string(info.param.name); });

// RoPE at position t turns pair (x_i, x_{i+R/2}) by t theta^(-2i/R); its
// transpose turns it back. RMSNorm of (3, 4) with eps 0: (3, 4) / sqrt(12.5).
TEST(TransformerReferenceTest, RopeAndRmsNormByHand) {
  std::vector<double> v = {1.0, 2.0, 3.0, 4.0};  // R = 4: pairs (1, 3) and (2, 4)
  transformer_internal::Rope(v, 1, 4, 3, 100.0, 1.0);
  const double a0 = 3.0, a1 = 3.0 * std::pow(100.0, -0.5);
  EXPECT_NEAR(v[0], 1 * std::cos(a0) - 3 * std::sin(a0), 1e-15);
  EXPECT_NEAR(v[2], 3 * std::cos(a0) + 1 * std::sin(a0), 1e-15);
  EXPECT_NEAR(v[1], 2 * std::cos(a1) - 4 * std::sin(a1), 1e-15);
  EXPECT_NEAR(v[3], 4 * std::cos(a1) + 2 * std::sin(a1), 1e-15);
  transformer_internal::Rope(v, 1, 4, 3, 100.0, -1.0);
  EXPECT_NEAR(v[0], 1.0, 1e-14);
  EXPECT_NEAR(v[3], 4.0, 1e-14);
  const transformer_internal::Rms n = transformer_internal::RmsForward({3.0, 4.0}, {1.0, 2.0}, 0.0);
  EXPECT_NEAR(n.y[0], 3.0 / std::sqrt(12.5), 1e-15);
  EXPECT_NEAR(n.y[1], 8.0 / std::sqrt(12.5), 1e-15);
}

}  // namespace
}  // namespace muonmesh::reference
