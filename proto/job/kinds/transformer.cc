// model: {transformer: {...}}: a Llama-style or DeepSeek-style (MLA,
// routed and shared experts) pre-norm decoder on a token corpus
// (worker/model/transformer.h; core/model/transformer_spec.h).

#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/model/transformer_spec.h"
#include "proto/job/kinds/kinds.h"

namespace muonmesh::job::kinds {
namespace {

constexpr double kDefaultNormEps = 1e-5;
constexpr double kDefaultRopeTheta = 10000.0;

// The section's dims with every default filled in (n_kv_head: n_head,
// head_dim: d_model / n_head, norm_eps, rope_theta, the MoE's defaults).
model::TransformerDims DimsOf(const v1::TransformerModel& t) {
  model::TransformerDims d;
  d.vocab_size = t.vocab_size();
  d.seq_len = t.seq_len();
  d.n_layer = t.n_layer();
  d.d_model = t.d_model();
  d.n_head = t.n_head();
  d.n_kv_head = t.n_kv_head() > 0 ? t.n_kv_head() : t.n_head();
  d.head_dim = t.head_dim() > 0 ? t.head_dim() : (t.n_head() > 0 ? t.d_model() / t.n_head() : 0);
  d.ffn_hidden = t.ffn_hidden();
  d.norm_eps = t.has_norm_eps() ? t.norm_eps() : kDefaultNormEps;
  d.rope_theta = t.has_rope_theta() ? t.rope_theta() : kDefaultRopeTheta;
  d.tie_embeddings = t.tie_embeddings();
  d.attention = t.attention() == "mla" ? model::Attention::kMla : model::Attention::kMha;
  const v1::TransformerMla& m = t.mla();
  d.mla = {m.q_lora_rank(), m.kv_lora_rank(), m.qk_nope_head_dim(), m.qk_rope_head_dim(),
           m.v_head_dim()};
  if (t.has_moe()) {
    const v1::TransformerMoe& e = t.moe();
    model::MoeDims moe;
    moe.n_routed_experts = e.n_routed_experts();
    moe.top_k = e.top_k();
    moe.moe_ffn_hidden = e.moe_ffn_hidden();
    moe.n_shared_experts = e.n_shared_experts();
    moe.first_k_dense = e.first_k_dense();
    moe.score = e.score() == "sigmoid" ? model::RouterScore::kSigmoid : model::RouterScore::kSoftmax;
    moe.norm_topk_prob = e.has_norm_topk_prob() ? e.norm_topk_prob() : true;
    if (e.has_route_scale()) moe.route_scale = e.route_scale();
    if (e.has_bias_update_rate()) moe.bias_update_rate = e.bias_update_rate();
    moe.aux_loss_coef = e.aux_loss_coef();
    d.moe = moe;
  }
  return d;
}

// The required fields, the names of the strings, then the rules between the
// sizes (model::TransformerDimsViolation), what this build trains, and what
// text data asks of the vocabulary.
void Validate(const v1::JobSpec& job, plan::Violations& v) {
  const v1::TransformerModel& t = job.model().transformer();
  const std::pair<const char*, int64_t> required[] = {
      {"vocab_size", t.vocab_size()}, {"seq_len", t.seq_len()}, {"n_layer", t.n_layer()},
      {"d_model", t.d_model()},       {"n_head", t.n_head()}};
  bool given = true;
  for (const auto& [name, value] : required) {
    if (value < 1) {
      v.Add(absl::StrCat("model.transformer.", name),
            value == 0 ? std::string("required: must be >= 1")
                       : absl::StrCat("must be >= 1, got ", value));
      given = false;
    }
  }
  if (!t.attention().empty() && t.attention() != "mha" && t.attention() != "mla") {
    v.Add("model.transformer.attention",
          absl::StrCat("unknown attention '", t.attention(), "' (expected mha or mla)"));
    given = false;
  }
  if (t.has_moe() && !t.moe().score().empty() && t.moe().score() != "softmax" &&
      t.moe().score() != "sigmoid") {
    v.Add("model.transformer.moe.score",
          absl::StrCat("unknown score '", t.moe().score(), "' (expected softmax or sigmoid)"));
    given = false;
  }
  if (given) {
    if (std::optional<FieldViolation> f = model::TransformerDimsViolation(DimsOf(t))) {
      v.Add(absl::StrCat("model.transformer.", f->field), f->description);
    }
  }
  if (job.device() == "cuda") {
    v.Add("model.transformer", "not on device cuda yet: the transformer has no GPU form");
  }
  if (job.data().source_case() == v1::DataConfig::kText && t.vocab_size() >= 1 &&
      t.vocab_size() < 256) {
    v.Add("model.transformer.vocab_size",
          absl::StrCat(t.vocab_size(), " is too small for text data, whose tokens are bytes "
                                       "(0..255): at least 256"));
  }
}

ModelForm Resolve(const v1::ModelConfig& model, const std::string& /*job_dir*/) {
  return TransformerModel{DimsOf(model.transformer())};
}

absl::StatusOr<plan::ModelSpec> Spec(const ModelForm& form, int64_t /*ep*/) {
  return model::TransformerSpec(std::get<TransformerModel>(form).dims);
}

// q, k and v are separate already: split_qkv changes nothing on mha;
// per_head cuts q_proj per head and k_proj, v_proj per kv head (head_dim
// rows each). MLA: split_qkv makes kv_b_proj two matrices, every head's
// k_nope rows stacked and every head's v rows stacked; per_head cuts
// q_b_proj (or q_proj) into [dn + dr] blocks per head and kv_b_proj into
// [dn] and [dv] blocks per head in turn; q_a_proj, kv_a_proj and o_proj
// stay whole.
void AttentionBlocks(const ModelForm& form, bool split_qkv, bool per_head,
                     plan::ModelSpec* spec) {
  const model::TransformerDims& d = std::get<TransformerModel>(form).dims;
  const bool mla = d.attention == model::Attention::kMla;
  if (mla && split_qkv && !per_head) {
    for (plan::UnitSpec& unit : spec->units) {
      for (plan::ParamSpec& p : unit.params) {
        if (!absl::EndsWith(p.name, ".attn.kv_b_proj.weight")) continue;
        p.muon_block_rows = d.mla.qk_nope_head_dim;
        p.muon_block_rows_next = d.mla.v_head_dim;
        p.muon_stack_blocks = true;
      }
    }
    return;
  }
  if (!per_head) return;
  const int64_t dn = d.mla.qk_nope_head_dim;
  for (plan::UnitSpec& unit : spec->units) {
    for (plan::ParamSpec& p : unit.params) {
      const bool q = absl::EndsWith(p.name, ".attn.q_proj.weight") ||
                     absl::EndsWith(p.name, ".attn.q_b_proj.weight");
      if (!mla && (q || absl::EndsWith(p.name, ".attn.k_proj.weight") ||
                   absl::EndsWith(p.name, ".attn.v_proj.weight"))) {
        p.muon_block_rows = d.head_dim;
      } else if (mla && q) {
        p.muon_block_rows = dn + d.mla.qk_rope_head_dim;
      } else if (mla && absl::EndsWith(p.name, ".attn.kv_b_proj.weight")) {
        p.muon_block_rows = dn;
        p.muon_block_rows_next = d.mla.v_head_dim;
      }
    }
  }
}

// The Hugging Face form of a dense Llama-style model (LlamaForCausalLM,
// models/llama in transformers): their tensor names and config.json. Both
// use rotate-half RoPE, [out, in] weights and RMSNorm with the weight
// after the normalization, so the tensors go over unchanged.
absl::StatusOr<HfExport> HfExportOf(const ModelForm& form) {
  const model::TransformerDims& d = std::get<TransformerModel>(form).dims;
  if (d.attention != model::Attention::kMha || d.moe.has_value()) {
    return absl::InvalidArgumentError(
        "hf writes a dense Llama-style transformer (attention: mha, no moe): LlamaForCausalLM "
        "has no MLA or experts");
  }
  HfExport out;
  out.names["embed.weight"] = "model.embed_tokens.weight";
  for (int64_t l = 0; l < d.n_layer; ++l) {
    const std::string ours = absl::StrCat("layers.", l, ".");
    const std::string theirs = absl::StrCat("model.layers.", l, ".");
    const std::pair<const char*, const char*> per_layer[] = {
        {"attn_norm.weight", "input_layernorm.weight"},
        {"attn.q_proj.weight", "self_attn.q_proj.weight"},
        {"attn.k_proj.weight", "self_attn.k_proj.weight"},
        {"attn.v_proj.weight", "self_attn.v_proj.weight"},
        {"attn.o_proj.weight", "self_attn.o_proj.weight"},
        {"mlp_norm.weight", "post_attention_layernorm.weight"},
        {"mlp.gate_proj.weight", "mlp.gate_proj.weight"},
        {"mlp.up_proj.weight", "mlp.up_proj.weight"},
        {"mlp.down_proj.weight", "mlp.down_proj.weight"}};
    for (const auto& [a, b] : per_layer) out.names[ours + a] = theirs + b;
  }
  out.names["final_norm.weight"] = "model.norm.weight";
  if (!d.tie_embeddings) out.names["lm_head.weight"] = "lm_head.weight";
  out.config_json = absl::StrCat(
      "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"model_type\": \"llama\",\n",
      "  \"vocab_size\": ", d.vocab_size, ",\n  \"hidden_size\": ", d.d_model,
      ",\n  \"intermediate_size\": ", d.ffn_hidden, ",\n  \"num_hidden_layers\": ", d.n_layer,
      ",\n  \"num_attention_heads\": ", d.n_head, ",\n  \"num_key_value_heads\": ", d.n_kv_head,
      ",\n  \"head_dim\": ", d.head_dim, ",\n  \"max_position_embeddings\": ", d.seq_len,
      ",\n  \"rms_norm_eps\": ", absl::StrFormat("%.17g", d.norm_eps),
      ",\n  \"rope_theta\": ", absl::StrFormat("%.17g", d.rope_theta),
      ",\n  \"rope_scaling\": null,\n  \"hidden_act\": \"silu\",\n",
      "  \"attention_bias\": false,\n  \"mlp_bias\": false,\n  \"tie_word_embeddings\": ",
      d.tie_embeddings ? "true" : "false", ",\n  \"initializer_range\": 0.02,\n",
      "  \"torch_dtype\": \"float32\"\n}\n");
  return out;
}

}  // namespace

const ModelKind kTransformer = {
    .name = "transformer",
    .proto_case = v1::ModelConfig::kTransformer,
    .data = DataUse::kCorpus,
    .size_field = "model.transformer",
    .validate = &Validate,
    .resolve = &Resolve,
    .spec = &Spec,
    .attention_blocks = &AttentionBlocks,
    .vocab_size =
        [](const ModelForm& form) { return std::get<TransformerModel>(form).dims.vocab_size; },
    .hf_export = &HfExportOf,
};

}  // namespace muonmesh::job::kinds
