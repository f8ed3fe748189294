#include "core/model/transformer_spec.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace muonmesh::model {
namespace {

std::optional<FieldViolation> Count(const char* field, int64_t value, int64_t min, int64_t limit) {
  if (value < min || value > limit) {
    return FieldViolation{field, absl::StrCat(value, " is not in [", min, ", ", limit, "]")};
  }
  return std::nullopt;
}

std::optional<FieldViolation> Positive(const char* field, double value) {
  if (!(std::isfinite(value) && value > 0)) {
    return FieldViolation{field, absl::StrCat("must be > 0, got ", value)};
  }
  return std::nullopt;
}

std::optional<FieldViolation> Even(const char* field, int64_t value) {
  if (value % 2 != 0) {
    return FieldViolation{field, absl::StrCat(value, " is odd: RoPE rotates pairs of dimensions")};
  }
  return std::nullopt;
}

std::optional<FieldViolation> AttentionViolation(const TransformerDims& d) {
  if (d.attention == Attention::kMha) {
    for (auto v : {Count("n_kv_head", d.n_kv_head, 1, d.n_head),
                   Count("head_dim", d.head_dim, 1, kTransformerMaxWidth / d.n_head),
                   Even("head_dim", d.head_dim)}) {
      if (v) return v;
    }
    if (d.n_head % d.n_kv_head != 0) {
      return FieldViolation{"n_kv_head", absl::StrCat(d.n_kv_head, " does not divide n_head ",
                                                      d.n_head, " (each kv head serves ",
                                                      "n_head / n_kv_head query heads)")};
    }
    return std::nullopt;
  }
  const MlaDims& m = d.mla;
  const int64_t per_head = kTransformerMaxWidth / d.n_head;
  for (auto v : {Count("mla.q_lora_rank", m.q_lora_rank, 0, kTransformerMaxWidth),
                 Count("mla.kv_lora_rank", m.kv_lora_rank, 1, kTransformerMaxWidth),
                 Count("mla.qk_nope_head_dim", m.qk_nope_head_dim, 1, per_head),
                 Count("mla.qk_rope_head_dim", m.qk_rope_head_dim, 2, per_head),
                 Even("mla.qk_rope_head_dim", m.qk_rope_head_dim),
                 Count("mla.v_head_dim", m.v_head_dim, 1, per_head)}) {
    if (v) return v;
  }
  if (m.qk_nope_head_dim + m.qk_rope_head_dim > per_head) {
    return FieldViolation{"mla.qk_nope_head_dim",
                          absl::StrCat("n_head x (qk_nope_head_dim + qk_rope_head_dim) exceeds ",
                                       kTransformerMaxWidth)};
  }
  return std::nullopt;
}

std::optional<FieldViolation> MoeViolation(const TransformerDims& d) {
  if (!d.moe.has_value()) return std::nullopt;
  const MoeDims& m = *d.moe;
  for (auto v : {Count("moe.n_routed_experts", m.n_routed_experts, 1, kTransformerMaxExperts),
                 Count("moe.moe_ffn_hidden", m.moe_ffn_hidden, 1, kTransformerMaxWidth)}) {
    if (v) return v;
  }
  for (auto v : {Count("moe.top_k", m.top_k, 1, m.n_routed_experts),
                 Count("moe.n_shared_experts", m.n_shared_experts, 0,
                       kTransformerMaxWidth / m.moe_ffn_hidden),
                 Count("moe.first_k_dense", m.first_k_dense, 0, d.n_layer),
                 Positive("moe.route_scale", m.route_scale)}) {
    if (v) return v;
  }
  for (auto [field, value] : {std::pair{"moe.bias_update_rate", m.bias_update_rate},
                              std::pair{"moe.aux_loss_coef", m.aux_loss_coef}}) {
    if (!(std::isfinite(value) && value >= 0)) {
      return FieldViolation{field, absl::StrCat("must be >= 0, got ", value)};
    }
  }
  return std::nullopt;
}

plan::ParamSpec Param(std::string name, std::vector<int64_t> shape, const char* optimizer,
                      bool expert = false) {
  return plan::ParamSpec{std::move(name), std::move(shape), optimizer, expert};
}

void AddAttention(const TransformerDims& d, const std::string& p,
                  std::vector<plan::ParamSpec>& out) {
  const int64_t c = d.d_model;
  const int64_t h = d.n_head;
  if (d.attention == Attention::kMha) {
    out.push_back(Param(p + "attn.q_proj.weight", {h * d.head_dim, c}, "muon"));
    out.push_back(Param(p + "attn.k_proj.weight", {d.n_kv_head * d.head_dim, c}, "muon"));
    out.push_back(Param(p + "attn.v_proj.weight", {d.n_kv_head * d.head_dim, c}, "muon"));
    out.push_back(Param(p + "attn.o_proj.weight", {c, h * d.head_dim}, "muon"));
    return;
  }
  const MlaDims& m = d.mla;
  const int64_t qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
  if (m.q_lora_rank > 0) {
    out.push_back(Param(p + "attn.q_a_proj.weight", {m.q_lora_rank, c}, "muon"));
    out.push_back(Param(p + "attn.q_a_norm.weight", {m.q_lora_rank}, "adamw"));
    out.push_back(Param(p + "attn.q_b_proj.weight", {h * qk, m.q_lora_rank}, "muon"));
  } else {
    out.push_back(Param(p + "attn.q_proj.weight", {h * qk, c}, "muon"));
  }
  out.push_back(
      Param(p + "attn.kv_a_proj.weight", {m.kv_lora_rank + m.qk_rope_head_dim, c}, "muon"));
  out.push_back(Param(p + "attn.kv_a_norm.weight", {m.kv_lora_rank}, "adamw"));
  out.push_back(Param(p + "attn.kv_b_proj.weight",
                      {h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank}, "muon"));
  out.push_back(Param(p + "attn.o_proj.weight", {c, h * m.v_head_dim}, "muon"));
}

// A SwiGLU of width f under `prefix` ("mlp.", "mlp.shared.").
void AddSwiGlu(const std::string& prefix, int64_t c, int64_t f,
               std::vector<plan::ParamSpec>& out) {
  out.push_back(Param(prefix + "gate_proj.weight", {f, c}, "muon"));
  out.push_back(Param(prefix + "up_proj.weight", {f, c}, "muon"));
  out.push_back(Param(prefix + "down_proj.weight", {c, f}, "muon"));
}

plan::UnitSpec Layer(const TransformerDims& d, int64_t l) {
  const std::string p = absl::StrCat("layers.", l, ".");
  const int64_t c = d.d_model;
  plan::UnitSpec unit;
  unit.name = absl::StrCat("layers.", l);
  unit.params.push_back(Param(p + "attn_norm.weight", {c}, "adamw"));
  AddAttention(d, p, unit.params);
  unit.params.push_back(Param(p + "mlp_norm.weight", {c}, "adamw"));
  if (!IsMoeLayer(d, l)) {
    AddSwiGlu(p + "mlp.", c, d.ffn_hidden, unit.params);
  } else {
    const MoeDims& m = *d.moe;
    const int64_t e = m.n_routed_experts;
    const int64_t fe = m.moe_ffn_hidden;
    unit.params.push_back(Param(p + "mlp.router.weight", {e, c}, "adamw"));
    unit.params.push_back(Param(p + "mlp.experts.gate_proj", {e, fe, c}, "muon", true));
    unit.params.push_back(Param(p + "mlp.experts.up_proj", {e, fe, c}, "muon", true));
    unit.params.push_back(Param(p + "mlp.experts.down_proj", {e, c, fe}, "muon", true));
    if (m.n_shared_experts > 0) AddSwiGlu(p + "mlp.shared.", c, m.n_shared_experts * fe, unit.params);
  }
  unit.gathers_per_step = 2;  // forward, then again for the backward pass
  return unit;
}

}  // namespace

std::optional<FieldViolation> TransformerDimsViolation(const TransformerDims& d) {
  for (auto v : {Count("vocab_size", d.vocab_size, 1, kTransformerMaxVocab),
                 Count("seq_len", d.seq_len, 1, kTransformerMaxSeqLen),
                 Count("n_layer", d.n_layer, 1, kTransformerMaxLayers),
                 Count("d_model", d.d_model, 1, kTransformerMaxWidth),
                 Count("n_head", d.n_head, 1, kTransformerMaxHeads),
                 Positive("norm_eps", d.norm_eps), Positive("rope_theta", d.rope_theta)}) {
    if (v) return v;
  }
  if (std::optional<FieldViolation> v = AttentionViolation(d)) return v;
  const bool dense = !d.moe.has_value() || d.moe->first_k_dense > 0;
  if (dense) {
    if (auto v = Count("ffn_hidden", d.ffn_hidden, 1, kTransformerMaxWidth)) return v;
  }
  return MoeViolation(d);
}

absl::StatusOr<plan::ModelSpec> TransformerSpec(const TransformerDims& d) {
  if (std::optional<FieldViolation> v = TransformerDimsViolation(d)) {
    return absl::InvalidArgumentError(absl::StrCat(v->field, ": ", v->description));
  }
  plan::ModelSpec spec;
  spec.name = "transformer";
  plan::UnitSpec embed;
  embed.name = "embed";
  embed.params = {Param("embed.weight", {d.vocab_size, d.d_model}, "adamw")};
  embed.gathers_per_step = d.tie_embeddings ? 2 : 1;  // tied: the lookup, then the logits
  spec.units.push_back(std::move(embed));
  for (int64_t l = 0; l < d.n_layer; ++l) spec.units.push_back(Layer(d, l));
  plan::UnitSpec head;
  head.name = "head";
  head.params = {Param("final_norm.weight", {d.d_model}, "adamw")};
  if (!d.tie_embeddings) {
    head.params.push_back(Param("lm_head.weight", {d.vocab_size, d.d_model}, "adamw"));
  }
  head.gathers_per_step = 1;
  spec.units.push_back(std::move(head));
  return spec;
}

}  // namespace muonmesh::model
