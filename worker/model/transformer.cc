#include "worker/model/transformer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/plan/validate.h"
#include "worker/math/elementwise.h"
#include "worker/model/checks.h"
#include "worker/model/gpt.h"
#include "worker/model/gpt_passes.h"
#include "worker/model/host_ops.h"

namespace muonmesh::worker {
namespace {

using internal::AnyNull;

constexpr int kEmbedUnit = 0;
constexpr double kInitStd = 0.02;

// A parameter's initial standard deviation (0: a norm, set to 1).
double InitStd(const plan::ParamSpec& p, int64_t layers) {
  if (p.shape.size() == 1) return 0.0;
  if (absl::EndsWith(p.name, "o_proj.weight") || absl::StrContains(p.name, "down_proj")) {
    return kInitStd / std::sqrt(2.0 * static_cast<double>(layers));
  }
  return kInitStd;
}

// Row r of x [rows, stride] from column `from`, `width` values, to y [rows,
// width] (or back when `into_x`).
void CopyColumns(int64_t rows, int64_t stride, int64_t from, int64_t width, float* x, float* y,
                 bool into_x) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * stride + from;
    float* yr = y + r * width;
    if (into_x) {
      std::copy(yr, yr + width, xr);
    } else {
      std::copy(xr, xr + width, yr);
    }
  }
}

}  // namespace

Transformer::Transformer(model::TransformerDims dims, std::shared_ptr<const TokenStream> train,
                         plan::ModelSpec spec)
    : dims_(dims),
      train_(std::move(train)),
      spec_(std::move(spec)),
      num_samples_(WindowPeriod(train_->num_tokens(), dims.seq_len)),
      logit_max_(static_cast<size_t>(dims.n_layer * dims.n_head),
                 -std::numeric_limits<float>::infinity()),
      layers_(static_cast<size_t>(dims.n_layer)),
      datt_(static_cast<size_t>(dims.seq_len * dims.seq_len)),
      acc_(static_cast<size_t>(
          std::max({dims.d_model, dims.mla.q_lora_rank, dims.mla.kv_lora_rank}))) {
  const bool mla = dims.attention == model::Attention::kMla;
  qk_ = mla ? dims.mla.qk_nope_head_dim + dims.mla.qk_rope_head_dim : dims.head_dim;
  vd_ = mla ? dims.mla.v_head_dim : dims.head_dim;
  kvh_ = mla ? dims.n_head : dims.n_kv_head;
  rope_ = mla ? dims.mla.qk_rope_head_dim : dims.head_dim;
  MapSlots();
  const int64_t half = rope_ / 2;
  cos_.resize(static_cast<size_t>(dims.seq_len * half));
  sin_.resize(cos_.size());
  for (int64_t t = 0; t < dims.seq_len; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(t) *
                           std::pow(dims.rope_theta, -2.0 * static_cast<double>(i) /
                                                         static_cast<double>(rope_));
      cos_[t * half + i] = static_cast<float>(std::cos(angle));
      sin_[t * half + i] = static_cast<float>(std::sin(angle));
    }
  }
}

void Transformer::MapSlots() {
  static constexpr std::pair<const char*, int Slots::*> kNames[] = {
      {"attn_norm.weight", &Slots::attn_norm},
      {"attn.q_proj.weight", &Slots::q},
      {"attn.q_a_proj.weight", &Slots::q_a},
      {"attn.q_a_norm.weight", &Slots::q_a_norm},
      {"attn.q_b_proj.weight", &Slots::q_b},
      {"attn.k_proj.weight", &Slots::k},
      {"attn.v_proj.weight", &Slots::v},
      {"attn.kv_a_proj.weight", &Slots::kv_a},
      {"attn.kv_a_norm.weight", &Slots::kv_a_norm},
      {"attn.kv_b_proj.weight", &Slots::kv_b},
      {"attn.o_proj.weight", &Slots::o},
      {"mlp_norm.weight", &Slots::mlp_norm},
      {"mlp.gate_proj.weight", &Slots::gate},
      {"mlp.up_proj.weight", &Slots::up},
      {"mlp.down_proj.weight", &Slots::down},
      {"mlp.router.weight", &Slots::router},
      {"mlp.experts.gate_proj", &Slots::ex_gate},
      {"mlp.experts.up_proj", &Slots::ex_up},
      {"mlp.experts.down_proj", &Slots::ex_down},
      {"mlp.shared.gate_proj.weight", &Slots::sh_gate},
      {"mlp.shared.up_proj.weight", &Slots::sh_up},
      {"mlp.shared.down_proj.weight", &Slots::sh_down},
  };
  slots_.assign(static_cast<size_t>(dims_.n_layer), Slots{});
  moe_.resize(static_cast<size_t>(dims_.n_layer));
  for (int64_t l = 0; l < dims_.n_layer; ++l) {
    if (model::IsMoeLayer(dims_, l)) moe_[l].emplace(dims_);
  }
  int first = static_cast<int>(spec_.units[kEmbedUnit].params.size());
  for (int64_t l = 0; l < dims_.n_layer; ++l) {
    const std::vector<plan::ParamSpec>& params = spec_.units[l + 1].params;
    Slots& s = slots_[l];
    s.first = first;
    s.count = static_cast<int>(params.size());
    first += s.count;
    const std::string prefix = absl::StrCat("layers.", l, ".");
    for (int j = 0; j < s.count; ++j) {
      for (const auto& [name, slot] : kNames) {
        if (params[j].name == absl::StrCat(prefix, name)) s.*slot = j;
      }
    }
  }
}

absl::StatusOr<Transformer> Transformer::Create(model::TransformerDims dims,
                                                std::shared_ptr<const TokenStream> train) {
  MUONMESH_ASSIGN_OR_RETURN(plan::ModelSpec spec, model::TransformerSpec(dims));
  MUONMESH_RETURN_IF_ERROR(CheckTrainingStream(train.get(), dims.seq_len));
  return Transformer(dims, std::move(train), std::move(spec));
}

absl::Status Transformer::Initialize(uint64_t seed, absl::Span<float* const> params) const {
  size_t count = 0;
  for (const plan::UnitSpec& u : spec_.units) count += u.params.size();
  if (params.size() != count || AnyNull(params)) {
    return absl::InvalidArgumentError(absl::StrCat("transformer init: got ", params.size(),
                                                   " tensors, the model has ", count));
  }
  size_t first = 0;
  for (size_t u = 0; u < spec_.units.size(); ++u) {
    const size_t n = spec_.units[u].params.size();
    MUONMESH_RETURN_IF_ERROR(InitializeUnit(seed, static_cast<int>(u), params.subspan(first, n)));
    first += n;
  }
  return absl::OkStatus();
}

absl::Status Transformer::InitializeUnit(uint64_t seed, int unit,
                                         absl::Span<float* const> params) const {
  const int units = static_cast<int>(spec_.units.size());
  if (unit < 0 || unit >= units) {
    return absl::InvalidArgumentError(
        absl::StrCat("transformer init: unit ", unit, " is outside [0, ", units, ")"));
  }
  const std::vector<plan::ParamSpec>& specs = spec_.units[unit].params;
  MUONMESH_RETURN_IF_ERROR(
      internal::CheckUnitTensors("transformer", params, specs.size(), "init", unit));
  size_t first = 0;  // the unit's first flat index: its parameters' streams
  for (int u = 0; u < unit; ++u) first += spec_.units[u].params.size();
  for (size_t j = 0; j < specs.size(); ++j) {
    const int64_t count = plan::NumElements(specs[j]);
    const double sigma = InitStd(specs[j], dims_.n_layer);
    if (sigma == 0.0) {
      std::fill(params[j], params[j] + count, 1.0f);
      continue;
    }
    const uint64_t stream = static_cast<uint64_t>(first) + j;
    for (int64_t e = 0; e < count; ++e) {
      params[j][e] =
          static_cast<float>(sigma * GptStandardNormal(seed, stream, static_cast<uint64_t>(e)));
    }
  }
  return absl::OkStatus();
}

void Transformer::Reserve(int64_t n) {
  if (n <= capacity_) return;
  const auto rows = static_cast<size_t>(n * dims_.seq_len);
  const auto c = static_cast<size_t>(dims_.d_model);
  const auto qw = static_cast<size_t>(dims_.n_head * qk_);
  const auto kw = static_cast<size_t>(kvh_ * qk_);
  const auto vw = static_cast<size_t>(kvh_ * vd_);
  const auto aw = static_cast<size_t>(dims_.n_head * vd_);
  const auto f = static_cast<size_t>(dims_.ffn_hidden);
  const auto t = static_cast<size_t>(dims_.seq_len);
  const bool mla = dims_.attention == model::Attention::kMla;
  const auto rq = static_cast<size_t>(mla ? dims_.mla.q_lora_rank : 0);
  const auto rkv = static_cast<size_t>(mla ? dims_.mla.kv_lora_rank : 0);
  const auto dr = static_cast<size_t>(mla ? dims_.mla.qk_rope_head_dim : 0);
  const auto kvb = static_cast<size_t>(
      mla ? dims_.n_head * (dims_.mla.qk_nope_head_dim + dims_.mla.v_head_dim) : 0);
  for (size_t l = 0; l < layers_.size(); ++l) {
    LayerActs& a = layers_[l];
    for (std::vector<float>* v : {&a.x, &a.n1, &a.h, &a.n2}) v->resize(rows * c);
    for (std::vector<float>* v : {&a.r1, &a.r2}) v->resize(rows);
    a.q.resize(rows * qw);
    a.k.resize(rows * kw);
    a.v.resize(rows * vw);
    a.a.resize(rows * aw);
    a.att.resize(static_cast<size_t>(n) * static_cast<size_t>(dims_.n_head) * t * t);
    // A MoE layer keeps its MLP's activations in its MoeLayer.
    for (std::vector<float>* v : {&a.gate, &a.up, &a.m}) v->resize(moe_[l].has_value() ? 0 : rows * f);
    for (std::vector<float>* v : {&a.qa, &a.qn}) v->resize(rows * rq);
    for (std::vector<float>* v : {&a.ckv, &a.cn}) v->resize(rows * rkv);
    a.rqa.resize(rq > 0 ? rows : 0);
    a.rckv.resize(mla ? rows : 0);
  }
  for (std::vector<float>* v : {&x_out_, &nf_, &dx_, &dn_}) v->resize(rows * c);
  rf_.resize(rows);
  logits_.resize(rows * static_cast<size_t>(dims_.vocab_size));
  tokens_.resize(static_cast<size_t>(n) * (t + 1));
  da_.resize(rows * aw);
  dq_.resize(rows * qw);
  dk_.resize(rows * kw);
  dv_.resize(rows * vw);
  for (std::vector<float>* v : {&dgate_, &dup_}) v->resize(rows * f);
  for (std::vector<float>* v : {&kva_}) v->resize(rows * (rkv + dr));
  kvb_.resize(rows * kvb);
  pe_.resize(rows * dr);
  for (std::vector<float>* v : {&dc_, &dckv_}) v->resize(rows * rkv);
  for (std::vector<float>* v : {&dqn_, &dqa_}) v->resize(rows * rq);
  exp_.resize(static_cast<size_t>(std::max(dims_.vocab_size, dims_.seq_len)));
  capacity_ = n;
}

void Transformer::Rope(float* x, int64_t rows, int64_t row_stride, int64_t heads,
                       int64_t head_stride, float sign) const {
  const int64_t half = rope_ / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r % dims_.seq_len;
    const float* c = cos_.data() + t * half;
    const float* s = sin_.data() + t * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + r * row_stride + h * head_stride;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i];
        const float b = v[i + half];
        const float sn = sign * s[i];
        v[i] = a * c[i] - b * sn;
        v[i + half] = b * c[i] + a * sn;
      }
    }
  }
}

void Transformer::Project(const Slots& s, LayerActs& a, int64_t rows,
                          absl::Span<const float* const> p) {
  if (dims_.attention == model::Attention::kMla) return MlaProject(s, a, rows, p);
  const int64_t c = dims_.d_model;
  const int64_t qw = dims_.n_head * qk_;
  const int64_t kw = kvh_ * qk_;
  LinearNoBias(rows, c, qw, a.n1.data(), p[s.q], a.q.data());
  LinearNoBias(rows, c, kw, a.n1.data(), p[s.k], a.k.data());
  LinearNoBias(rows, c, kw, a.n1.data(), p[s.v], a.v.data());
  Rope(a.q.data(), rows, qw, dims_.n_head, qk_, 1.0f);
  Rope(a.k.data(), rows, kw, kvh_, qk_, 1.0f);
}

Transformer::MlaShape Transformer::MlaSizes() const {
  const model::MlaDims& m = dims_.mla;
  return {dims_.d_model, dims_.n_head, dims_.n_head * qk_, m.qk_nope_head_dim,
          m.qk_rope_head_dim, m.kv_lora_rank,
          dims_.n_head * (m.qk_nope_head_dim + vd_)};
}

void Transformer::MlaProject(const Slots& s, LayerActs& a, int64_t rows,
                             absl::Span<const float* const> p) {
  const model::MlaDims& m = dims_.mla;
  const auto [c, h_n, qw, dn, dr, rkv, kvb] = MlaSizes();
  if (m.q_lora_rank > 0) {
    const int64_t rq = m.q_lora_rank;
    LinearNoBias(rows, c, rq, a.n1.data(), p[s.q_a], a.qa.data());
    RmsNormRows(rows, rq, a.qa.data(), p[s.q_a_norm], dims_.norm_eps, a.qn.data(), a.rqa.data());
    LinearNoBias(rows, rq, qw, a.qn.data(), p[s.q_b], a.q.data());
  } else {
    LinearNoBias(rows, c, qw, a.n1.data(), p[s.q], a.q.data());
  }
  LinearNoBias(rows, c, rkv + dr, a.n1.data(), p[s.kv_a], kva_.data());
  CopyColumns(rows, rkv + dr, 0, rkv, kva_.data(), a.ckv.data(), false);
  CopyColumns(rows, rkv + dr, rkv, dr, kva_.data(), pe_.data(), false);
  RmsNormRows(rows, rkv, a.ckv.data(), p[s.kv_a_norm], dims_.norm_eps, a.cn.data(), a.rckv.data());
  LinearNoBias(rows, rkv, kvb, a.cn.data(), p[s.kv_b], kvb_.data());
  Rope(a.q.data() + dn, rows, qw, h_n, qk_, 1.0f);
  Rope(pe_.data(), rows, dr, 1, dr, 1.0f);
  // Head h's key [k_nope | k_pe] and value from kv_b_proj's [k_nope | v].
  for (int64_t r = 0; r < rows; ++r) {
    const float* pe = pe_.data() + r * dr;
    for (int64_t h = 0; h < h_n; ++h) {
      const float* row = kvb_.data() + r * kvb + h * (dn + vd_);
      float* k = a.k.data() + r * qw + h * qk_;
      std::copy(row, row + dn, k);
      std::copy(pe, pe + dr, k + dn);
      std::copy(row + dn, row + dn + vd_, a.v.data() + r * h_n * vd_ + h * vd_);
    }
  }
}

void Transformer::AttentionForward(LayerActs& a, int64_t n, float* head_max) {
  const int64_t t_len = dims_.seq_len;
  const int64_t qw = dims_.n_head * qk_;
  const int64_t kw = kvh_ * qk_;
  const int64_t vw = kvh_ * vd_;
  const int64_t aw = dims_.n_head * vd_;
  const int64_t group = dims_.n_head / kvh_;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(qk_)));
  for (int64_t b = 0; b < n; ++b) {
    for (int64_t h = 0; h < dims_.n_head; ++h) {
      const int64_t kv = h / group;
      const float* q = a.q.data() + b * t_len * qw + h * qk_;
      const float* k = a.k.data() + b * t_len * kw + kv * qk_;
      const float* v = a.v.data() + b * t_len * vw + kv * vd_;
      float* att = a.att.data() + (b * dims_.n_head + h) * t_len * t_len;
      Gemm(false, true, t_len, t_len, qk_, scale, q, qw, k, kw, att, t_len);
      const float top = CausalSoftmax(t_len, att, exp_.data());
      if (head_max != nullptr) head_max[h] = std::max(head_max[h], top);
      Gemm(false, false, t_len, vd_, t_len, 1.0f, att, t_len, v, vw,
           a.a.data() + b * t_len * aw + h * vd_, aw);
    }
  }
}

absl::Status Transformer::LayerForward(UnitAccess& units, int64_t layer, int64_t n,
                                       absl::Span<const float* const> p) {
  const Slots& s = slots_[layer];
  const int64_t rows = n * dims_.seq_len;
  const int64_t c = dims_.d_model;
  const int64_t f = dims_.ffn_hidden;
  LayerActs& a = layers_[layer];
  RmsNormRows(rows, c, a.x.data(), p[s.attn_norm], dims_.norm_eps, a.n1.data(), a.r1.data());
  Project(s, a, rows, p);
  AttentionForward(a, n, record_logits_ ? logit_max_.data() + layer * dims_.n_head : nullptr);
  LinearNoBias(rows, dims_.n_head * vd_, c, a.a.data(), p[s.o], a.h.data());
  for (int64_t i = 0; i < rows * c; ++i) a.h[i] += a.x[i];
  RmsNormRows(rows, c, a.h.data(), p[s.mlp_norm], dims_.norm_eps, a.n2.data(), a.r2.data());
  float* out = layer + 1 < dims_.n_layer ? layers_[layer + 1].x.data() : x_out_.data();
  if (moe_[layer].has_value()) {
    std::copy(a.h.begin(), a.h.begin() + rows * c, out);
    MUONMESH_ASSIGN_OR_RETURN(const double aux,
                              moe_[layer]->Forward(units, exchange_, n, a.n2.data(),
                                                   MoeTensors(s, p), record_logits_, out));
    aux_ += aux;
    return absl::OkStatus();
  }
  LinearNoBias(rows, c, f, a.n2.data(), p[s.gate], a.gate.data());
  LinearNoBias(rows, c, f, a.n2.data(), p[s.up], a.up.data());
  SwiGlu(rows * f, a.gate.data(), a.up.data(), a.m.data());
  LinearNoBias(rows, f, c, a.m.data(), p[s.down], out);
  for (int64_t i = 0; i < rows * c; ++i) out[i] += a.h[i];
  return absl::OkStatus();
}

MoeWeights Transformer::MoeTensors(const Slots& s, absl::Span<const float* const> p) const {
  MoeWeights w{p[s.router], p[s.ex_gate], p[s.ex_up], p[s.ex_down]};
  if (s.sh_gate >= 0) {
    w.shared_gate = p[s.sh_gate];
    w.shared_up = p[s.sh_up];
    w.shared_down = p[s.sh_down];
  }
  return w;
}

double Transformer::Head(int64_t n, const float* final_norm, const float* head_w, bool gradients,
                         float* dfinal_norm, float* dhead_w) {
  const int64_t rows = n * dims_.seq_len;
  const int64_t c = dims_.d_model;
  const int64_t v = dims_.vocab_size;
  RmsNormRows(rows, c, x_out_.data(), final_norm, dims_.norm_eps, nf_.data(), rf_.data());
  LinearNoBias(rows, c, v, nf_.data(), head_w, logits_.data());
  const double loss = WindowCrossEntropy(n, dims_.seq_len, v, tokens_.data(), logits_.data(),
                                         exp_.data(), gradients);
  if (!gradients) return loss;
  LinearNoBiasBackward(rows, c, v, logits_.data(), nf_.data(), head_w, dhead_w, dn_.data(), false);
  std::fill(dx_.begin(), dx_.begin() + rows * c, 0.0f);
  RmsNormRowsBackward(rows, c, x_out_.data(), rf_.data(), final_norm, dn_.data(), dx_.data(), dfinal_norm,
              acc_.data());
  return loss;
}

void Transformer::AttentionBackward(const LayerActs& a, int64_t n, const float* da, float* dq,
                                    float* dk, float* dv) {
  const int64_t t_len = dims_.seq_len;
  const int64_t qw = dims_.n_head * qk_;
  const int64_t kw = kvh_ * qk_;
  const int64_t vw = kvh_ * vd_;
  const int64_t aw = dims_.n_head * vd_;
  const int64_t group = dims_.n_head / kvh_;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(qk_)));
  float* datt = datt_.data();
  for (int64_t b = 0; b < n; ++b) {
    for (int64_t h = 0; h < dims_.n_head; ++h) {
      const int64_t kv = h / group;
      const float beta = h % group == 0 ? 0.0f : 1.0f;  // the group's heads add up
      const int64_t qo = b * t_len * qw + h * qk_;
      const int64_t ko = b * t_len * kw + kv * qk_;
      const int64_t vo = b * t_len * vw + kv * vd_;
      const int64_t ao = b * t_len * aw + h * vd_;
      const float* att = a.att.data() + (b * dims_.n_head + h) * t_len * t_len;
      // dP = dY V^T; dV += P^T dY; dS = softmax'(dP); dQ = s dS K; dK += s dS^T Q.
      Gemm(false, true, t_len, t_len, vd_, 1.0f, da + ao, aw, a.v.data() + vo, vw, datt, t_len);
      Gemm(true, false, t_len, vd_, t_len, 1.0f, att, t_len, da + ao, aw, dv + vo, vw, beta);
      CausalSoftmaxBackward(t_len, att, datt);
      Gemm(false, false, t_len, qk_, t_len, scale, datt, t_len, a.k.data() + ko, kw, dq + qo, qw);
      Gemm(true, false, t_len, qk_, t_len, scale, datt, t_len, a.q.data() + qo, qw, dk + ko, kw,
           beta);
    }
  }
}

void Transformer::ProjectBackward(const Slots& s, const LayerActs& a, int64_t rows,
                                  absl::Span<const float* const> p, absl::Span<float* const> g) {
  if (dims_.attention == model::Attention::kMla) return MlaProjectBackward(s, a, rows, p, g);
  const int64_t c = dims_.d_model;
  const int64_t qw = dims_.n_head * qk_;
  const int64_t kw = kvh_ * qk_;
  Rope(dq_.data(), rows, qw, dims_.n_head, qk_, -1.0f);
  Rope(dk_.data(), rows, kw, kvh_, qk_, -1.0f);
  LinearNoBiasBackward(rows, c, qw, dq_.data(), a.n1.data(), p[s.q], g[s.q], dn_.data(), false);
  LinearNoBiasBackward(rows, c, kw, dk_.data(), a.n1.data(), p[s.k], g[s.k], dn_.data(), true);
  LinearNoBiasBackward(rows, c, kw, dv_.data(), a.n1.data(), p[s.v], g[s.v], dn_.data(), true);
}

void Transformer::MlaProjectBackward(const Slots& s, const LayerActs& a, int64_t rows,
                                     absl::Span<const float* const> p,
                                     absl::Span<float* const> g) {
  const model::MlaDims& m = dims_.mla;
  const auto [c, h_n, qw, dn, dr, rkv, kvb] = MlaSizes();
  Rope(dq_.data() + dn, rows, qw, h_n, qk_, -1.0f);
  // k_pe serves every head: its gradient is the heads' sum.
  std::fill(pe_.begin(), pe_.begin() + rows * dr, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    float* pe = pe_.data() + r * dr;
    for (int64_t h = 0; h < h_n; ++h) {
      const float* dk = dk_.data() + r * qw + h * qk_;
      float* row = kvb_.data() + r * kvb + h * (dn + vd_);
      std::copy(dk, dk + dn, row);
      for (int64_t i = 0; i < dr; ++i) pe[i] += dk[dn + i];
      const float* dv = dv_.data() + r * h_n * vd_ + h * vd_;
      std::copy(dv, dv + vd_, row + dn);
    }
  }
  Rope(pe_.data(), rows, dr, 1, dr, -1.0f);
  LinearNoBiasBackward(rows, rkv, kvb, kvb_.data(), a.cn.data(), p[s.kv_b], g[s.kv_b], dc_.data(),
                 false);
  std::fill(dckv_.begin(), dckv_.begin() + rows * rkv, 0.0f);
  RmsNormRowsBackward(rows, rkv, a.ckv.data(), a.rckv.data(), p[s.kv_a_norm], dc_.data(), dckv_.data(),
              g[s.kv_a_norm], acc_.data());
  CopyColumns(rows, rkv + dr, 0, rkv, kva_.data(), dckv_.data(), true);
  CopyColumns(rows, rkv + dr, rkv, dr, kva_.data(), pe_.data(), true);
  if (m.q_lora_rank > 0) {
    const int64_t rq = m.q_lora_rank;
    LinearNoBiasBackward(rows, rq, qw, dq_.data(), a.qn.data(), p[s.q_b], g[s.q_b], dqn_.data(), false);
    std::fill(dqa_.begin(), dqa_.begin() + rows * rq, 0.0f);
    RmsNormRowsBackward(rows, rq, a.qa.data(), a.rqa.data(), p[s.q_a_norm], dqn_.data(), dqa_.data(),
                g[s.q_a_norm], acc_.data());
    LinearNoBiasBackward(rows, c, rq, dqa_.data(), a.n1.data(), p[s.q_a], g[s.q_a], dn_.data(), false);
  } else {
    LinearNoBiasBackward(rows, c, qw, dq_.data(), a.n1.data(), p[s.q], g[s.q], dn_.data(), false);
  }
  LinearNoBiasBackward(rows, c, rkv + dr, kva_.data(), a.n1.data(), p[s.kv_a], g[s.kv_a], dn_.data(),
                 true);
}

void Transformer::DenseMlpBackward(const Slots& s, const LayerActs& a, int64_t rows,
                                   absl::Span<const float* const> p, absl::Span<float* const> g) {
  const int64_t c = dims_.d_model;
  const int64_t f = dims_.ffn_hidden;
  // x' = h + down(m): dL/dm, then through silu(gate) * up.
  LinearNoBiasBackward(rows, f, c, dx_.data(), a.m.data(), p[s.down], g[s.down], dgate_.data(),
                       false);
  SwiGluBackward(rows * f, a.gate.data(), a.up.data(), dgate_.data(), dgate_.data(), dup_.data());
  LinearNoBiasBackward(rows, c, f, dgate_.data(), a.n2.data(), p[s.gate], g[s.gate], dn_.data(),
                       false);
  LinearNoBiasBackward(rows, c, f, dup_.data(), a.n2.data(), p[s.up], g[s.up], dn_.data(), true);
}

absl::Status Transformer::LayerBackward(UnitAccess& units, int64_t layer, int64_t n,
                                        absl::Span<const float* const> p,
                                        absl::Span<float* const> g) {
  const Slots& s = slots_[layer];
  const int64_t rows = n * dims_.seq_len;
  const int64_t c = dims_.d_model;
  const LayerActs& a = layers_[layer];
  if (moe_[layer].has_value()) {
    MoeGrads mg{g[s.router], g[s.ex_gate], g[s.ex_up], g[s.ex_down]};
    if (s.sh_gate >= 0) {
      mg.shared_gate = g[s.sh_gate];
      mg.shared_up = g[s.sh_up];
      mg.shared_down = g[s.sh_down];
    }
    MUONMESH_RETURN_IF_ERROR(moe_[layer]->Backward(units, exchange_, a.n2.data(),
                                                   MoeTensors(s, p), dx_.data(),
                                                   1.0 / static_cast<double>(n), mg, dn_.data()));
  } else {
    DenseMlpBackward(s, a, rows, p, g);
  }
  RmsNormRowsBackward(rows, c, a.h.data(), a.r2.data(), p[s.mlp_norm], dn_.data(), dx_.data(),
                      g[s.mlp_norm], acc_.data());
  // h = x + o(attn): dL/da, the attention, then q, k, v back through RoPE.
  LinearNoBiasBackward(rows, dims_.n_head * vd_, c, dx_.data(), a.a.data(), p[s.o], g[s.o],
                       da_.data(), false);
  AttentionBackward(a, n, da_.data(), dq_.data(), dk_.data(), dv_.data());
  ProjectBackward(s, a, rows, p, g);
  RmsNormRowsBackward(rows, c, a.x.data(), a.r1.data(), p[s.attn_norm], dn_.data(), dx_.data(),
                      g[s.attn_norm], acc_.data());
  return absl::OkStatus();
}

absl::Status Transformer::Forward(UnitAccess& units, int64_t n) {
  const int64_t c = dims_.d_model;
  {
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> e, units.Acquire(kEmbedUnit));
    HeldUnit held(units, kEmbedUnit);
    MUONMESH_RETURN_IF_ERROR(internal::CheckUnitTensors("transformer", e, 1, "acquire", kEmbedUnit));
    float* x = layers_[0].x.data();
    for (int64_t b = 0; b < n; ++b) {
      for (int64_t t = 0; t < dims_.seq_len; ++t) {
        const float* row = e[0] + tokens_[b * (dims_.seq_len + 1) + t] * c;
        std::copy(row, row + c, x + (b * dims_.seq_len + t) * c);
      }
    }
  }
  for (int64_t l = 0; l < dims_.n_layer; ++l) {
    const int unit = static_cast<int>(l) + 1;
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> p, units.Acquire(unit));
    HeldUnit held(units, unit);
    MUONMESH_RETURN_IF_ERROR(
        internal::CheckUnitTensors("transformer", p, slots_[l].count, "acquire", unit));
    MUONMESH_RETURN_IF_ERROR(LayerForward(units, l, n, p));
  }
  return absl::OkStatus();
}

absl::Status Transformer::Backward(UnitAccess& units, int64_t n, float* dembed) {
  const int64_t c = dims_.d_model;
  for (int64_t l = dims_.n_layer - 1; l >= 0; --l) {
    const int unit = static_cast<int>(l) + 1;
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> p, units.Acquire(unit));
    HeldUnit held(units, unit);
    MUONMESH_RETURN_IF_ERROR(
        internal::CheckUnitTensors("transformer", p, slots_[l].count, "acquire", unit));
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> g, units.GradientBuffers(unit));
    MUONMESH_RETURN_IF_ERROR(
        internal::CheckUnitTensors("transformer", g, slots_[l].count, "gradients", unit));
    MUONMESH_RETURN_IF_ERROR(LayerBackward(units, l, n, p, g));
    MUONMESH_RETURN_IF_ERROR(units.Commit(unit));
  }
  // The lookup: each position's dL/dx into its token's row (untied: into
  // buffers taken only now, zeroed first).
  if (dembed == nullptr) {
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> eg, units.GradientBuffers(kEmbedUnit));
    MUONMESH_RETURN_IF_ERROR(
        internal::CheckUnitTensors("transformer", eg, 1, "gradients", kEmbedUnit));
    dembed = eg[0];
    std::fill(dembed, dembed + dims_.vocab_size * c, 0.0f);
  }
  for (int64_t b = 0; b < n; ++b) {
    for (int64_t t = 0; t < dims_.seq_len; ++t) {
      float* row = dembed + tokens_[b * (dims_.seq_len + 1) + t] * c;
      const float* d = dx_.data() + (b * dims_.seq_len + t) * c;
      for (int64_t i = 0; i < c; ++i) row[i] += d[i];
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<double> Transformer::Run(UnitAccess& units, const TokenStream& tokens,
                                        absl::Span<const int64_t> samples, bool gradients) {
  MUONMESH_RETURN_IF_ERROR(
      ReadWindows("transformer", dims_.vocab_size, dims_.seq_len, tokens, samples, tokens_));
  const int64_t n = static_cast<int64_t>(samples.size());
  Reserve(n);
  aux_ = 0.0;
  MUONMESH_RETURN_IF_ERROR(Forward(units, n));
  const int head = head_unit();
  const size_t head_params = dims_.tie_embeddings ? 1 : 2;
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> hp, units.Acquire(head));
  HeldUnit held_head(units, head);
  MUONMESH_RETURN_IF_ERROR(
      internal::CheckUnitTensors("transformer", hp, head_params, "acquire", head));
  absl::Span<const float* const> ep;
  std::optional<HeldUnit> held_embed;
  if (dims_.tie_embeddings) {
    MUONMESH_ASSIGN_OR_RETURN(ep, units.Acquire(kEmbedUnit));
    held_embed.emplace(units, kEmbedUnit);
    MUONMESH_RETURN_IF_ERROR(
        internal::CheckUnitTensors("transformer", ep, 1, "acquire", kEmbedUnit));
  }
  const float* head_w = dims_.tie_embeddings ? ep[0] : hp[1];
  const double denom = static_cast<double>(n * dims_.seq_len);
  // The balance term's mean over the windows (0 without it), part of the
  // training loss only.
  const double aux = aux_ / static_cast<double>(n);
  if (!gradients) return Head(n, hp[0], head_w, false, nullptr, nullptr) / denom;
  aux_passes_sum_ += aux;
  ++aux_passes_;
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> hg, units.GradientBuffers(head));
  MUONMESH_RETURN_IF_ERROR(
      internal::CheckUnitTensors("transformer", hg, head_params, "gradients", head));
  // Tied: the head's gradient is the embedding's first part (the lookup's
  // rows are added after the layers).
  float* dembed = nullptr;
  if (dims_.tie_embeddings) {
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> eg, units.GradientBuffers(kEmbedUnit));
    MUONMESH_RETURN_IF_ERROR(
        internal::CheckUnitTensors("transformer", eg, 1, "gradients", kEmbedUnit));
    dembed = eg[0];
  }
  const double loss = Head(n, hp[0], head_w, true, hg[0], dims_.tie_embeddings ? dembed : hg[1]);
  MUONMESH_RETURN_IF_ERROR(units.Commit(head));
  held_head.Release();
  if (held_embed.has_value()) held_embed->Release();
  MUONMESH_RETURN_IF_ERROR(Backward(units, n, dembed));
  MUONMESH_RETURN_IF_ERROR(units.Commit(kEmbedUnit));
  return loss / denom + aux;
}

absl::StatusOr<double> Transformer::ForwardBackward(int64_t /*step*/,
                                                    absl::Span<const float* const> params,
                                                    absl::Span<const int64_t> samples,
                                                    absl::Span<float* const> grads) {
  WholeModelAccess whole(spec_, params, grads);
  return ForwardBackwardByUnit(0, whole, samples);
}

absl::StatusOr<double> Transformer::ForwardBackwardByUnit(int64_t /*step*/, UnitAccess& units,
                                                          absl::Span<const int64_t> samples) {
  record_logits_ = true;
  absl::StatusOr<double> loss = Run(units, *train_, samples, /*gradients=*/true);
  record_logits_ = false;
  return loss;
}

absl::StatusOr<double> Transformer::LossByUnit(UnitAccess& units, const TokenStream& tokens,
                                               absl::Span<const int64_t> samples) {
  return Run(units, tokens, samples, /*gradients=*/false);
}

absl::Status Transformer::SetValidation(std::shared_ptr<const TokenStream> val) {
  int64_t windows = 0;
  MUONMESH_RETURN_IF_ERROR(ValidationWindows(val.get(), dims_.seq_len, &windows));
  num_val_samples_ = windows;
  val_ = std::move(val);
  return absl::OkStatus();
}

absl::StatusOr<double> Transformer::ValidationLossByUnit(UnitAccess& units,
                                                         absl::Span<const int64_t> samples) {
  if (val_ == nullptr) return absl::FailedPreconditionError("transformer: no validation data");
  return LossByUnit(units, *val_, samples);
}

absl::StatusOr<std::vector<float>> Transformer::NextTokenLogits(
    absl::Span<const float* const> params, absl::Span<const int32_t> context) {
  if (static_cast<int64_t>(context.size()) != dims_.seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("transformer: a context of ", context.size(),
                                                   " tokens for seq_len ", dims_.seq_len));
  }
  // One window: the context, then any target (its loss is not used).
  std::vector<int32_t> window(context.begin(), context.end());
  window.push_back(0);
  const InMemoryTokens stream(std::move(window));
  const int64_t sample = 0;
  WholeModelAccess whole(spec_, params, {});
  MUONMESH_RETURN_IF_ERROR(LossByUnit(whole, stream, absl::MakeConstSpan(&sample, 1)).status());
  const float* last = logits_.data() + (dims_.seq_len - 1) * dims_.vocab_size;
  return std::vector<float>(last, last + dims_.vocab_size);
}

void Transformer::ResetAttentionLogits() {
  std::fill(logit_max_.begin(), logit_max_.end(), -std::numeric_limits<float>::infinity());
}

std::vector<RowScale> Transformer::QkClipRows(absl::Span<const float> logits, double tau) const {
  std::vector<RowScale> rows;
  const bool mla = dims_.attention == model::Attention::kMla;
  const bool mha = !mla && dims_.n_kv_head == dims_.n_head;
  for (int64_t l = 0; l < dims_.n_layer; ++l) {
    const Slots& s = slots_[l];
    for (int64_t h = 0; h < dims_.n_head; ++h) {
      const size_t i = static_cast<size_t>(l * dims_.n_head + h);
      if (i >= logits.size() || !(logits[i] > tau)) continue;
      // MHA: q and k rows each by sqrt(gamma); GQA: the key rows serve the
      // whole group, so the query takes all of gamma; MLA: the nope parts
      // by sqrt(gamma), q_pe by gamma (k_pe is every head's).
      const double gamma = tau / static_cast<double>(logits[i]);
      const auto root = static_cast<float>(std::sqrt(gamma));
      if (!mla) {
        const int32_t q = s.first + s.q;
        rows.push_back({q, h * qk_, qk_, mha ? root : static_cast<float>(gamma)});
        if (mha) rows.push_back({s.first + s.k, h * qk_, qk_, root});
        continue;
      }
      const int64_t dn = dims_.mla.qk_nope_head_dim;
      const int32_t q = s.first + (s.q_b >= 0 ? s.q_b : s.q);
      rows.push_back({q, h * qk_, dn, root});
      rows.push_back({q, h * qk_ + dn, dims_.mla.qk_rope_head_dim, static_cast<float>(gamma)});
      rows.push_back({s.first + s.kv_b, h * (dn + vd_), dn, root});
    }
  }
  return rows;
}

std::vector<BufferSpec> Transformer::buffers() const {
  std::vector<BufferSpec> out;
  for (int64_t l = 0; l < dims_.n_layer; ++l) {
    if (moe_[l].has_value()) {
      out.push_back({absl::StrCat("layers.", l, ".mlp.router.bias"),
                     {dims_.moe->n_routed_experts}});
    }
  }
  return out;
}

std::vector<std::vector<float>> Transformer::BufferValues() const {
  std::vector<std::vector<float>> out;
  for (const std::optional<MoeLayer>& m : moe_) {
    if (m.has_value()) out.push_back(m->bias());
  }
  return out;
}

absl::Status Transformer::SetBuffers(absl::Span<const std::vector<float>> values) {
  const std::vector<BufferSpec> specs = buffers();
  if (values.size() != specs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("transformer: ", values.size(),
                                                   " buffers given, the model has ",
                                                   specs.size()));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    if (static_cast<int64_t>(values[i].size()) != specs[i].shape[0]) {
      return absl::InvalidArgumentError(absl::StrCat(specs[i].name, ": ", values[i].size(),
                                                     " values, expected ", specs[i].shape[0]));
    }
  }
  size_t i = 0;
  for (std::optional<MoeLayer>& m : moe_) {
    if (m.has_value()) m->bias() = values[i++];
  }
  return absl::OkStatus();
}

std::optional<double> Transformer::aux_loss() const {
  if (!dims_.moe.has_value() || dims_.moe->aux_loss_coef <= 0 || aux_passes_ == 0) {
    return std::nullopt;
  }
  return aux_passes_sum_ / static_cast<double>(aux_passes_);
}

void Transformer::ResetBufferStats() {
  aux_passes_sum_ = 0.0;
  aux_passes_ = 0;
  for (std::optional<MoeLayer>& m : moe_) {
    if (m.has_value()) m->ResetCounts();
  }
}

absl::Span<const float> Transformer::buffer_stats() const {
  stats_.clear();
  for (const std::optional<MoeLayer>& m : moe_) {
    if (m.has_value()) stats_.insert(stats_.end(), m->counts().begin(), m->counts().end());
  }
  return stats_;
}

absl::Status Transformer::UpdateBuffers(absl::Span<const float> global) {
  const int64_t e_n = dims_.moe.has_value() ? dims_.moe->n_routed_experts : 0;
  size_t layers = 0;
  for (const std::optional<MoeLayer>& m : moe_) layers += m.has_value() ? 1 : 0;
  if (global.size() != layers * static_cast<size_t>(e_n)) {
    return absl::InternalError(absl::StrCat("transformer: ", global.size(),
                                            " expert counts, expected ", layers * e_n));
  }
  load_.clear();
  size_t at = 0;
  for (int64_t l = 0; l < dims_.n_layer; ++l) {
    std::optional<MoeLayer>& m = moe_[l];
    if (!m.has_value()) continue;
    const absl::Span<const float> c = global.subspan(at, static_cast<size_t>(e_n));
    at += static_cast<size_t>(e_n);
    double sum = 0.0;
    for (float v : c) sum += v;
    const double mean = sum / static_cast<double>(e_n);
    const auto [lo, hi] = std::minmax_element(c.begin(), c.end());
    load_.push_back({l, mean > 0 ? *lo / mean : 0.0, mean > 0 ? *hi / mean : 0.0, 0});
    m->UpdateBias(c);
  }
  return absl::OkStatus();
}

}  // namespace muonmesh::worker
