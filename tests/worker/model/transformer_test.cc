// The dense `transformer` workload (worker/model/transformer.h) against its
// independent double reference (transformer_reference.h): loss, gradients
// and attention logits with grouped and full kv heads, untied and tied; the
// QK-clip rows; the initialisation's statistics; and what Create refuses.

#include "worker/model/transformer.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/model/transformer_reference.h"
#include "worker/model/token_windows.h"

namespace muonmesh::worker {
namespace {

using ::testing::HasSubstr;
using Floats = std::vector<std::vector<float>>;

// V 11, T 5, 2 layers, C 8, 4 heads of D 4 over `kv` kv heads, F 6.
model::TransformerDims Tiny(int64_t kv, bool tied) {
  model::TransformerDims d;
  d.vocab_size = 11;
  d.seq_len = 5;
  d.n_layer = 2;
  d.d_model = 8;
  d.n_head = 4;
  d.n_kv_head = kv;
  d.head_dim = 4;
  d.ffn_hidden = 6;
  d.rope_theta = 100.0;
  d.tie_embeddings = tied;
  return d;
}

// Tiny with MLA: heads of dn 2 + dr 2 (v 3) from a kv rank of 5, and a q
// rank of `q_rank`.
model::TransformerDims TinyMla(int64_t q_rank, bool tied) {
  model::TransformerDims d = Tiny(4, tied);
  d.attention = model::Attention::kMla;
  d.mla = {q_rank, 5, 2, 2, 3};
  return d;
}

reference::RefTransformerDims RefDims(const model::TransformerDims& d) {
  reference::RefTransformerDims r;
  r.vocab = d.vocab_size;
  r.seq = d.seq_len;
  r.layers = d.n_layer;
  r.embd = d.d_model;
  r.heads = d.n_head;
  r.kv_heads = d.n_kv_head;
  r.head_dim = d.head_dim;
  r.ffn = d.ffn_hidden;
  r.eps = d.norm_eps;
  r.theta = d.rope_theta;
  r.tied = d.tie_embeddings;
  r.mla = d.attention == model::Attention::kMla;
  r.q_rank = d.mla.q_lora_rank;
  r.kv_rank = d.mla.kv_lora_rank;
  r.dn = d.mla.qk_nope_head_dim;
  r.dr = d.mla.qk_rope_head_dim;
  r.dv = d.mla.v_head_dim;
  if (d.moe.has_value()) {
    r.experts = d.moe->n_routed_experts;
    r.top_k = d.moe->top_k;
    r.expert_ffn = d.moe->moe_ffn_hidden;
    r.shared = d.moe->n_shared_experts;
    r.first_dense = d.moe->first_k_dense;
    r.sigmoid = d.moe->score == model::RouterScore::kSigmoid;
    r.norm_topk = d.moe->norm_topk_prob;
    r.route_scale = d.moe->route_scale;
    r.aux_coef = d.moe->aux_loss_coef;
  }
  return r;
}

std::vector<int32_t> Tokens(int64_t count, int32_t vocab) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < count; ++i) t.push_back(static_cast<int32_t>((7 * i * i + 3 * i) % vocab));
  return t;
}

Transformer Make(const model::TransformerDims& d) {
  absl::StatusOr<Transformer> t =
      Transformer::Create(d, std::make_shared<InMemoryTokens>(Tokens(23, 11)));
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

// Norm weights 1 + U(-0.2, 0.2), the rest U(-0.5, 0.5), on a 24-bit grid
// (exact in float and double).
Floats Params(const plan::ModelSpec& spec, uint64_t seed) {
  std::mt19937_64 gen(seed);
  auto uniform = [&gen] { return static_cast<double>(gen() >> 40) * 0x1p-24 * 2.0 - 1.0; };
  Floats out;
  for (const plan::UnitSpec& u : spec.units) {
    for (const plan::ParamSpec& p : u.params) {
      const bool norm = p.shape.size() == 1;
      int64_t n = 1;
      for (int64_t d : p.shape) n *= d;
      std::vector<float> v(static_cast<size_t>(n));
      for (float& x : v) x = static_cast<float>(norm ? 1.0 + 0.2 * uniform() : 0.5 * uniform());
      out.push_back(std::move(v));
    }
  }
  return out;
}

struct Case {
  const char* name;
  int64_t kv;  // -1: mla
  bool tied;
  int64_t q_rank = 0;
  // 0: dense; 1: experts in layer 1 (softmax, a shared expert, top 2 of 4,
  // renormalized); 2: in both layers (sigmoid, top 3 of 4, scaled by 2.5,
  // the balance loss).
  int moe = 0;
};

model::TransformerDims DimsOf(const Case& c) {
  model::TransformerDims d = c.kv < 0 ? TinyMla(c.q_rank, c.tied) : Tiny(c.kv, c.tied);
  if (c.moe == 1) d.moe = model::MoeDims{4, 2, 3, 1, 1};
  if (c.moe == 2) {
    d.moe = model::MoeDims{4, 3, 3, 0, 0, model::RouterScore::kSigmoid, false, 2.5, 0.001, 0.3};
  }
  return d;
}

class TransformerTest : public ::testing::TestWithParam<Case> {};

// fp32 against the double reference: the loss within 1e-6 relative, every
// gradient entry within 1e-5 + 1e-4 |want| (the sums here have at most
// 8 terms of O(1) values), and each head's largest logit within 1e-5.
TEST_P(TransformerTest, ForwardBackwardMatchesTheReference) {
  const model::TransformerDims d = DimsOf(GetParam());
  Transformer model = Make(d);
  const Floats params = Params(model.spec(), 5);
  const std::vector<int64_t> samples = {0, 3, 3, 17};
  Floats grads = params;
  std::vector<const float*> p;
  std::vector<float*> g;
  for (size_t i = 0; i < params.size(); ++i) {
    p.push_back(params[i].data());
    g.push_back(grads[i].data());
  }
  // A balancing bias that changes some choices: each MoE layer's own.
  reference::MoeState state;
  std::vector<std::vector<float>> bias;
  for (int64_t l = 0; l < d.n_layer; ++l) {
    state.bias.emplace_back();
    if (!model::IsMoeLayer(d, l)) continue;
    bias.push_back({0.05f * static_cast<float>(l), -0.0625f, 0.125f, 0.0f});
    state.bias.back().assign(bias.back().begin(), bias.back().end());
  }
  ASSERT_TRUE(model.SetBuffers(bias).ok());
  model.ResetAttentionLogits();
  model.ResetBufferStats();
  absl::StatusOr<double> loss = model.ForwardBackward(0, p, samples, absl::MakeSpan(g));
  ASSERT_TRUE(loss.ok()) << loss.status();
  reference::TransformerTensors ref_params;
  for (const auto& v : params) ref_params.emplace_back(v.begin(), v.end());
  reference::TransformerTensors want;
  std::vector<double> logits;
  const double want_loss = reference::TransformerRefLossAndGrad(
      RefDims(d), ref_params, Tokens(23, 11), samples, &want, &logits, &state);
  // The tokens routed per expert, layer by layer, as the reference routed them.
  std::vector<float> counts;
  for (int64_t l = 0; l < d.n_layer; ++l) {
    if (model::IsMoeLayer(d, l)) counts.insert(counts.end(), state.counts[l].begin(), state.counts[l].end());
  }
  EXPECT_THAT(model.buffer_stats(), ::testing::ElementsAreArray(counts));
  EXPECT_NEAR(*loss, want_loss, 1e-6 * want_loss);
  ASSERT_EQ(want.size(), grads.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(want[i].size(), grads[i].size());
    for (size_t k = 0; k < want[i].size(); ++k) {
      EXPECT_NEAR(grads[i][k], want[i][k], 1e-5 + 1e-4 * std::abs(want[i][k]))
          << "param " << i << " [" << k << "]";
    }
  }
  ASSERT_EQ(model.attention_logits().size(), logits.size());
  for (size_t i = 0; i < logits.size(); ++i) {
    EXPECT_NEAR(model.attention_logits()[i], logits[i], 1e-5 + 1e-5 * std::abs(logits[i])) << i;
  }
  // Loss-only passes record nothing and give the same loss.
  model.ResetAttentionLogits();
  WholeModelAccess whole(model.spec(), p, {});
  absl::StatusOr<double> plain = model.LossByUnit(whole, model.train_stream(), samples);
  ASSERT_TRUE(plain.ok()) << plain.status();
  if (state.aux == 0.0) {
    EXPECT_EQ(*plain, *loss);
  } else {
    // Without the balance term, which the training loss holds.
    EXPECT_NEAR(*plain, want_loss - state.aux, 1e-6 * want_loss);
    ASSERT_TRUE(model.aux_loss().has_value());
    EXPECT_NEAR(*model.aux_loss(), state.aux, 1e-6 * state.aux);
    EXPECT_GT(state.aux, 0.0);
  }
  for (float v : model.attention_logits()) EXPECT_EQ(v, -std::numeric_limits<float>::infinity());
}

INSTANTIATE_TEST_SUITE_P(Heads, TransformerTest,
                         ::testing::Values(Case{"gqa_untied", 2, false}, Case{"mha_tied", 4, true},
                                           Case{"mqa_untied", 1, false},
                                           Case{"mla_untied", -1, false},
                                           Case{"mla_q_lora_tied", -1, true, 3},
                                           Case{"moe_gqa", 2, false, 0, 1},
                                           Case{"moe_sigmoid_aux_mla", -1, true, 3, 2}),
                         [](const auto& info) { return std::string(info.param.name); });

// MHA: head h's q and k rows by sqrt(tau / S); GQA: its q rows by tau / S.
TEST(TransformerQkClipTest, RowsFollowTheHeadLayout) {
  const std::vector<float> logits = {1, 9, 1, 1, 1, 1, 1, 4};  // [layer][head]
  Transformer gqa = Make(Tiny(2, false));
  std::vector<RowScale> rows = gqa.QkClipRows(logits, 2.0);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].flat, 2);  // layers.0.attn.q_proj.weight
  EXPECT_EQ(rows[0].row_start, 4);
  EXPECT_EQ(rows[0].rows, 4);
  EXPECT_FLOAT_EQ(rows[0].factor, 2.0f / 9.0f);
  EXPECT_EQ(rows[1].flat, 11);  // layers.1.attn.q_proj.weight
  EXPECT_EQ(rows[1].row_start, 12);
  EXPECT_FLOAT_EQ(rows[1].factor, 0.5f);
  Transformer mha = Make(Tiny(4, false));
  rows = mha.QkClipRows(logits, 2.0);
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_EQ(rows[1].flat, 3);  // layers.0.attn.k_proj.weight
  EXPECT_FLOAT_EQ(rows[1].factor, static_cast<float>(std::sqrt(2.0 / 9.0)));
  EXPECT_EQ(mha.spec().units[1].params[2].name, "layers.0.attn.k_proj.weight");
}

// MLA (q_lora): head h's q_nope rows [h 4, h 4 + 2) of q_b_proj and its
// k_nope rows [h 5, h 5 + 2) of kv_b_proj by sqrt(tau / S), its q_pe rows
// [h 4 + 2, h 4 + 4) by tau / S.
TEST(TransformerQkClipTest, MlaScalesNopeByTheRootAndRopeByGamma) {
  const std::vector<float> logits = {1, 1, 8, 1, 1, 1, 1, 1};
  Transformer mla = Make(TinyMla(3, false));
  const std::vector<RowScale> rows = mla.QkClipRows(logits, 2.0);
  ASSERT_EQ(rows.size(), 3u);
  const std::vector<plan::ParamSpec>& layer = mla.spec().units[1].params;
  EXPECT_EQ(layer[rows[0].flat - 1].name, "layers.0.attn.q_b_proj.weight");
  EXPECT_EQ(rows[0].row_start, 8);
  EXPECT_EQ(rows[0].rows, 2);
  EXPECT_FLOAT_EQ(rows[0].factor, 0.5f);
  EXPECT_EQ(rows[1].flat, rows[0].flat);
  EXPECT_EQ(rows[1].row_start, 10);
  EXPECT_EQ(rows[1].rows, 2);
  EXPECT_FLOAT_EQ(rows[1].factor, 0.25f);
  EXPECT_EQ(layer[rows[2].flat - 1].name, "layers.0.attn.kv_b_proj.weight");
  EXPECT_EQ(rows[2].row_start, 10);
  EXPECT_EQ(rows[2].rows, 2);
  EXPECT_FLOAT_EQ(rows[2].factor, 0.5f);
  // Without q_lora the query rows are q_proj's.
  Transformer plain = Make(TinyMla(0, false));
  const std::vector<RowScale> q = plain.QkClipRows(logits, 2.0);
  ASSERT_EQ(q.size(), 3u);
  EXPECT_EQ(plain.spec().units[1].params[q[0].flat - 1].name, "layers.0.attn.q_proj.weight");
}

// The documented initialisation, by its statistics on a wider model: norms
// 1, matrices of std 0.02, o_proj and down_proj 0.02 / sqrt(2 L); and each
// unit alone as the whole.
TEST(TransformerInitTest, FollowsTheDocumentedDistribution) {
  model::TransformerDims d = Tiny(2, false);
  d.d_model = 64;
  d.n_head = 8;
  d.n_kv_head = 2;
  d.head_dim = 8;
  d.ffn_hidden = 128;
  d.n_layer = 4;
  Transformer model = Make(d);
  Floats params = Params(model.spec(), 1);
  std::vector<float*> p;
  for (auto& v : params) p.push_back(v.data());
  ASSERT_TRUE(model.Initialize(9, p).ok());
  auto stats = [](const std::vector<float>& v) {
    double s = 0, ss = 0;
    for (float x : v) {
      s += x;
      ss += static_cast<double>(x) * x;
    }
    const double n = static_cast<double>(v.size());
    return std::pair{s / n, std::sqrt(ss / n - (s / n) * (s / n))};
  };
  size_t flat = 0;
  for (const plan::UnitSpec& u : model.spec().units) {
    for (const plan::ParamSpec& ps : u.params) {
      const std::vector<float>& v = params[flat++];
      if (ps.shape.size() == 1) {
        for (float x : v) ASSERT_EQ(x, 1.0f) << ps.name;
        continue;
      }
      const bool scaled = ps.name.find("o_proj") != std::string::npos ||
                          ps.name.find("down_proj") != std::string::npos;
      const double want = scaled ? 0.02 / std::sqrt(8.0) : 0.02;
      const auto [mean, sd] = stats(v);
      EXPECT_NEAR(sd, want, 0.08 * want) << ps.name;
      EXPECT_NEAR(mean, 0.0, 4 * want / std::sqrt(static_cast<double>(v.size()))) << ps.name;
    }
  }
  size_t first = 0;
  for (size_t u = 0; u < model.spec().units.size(); ++u) {
    const size_t n = model.spec().units[u].params.size();
    Floats unit(params.begin() + first, params.begin() + first + n);
    for (auto& t : unit) std::fill(t.begin(), t.end(), -7.0f);
    std::vector<float*> up;
    for (auto& t : unit) up.push_back(t.data());
    ASSERT_TRUE(model.InitializeUnit(9, static_cast<int>(u), up).ok());
    for (size_t j = 0; j < n; ++j) EXPECT_EQ(unit[j], params[first + j]) << "unit " << u;
    first += n;
  }
}

TEST(TransformerCreateTest, RefusesBadDimsAndShortStreams) {
  auto tokens = std::make_shared<InMemoryTokens>(Tokens(23, 11));
  absl::Status st = Transformer::Create(Tiny(3, false), tokens).status();
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr("n_kv_head"));
  st = Transformer::Create(Tiny(2, false), std::make_shared<InMemoryTokens>(Tokens(5, 11))).status();
  EXPECT_THAT(st.message(), HasSubstr("need more than seq_len = 5"));
  model::TransformerDims moe = Tiny(2, false);
  moe.moe = model::MoeDims{4, 5, 6};
  st = Transformer::Create(moe, tokens).status();
  EXPECT_THAT(st.message(), HasSubstr("moe.top_k"));
}

}  // namespace
}  // namespace muonmesh::worker
