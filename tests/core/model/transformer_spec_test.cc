// The `transformer` spec (core/model/transformer_spec.h): at Llama-3-8B and
// DeepSeek-V3 size it is the repository's spec files, parameter for
// parameter (shapes only: nothing that size is allocated); the variants
// (tied embeddings, MLA without a q rank, no shared experts) and every
// refused size, named by its field.

#include "core/model/transformer_spec.h"

#include <string>
#include <vector>

#include "core/plan/validate.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "muonmesh/v1/config.pb.h"
#include "proto/convert/plan_convert.h"
#include "proto/io/message_file.h"

namespace muonmesh::model {
namespace {

using ::testing::HasSubstr;

plan::ModelSpec SpecFile(const std::string& name) {
  v1::ModelSpec proto;
  const std::string path = std::string(MUONMESH_SPECS_DIR) + "/" + name;
  const absl::Status st = protoio::LoadMessageFile(path, &proto);
  EXPECT_TRUE(st.ok()) << st;
  return convert::ModelFromProto(proto);
}

void ExpectSameParameters(const plan::ModelSpec& got, const plan::ModelSpec& want) {
  ASSERT_EQ(got.units.size(), want.units.size());
  for (size_t u = 0; u < want.units.size(); ++u) {
    EXPECT_EQ(got.units[u].name, want.units[u].name);
    ASSERT_EQ(got.units[u].params.size(), want.units[u].params.size()) << want.units[u].name;
    for (size_t j = 0; j < want.units[u].params.size(); ++j) {
      const plan::ParamSpec& g = got.units[u].params[j];
      const plan::ParamSpec& w = want.units[u].params[j];
      EXPECT_EQ(g.name, w.name);
      EXPECT_EQ(g.shape, w.shape) << w.name;
      EXPECT_EQ(g.optimizer, w.optimizer) << w.name;
      EXPECT_EQ(g.expert, w.expert) << w.name;
    }
  }
}

TransformerDims Llama3_8B() {
  TransformerDims d;
  d.vocab_size = 128256;
  d.seq_len = 8192;
  d.n_layer = 32;
  d.d_model = 4096;
  d.n_head = 32;
  d.n_kv_head = 8;
  d.head_dim = 128;
  d.ffn_hidden = 14336;
  d.rope_theta = 500000;
  return d;
}

TransformerDims DeepSeekV3() {
  TransformerDims d;
  d.vocab_size = 129280;
  d.seq_len = 4096;
  d.n_layer = 61;
  d.d_model = 7168;
  d.n_head = 128;
  d.ffn_hidden = 18432;
  d.attention = Attention::kMla;
  d.mla = {1536, 512, 128, 64, 128};
  MoeDims m;
  m.n_routed_experts = 256;
  m.top_k = 8;
  m.moe_ffn_hidden = 2048;
  m.n_shared_experts = 1;
  m.first_k_dense = 3;
  m.score = RouterScore::kSigmoid;
  m.route_scale = 2.5;
  d.moe = m;
  return d;
}

TEST(TransformerSpecTest, Llama3_8BIsTheSpecFile) {
  absl::StatusOr<plan::ModelSpec> spec = TransformerSpec(Llama3_8B());
  ASSERT_TRUE(spec.ok()) << spec.status();
  ExpectSameParameters(*spec, SpecFile("llama3-8b.json"));
  // 8.03 B parameters: Meta's count for Llama-3-8B.
  int64_t total = 0;
  for (const plan::UnitSpec& u : spec->units) {
    for (const plan::ParamSpec& p : u.params) total += plan::NumElements(p);
  }
  EXPECT_EQ(total, 8030261248);
}

TEST(TransformerSpecTest, DeepSeekV3IsTheSpecFile) {
  absl::StatusOr<plan::ModelSpec> spec = TransformerSpec(DeepSeekV3());
  ASSERT_TRUE(spec.ok()) << spec.status();
  ExpectSameParameters(*spec, SpecFile("deepseek-v3.json"));
}

TEST(TransformerSpecTest, VariantsChangeOnlyWhatTheyName) {
  TransformerDims d = Llama3_8B();
  d.tie_embeddings = true;
  absl::StatusOr<plan::ModelSpec> tied = TransformerSpec(d);
  ASSERT_TRUE(tied.ok());
  ASSERT_EQ(tied->units.back().params.size(), 1u);
  EXPECT_EQ(tied->units.back().params[0].name, "final_norm.weight");
  EXPECT_EQ(tied->units.front().gathers_per_step, 2);  // the lookup, then the logits

  TransformerDims m = DeepSeekV3();
  m.n_layer = 2;
  m.mla.q_lora_rank = 0;
  m.moe->n_shared_experts = 0;
  m.moe->first_k_dense = 1;
  absl::StatusOr<plan::ModelSpec> small = TransformerSpec(m);
  ASSERT_TRUE(small.ok()) << small.status();
  std::vector<std::string> names;
  for (const plan::ParamSpec& p : small->units[2].params) names.push_back(p.name);
  EXPECT_THAT(names, ::testing::ElementsAre(
                         "layers.1.attn_norm.weight", "layers.1.attn.q_proj.weight",
                         "layers.1.attn.kv_a_proj.weight", "layers.1.attn.kv_a_norm.weight",
                         "layers.1.attn.kv_b_proj.weight", "layers.1.attn.o_proj.weight",
                         "layers.1.mlp_norm.weight", "layers.1.mlp.router.weight",
                         "layers.1.mlp.experts.gate_proj", "layers.1.mlp.experts.up_proj",
                         "layers.1.mlp.experts.down_proj"));
  EXPECT_EQ(small->units[2].params[1].shape, (std::vector<int64_t>{128 * 192, 7168}));
  // Layer 0 (< first_k_dense) is dense.
  EXPECT_EQ(small->units[1].params.back().name, "layers.0.mlp.down_proj.weight");
  // An MoE model whose every layer is MoE needs no ffn_hidden.
  m.moe->first_k_dense = 0;
  m.ffn_hidden = 0;
  EXPECT_TRUE(TransformerSpec(m).ok());
}

struct Bad {
  const char* name;
  void (*change)(TransformerDims&);
  const char* field;
  const char* says;
};

class BadDimsTest : public ::testing::TestWithParam<Bad> {};

TEST_P(BadDimsTest, NamesTheField) {
  const Bad& b = GetParam();
  TransformerDims d = DeepSeekV3();
  if (std::string(b.field).rfind("mla.", 0) != 0 && std::string(b.field).rfind("moe.", 0) != 0) {
    d = Llama3_8B();
  }
  b.change(d);
  const std::optional<FieldViolation> v = TransformerDimsViolation(d);
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->field, b.field);
  EXPECT_THAT(v->description, HasSubstr(b.says));
  absl::StatusOr<plan::ModelSpec> spec = TransformerSpec(d);
  EXPECT_TRUE(absl::IsInvalidArgument(spec.status()));
  EXPECT_THAT(spec.status().message(), HasSubstr(b.field));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BadDimsTest,
    ::testing::Values(
        Bad{"NoVocab", [](TransformerDims& d) { d.vocab_size = 0; }, "vocab_size", "not in [1"},
        Bad{"HugeSeq", [](TransformerDims& d) { d.seq_len = int64_t{1} << 20; }, "seq_len",
            "not in"},
        Bad{"NoLayers", [](TransformerDims& d) { d.n_layer = 0; }, "n_layer", "not in"},
        Bad{"KvHeadsDoNotDivide", [](TransformerDims& d) { d.n_kv_head = 5; }, "n_kv_head",
            "does not divide n_head 32"},
        Bad{"MoreKvHeadsThanHeads", [](TransformerDims& d) { d.n_kv_head = 64; }, "n_kv_head",
            "not in [1, 32]"},
        Bad{"OddHeadDim", [](TransformerDims& d) { d.head_dim = 127; }, "head_dim", "odd"},
        Bad{"NoFfn", [](TransformerDims& d) { d.ffn_hidden = 0; }, "ffn_hidden", "not in"},
        Bad{"ZeroEps", [](TransformerDims& d) { d.norm_eps = 0; }, "norm_eps", "> 0"},
        Bad{"NegativeTheta", [](TransformerDims& d) { d.rope_theta = -1; }, "rope_theta", "> 0"},
        Bad{"OddRope", [](TransformerDims& d) { d.mla.qk_rope_head_dim = 63; },
            "mla.qk_rope_head_dim", "odd"},
        Bad{"NoKvRank", [](TransformerDims& d) { d.mla.kv_lora_rank = 0; }, "mla.kv_lora_rank",
            "not in [1"},
        Bad{"TopKAboveExperts", [](TransformerDims& d) { d.moe->top_k = 300; }, "moe.top_k",
            "not in [1, 256]"},
        Bad{"NoExpertWidth", [](TransformerDims& d) { d.moe->moe_ffn_hidden = 0; },
            "moe.moe_ffn_hidden", "not in [1"},
        Bad{"DenseBeyondTheLayers", [](TransformerDims& d) { d.moe->first_k_dense = 62; },
            "moe.first_k_dense", "not in [0, 61]"},
        Bad{"NegativeBiasRate", [](TransformerDims& d) { d.moe->bias_update_rate = -0.1; },
            "moe.bias_update_rate", ">= 0"},
        Bad{"ZeroRouteScale", [](TransformerDims& d) { d.moe->route_scale = 0; },
            "moe.route_scale", "> 0"}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace muonmesh::model
