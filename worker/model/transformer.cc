#include "worker/model/transformer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <utility>

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
// A layer's parameters in spec order (transformer_spec.h, mha, dense).
enum LayerParam { kAttnNorm, kQ, kK, kV, kO, kMlpNorm, kGate, kUp, kDown, kLayerParams };

// y [rows, out] = x [rows, in] W^T, W [out, in].
void Linear(int64_t rows, int64_t in, int64_t out, const float* x, const float* w, float* y) {
  Gemm(false, true, rows, out, in, 1.0f, x, in, w, in, y, out);
}

// dW [out, in] = dy^T x (overwritten), and dx [rows, in] = dy W, added to
// dx when `add`.
void LinearBackward(int64_t rows, int64_t in, int64_t out, const float* dy, const float* x,
                    const float* w, float* dw, float* dx, bool add) {
  Gemm(true, false, out, in, rows, 1.0f, dy, out, x, in, dw, in);
  Gemm(false, false, rows, in, out, 1.0f, dy, out, w, in, dx, in, add ? 1.0f : 0.0f);
}

// y = x / sqrt(mean(x^2) + eps) * w per row; r keeps each row's inverse root.
void RmsForward(int64_t rows, int64_t c, const float* x, const float* w, double eps, float* y,
                float* r) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* xr = x + i * c;
    double ss = 0.0;
    for (int64_t j = 0; j < c; ++j) ss += static_cast<double>(xr[j]) * xr[j];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(c) + eps));
    r[i] = inv;
    float* yr = y + i * c;
    for (int64_t j = 0; j < c; ++j) yr[j] = xr[j] * inv * w[j];
  }
}

// dx += r w dy - x r^3 / C sum_j dy_j w_j x_j per row; dw = sum over rows of
// dy x r (in double in `acc`, rounded once).
void RmsBackward(int64_t rows, int64_t c, const float* x, const float* r, const float* w,
                 const float* dy, float* dx, float* dw, double* acc) {
  std::fill(acc, acc + c, 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    const float* xr = x + i * c;
    const float* dyr = dy + i * c;
    float* dxr = dx + i * c;
    const double inv = r[i];
    double dot = 0.0;
    for (int64_t j = 0; j < c; ++j) {
      dot += static_cast<double>(dyr[j]) * w[j] * xr[j];
      acc[j] += static_cast<double>(dyr[j]) * xr[j] * inv;
    }
    const double k = inv * inv * inv * dot / static_cast<double>(c);
    for (int64_t j = 0; j < c; ++j) {
      dxr[j] += static_cast<float>(inv * w[j] * dyr[j] - xr[j] * k);
    }
  }
  for (int64_t j = 0; j < c; ++j) dw[j] = static_cast<float>(acc[j]);
}

float Sigmoid(float x) { return 1.0f / (1.0f + math::ExpF(-x)); }

// Layer l's initial standard deviation of parameter j (0: a norm, set to 1).
double LayerInitStd(int j, int64_t layers) {
  switch (j) {
    case kAttnNorm:
    case kMlpNorm:
      return 0.0;
    case kO:
    case kDown:
      return kInitStd / std::sqrt(2.0 * static_cast<double>(layers));
    default:
      return kInitStd;
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
      acc_(static_cast<size_t>(dims.d_model)) {
  const int64_t half = dims.head_dim / 2;
  cos_.resize(static_cast<size_t>(dims.seq_len * half));
  sin_.resize(cos_.size());
  for (int64_t t = 0; t < dims.seq_len; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle =
          static_cast<double>(t) *
          std::pow(dims.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(dims.head_dim));
      cos_[t * half + i] = static_cast<float>(std::cos(angle));
      sin_[t * half + i] = static_cast<float>(std::sin(angle));
    }
  }
}

absl::StatusOr<Transformer> Transformer::Create(model::TransformerDims dims,
                                                std::shared_ptr<const TokenStream> train) {
  MUONMESH_ASSIGN_OR_RETURN(plan::ModelSpec spec, model::TransformerSpec(dims));
  if (dims.attention != model::Attention::kMha) {
    return absl::UnimplementedError(
        "model.transformer.attention: mla is not trained by this build yet (mha is)");
  }
  if (dims.moe.has_value()) {
    return absl::UnimplementedError(
        "model.transformer.moe: mixtures of experts are not trained by this build yet");
  }
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
  const int first = unit == kEmbedUnit ? 0 : 1 + kLayerParams * (unit - 1);
  for (size_t j = 0; j < specs.size(); ++j) {
    const int64_t count = plan::NumElements(specs[j]);
    double sigma = kInitStd;  // embed, lm_head
    if (unit == head_unit() && j == 0) sigma = 0.0;  // final_norm
    if (unit != kEmbedUnit && unit != head_unit()) {
      sigma = LayerInitStd(static_cast<int>(j), dims_.n_layer);
    }
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
  const auto qd = static_cast<size_t>(dims_.n_head * dims_.head_dim);
  const auto kd = static_cast<size_t>(dims_.n_kv_head * dims_.head_dim);
  const auto f = static_cast<size_t>(dims_.ffn_hidden);
  const auto t = static_cast<size_t>(dims_.seq_len);
  for (LayerActs& a : layers_) {
    for (std::vector<float>* v : {&a.x, &a.n1, &a.h, &a.n2}) v->resize(rows * c);
    a.r1.resize(rows);
    a.r2.resize(rows);
    a.q.resize(rows * qd);
    a.a.resize(rows * qd);
    a.k.resize(rows * kd);
    a.v.resize(rows * kd);
    a.att.resize(static_cast<size_t>(n) * static_cast<size_t>(dims_.n_head) * t * t);
    for (std::vector<float>* v : {&a.gate, &a.up, &a.m}) v->resize(rows * f);
  }
  for (std::vector<float>* v : {&x_out_, &nf_, &dx_, &dn_}) v->resize(rows * c);
  rf_.resize(rows);
  logits_.resize(rows * static_cast<size_t>(dims_.vocab_size));
  for (std::vector<float>* v : {&da_, &dq_}) v->resize(rows * qd);
  for (std::vector<float>* v : {&dk_, &dv_}) v->resize(rows * kd);
  for (std::vector<float>* v : {&dgate_, &dup_}) v->resize(rows * f);
  exp_.resize(static_cast<size_t>(std::max(dims_.vocab_size, dims_.seq_len)));
  capacity_ = n;
}

void Transformer::Rope(float* x, int64_t rows, int64_t heads, float sign) const {
  const int64_t d = dims_.head_dim;
  const int64_t half = d / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r % dims_.seq_len;
    const float* c = cos_.data() + t * half;
    const float* s = sin_.data() + t * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + (r * heads + h) * d;
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

void Transformer::AttentionForward(LayerActs& a, int64_t n, float* head_max) {
  const int64_t t_len = dims_.seq_len;
  const int64_t d = dims_.head_dim;
  const int64_t qd = dims_.n_head * d;
  const int64_t kd = dims_.n_kv_head * d;
  const int64_t group = dims_.n_head / dims_.n_kv_head;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  for (int64_t b = 0; b < n; ++b) {
    for (int64_t h = 0; h < dims_.n_head; ++h) {
      const int64_t kv = h / group;
      const float* q = a.q.data() + b * t_len * qd + h * d;
      const float* k = a.k.data() + b * t_len * kd + kv * d;
      const float* v = a.v.data() + b * t_len * kd + kv * d;
      float* att = a.att.data() + (b * dims_.n_head + h) * t_len * t_len;
      Gemm(false, true, t_len, t_len, d, scale, q, qd, k, kd, att, t_len);
      const float top = CausalSoftmax(t_len, att, exp_.data());
      if (head_max != nullptr) head_max[h] = std::max(head_max[h], top);
      Gemm(false, false, t_len, d, t_len, 1.0f, att, t_len, v, kd, a.a.data() + b * t_len * qd + h * d,
           qd);
    }
  }
}

void Transformer::LayerForward(int64_t layer, int64_t n, absl::Span<const float* const> p) {
  const int64_t rows = n * dims_.seq_len;
  const int64_t c = dims_.d_model;
  const int64_t qd = dims_.n_head * dims_.head_dim;
  const int64_t kd = dims_.n_kv_head * dims_.head_dim;
  const int64_t f = dims_.ffn_hidden;
  LayerActs& a = layers_[layer];
  RmsForward(rows, c, a.x.data(), p[kAttnNorm], dims_.norm_eps, a.n1.data(), a.r1.data());
  Linear(rows, c, qd, a.n1.data(), p[kQ], a.q.data());
  Linear(rows, c, kd, a.n1.data(), p[kK], a.k.data());
  Linear(rows, c, kd, a.n1.data(), p[kV], a.v.data());
  Rope(a.q.data(), rows, dims_.n_head, 1.0f);
  Rope(a.k.data(), rows, dims_.n_kv_head, 1.0f);
  AttentionForward(a, n, record_logits_ ? logit_max_.data() + layer * dims_.n_head : nullptr);
  Linear(rows, qd, c, a.a.data(), p[kO], a.h.data());
  for (int64_t i = 0; i < rows * c; ++i) a.h[i] += a.x[i];
  RmsForward(rows, c, a.h.data(), p[kMlpNorm], dims_.norm_eps, a.n2.data(), a.r2.data());
  Linear(rows, c, f, a.n2.data(), p[kGate], a.gate.data());
  Linear(rows, c, f, a.n2.data(), p[kUp], a.up.data());
  for (int64_t i = 0; i < rows * f; ++i) a.m[i] = a.gate[i] * Sigmoid(a.gate[i]) * a.up[i];
  float* out = layer + 1 < dims_.n_layer ? layers_[layer + 1].x.data() : x_out_.data();
  Linear(rows, f, c, a.m.data(), p[kDown], out);
  for (int64_t i = 0; i < rows * c; ++i) out[i] += a.h[i];
}

double Transformer::Head(int64_t n, const float* final_norm, const float* head_w, bool gradients,
                         float* dfinal_norm, float* dhead_w) {
  const int64_t rows = n * dims_.seq_len;
  const int64_t c = dims_.d_model;
  const int64_t v = dims_.vocab_size;
  RmsForward(rows, c, x_out_.data(), final_norm, dims_.norm_eps, nf_.data(), rf_.data());
  Linear(rows, c, v, nf_.data(), head_w, logits_.data());
  const double loss = WindowCrossEntropy(n, dims_.seq_len, v, tokens_.data(), logits_.data(),
                                         exp_.data(), gradients);
  if (!gradients) return loss;
  LinearBackward(rows, c, v, logits_.data(), nf_.data(), head_w, dhead_w, dn_.data(), false);
  std::fill(dx_.begin(), dx_.begin() + rows * c, 0.0f);
  RmsBackward(rows, c, x_out_.data(), rf_.data(), final_norm, dn_.data(), dx_.data(), dfinal_norm,
              acc_.data());
  return loss;
}

void Transformer::AttentionBackward(const LayerActs& a, int64_t n, const float* da, float* dq,
                                    float* dk, float* dv) {
  const int64_t t_len = dims_.seq_len;
  const int64_t d = dims_.head_dim;
  const int64_t qd = dims_.n_head * d;
  const int64_t kd = dims_.n_kv_head * d;
  const int64_t group = dims_.n_head / dims_.n_kv_head;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  float* datt = datt_.data();
  for (int64_t b = 0; b < n; ++b) {
    for (int64_t h = 0; h < dims_.n_head; ++h) {
      const int64_t kv = h / group;
      const float beta = h % group == 0 ? 0.0f : 1.0f;  // the group's heads add up
      const int64_t qo = b * t_len * qd + h * d;
      const int64_t ko = b * t_len * kd + kv * d;
      const float* att = a.att.data() + (b * dims_.n_head + h) * t_len * t_len;
      // dP = dY V^T; dV += P^T dY; dS = softmax'(dP); dQ = s dS K; dK += s dS^T Q.
      Gemm(false, true, t_len, t_len, d, 1.0f, da + qo, qd, a.v.data() + ko, kd, datt, t_len);
      Gemm(true, false, t_len, d, t_len, 1.0f, att, t_len, da + qo, qd, dv + ko, kd, beta);
      CausalSoftmaxBackward(t_len, att, datt);
      Gemm(false, false, t_len, d, t_len, scale, datt, t_len, a.k.data() + ko, kd, dq + qo, qd);
      Gemm(true, false, t_len, d, t_len, scale, datt, t_len, a.q.data() + qo, qd, dk + ko, kd,
           beta);
    }
  }
}

void Transformer::LayerBackward(int64_t layer, int64_t n, absl::Span<const float* const> p,
                                absl::Span<float* const> g) {
  const int64_t rows = n * dims_.seq_len;
  const int64_t c = dims_.d_model;
  const int64_t qd = dims_.n_head * dims_.head_dim;
  const int64_t kd = dims_.n_kv_head * dims_.head_dim;
  const int64_t f = dims_.ffn_hidden;
  const LayerActs& a = layers_[layer];
  // x' = h + down(m): dL/dm, then through silu(gate) * up.
  LinearBackward(rows, f, c, dx_.data(), a.m.data(), p[kDown], g[kDown], dgate_.data(), false);
  for (int64_t i = 0; i < rows * f; ++i) {
    const float dm = dgate_[i];
    const float s = Sigmoid(a.gate[i]);
    dup_[i] = dm * a.gate[i] * s;
    dgate_[i] = dm * a.up[i] * s * (1.0f + a.gate[i] * (1.0f - s));
  }
  LinearBackward(rows, c, f, dgate_.data(), a.n2.data(), p[kGate], g[kGate], dn_.data(), false);
  LinearBackward(rows, c, f, dup_.data(), a.n2.data(), p[kUp], g[kUp], dn_.data(), true);
  RmsBackward(rows, c, a.h.data(), a.r2.data(), p[kMlpNorm], dn_.data(), dx_.data(), g[kMlpNorm],
              acc_.data());
  // h = x + o(attn): dL/da, the attention, then q, k, v back through RoPE.
  LinearBackward(rows, qd, c, dx_.data(), a.a.data(), p[kO], g[kO], da_.data(), false);
  AttentionBackward(a, n, da_.data(), dq_.data(), dk_.data(), dv_.data());
  Rope(dq_.data(), rows, dims_.n_head, -1.0f);
  Rope(dk_.data(), rows, dims_.n_kv_head, -1.0f);
  LinearBackward(rows, c, qd, dq_.data(), a.n1.data(), p[kQ], g[kQ], dn_.data(), false);
  LinearBackward(rows, c, kd, dk_.data(), a.n1.data(), p[kK], g[kK], dn_.data(), true);
  LinearBackward(rows, c, kd, dv_.data(), a.n1.data(), p[kV], g[kV], dn_.data(), true);
  RmsBackward(rows, c, a.x.data(), a.r1.data(), p[kAttnNorm], dn_.data(), dx_.data(),
              g[kAttnNorm], acc_.data());
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
        internal::CheckUnitTensors("transformer", p, kLayerParams, "acquire", unit));
    LayerForward(l, n, p);
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
        internal::CheckUnitTensors("transformer", p, kLayerParams, "acquire", unit));
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> g, units.GradientBuffers(unit));
    MUONMESH_RETURN_IF_ERROR(
        internal::CheckUnitTensors("transformer", g, kLayerParams, "gradients", unit));
    LayerBackward(l, n, p, g);
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
  if (!gradients) return Head(n, hp[0], head_w, false, nullptr, nullptr) / denom;
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
  return loss / denom;
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

void Transformer::ResetAttentionLogits() {
  std::fill(logit_max_.begin(), logit_max_.end(), -std::numeric_limits<float>::infinity());
}

std::vector<RowScale> Transformer::QkClipRows(absl::Span<const float> logits, double tau) const {
  std::vector<RowScale> rows;
  for (int64_t l = 0; l < dims_.n_layer; ++l) {
    for (int64_t h = 0; h < dims_.n_head; ++h) {
      const size_t i = static_cast<size_t>(l * dims_.n_head + h);
      if (i >= logits.size() || !(logits[i] > tau)) continue;
      // MHA: q and k rows each by sqrt(gamma); GQA: the key rows serve the
      // whole group, so the query takes all of gamma.
      const double gamma = tau / static_cast<double>(logits[i]);
      const bool mha = dims_.n_kv_head == dims_.n_head;
      const int32_t q = static_cast<int32_t>(1 + kLayerParams * l + kQ);
      const float factor = static_cast<float>(mha ? std::sqrt(gamma) : gamma);
      rows.push_back({q, h * dims_.head_dim, dims_.head_dim, factor});
      if (mha) rows.push_back({q + 1, h * dims_.head_dim, dims_.head_dim, factor});
    }
  }
  return rows;
}

}  // namespace muonmesh::worker
