#pragma once

// An independent double-precision reference of the `transformer`
// (docs/architecture.md §6; core/model/transformer_spec.h): RMSNorm, RoPE
// (rotate-half, angles in double), grouped-query attention or multi-head
// latent attention (with or without q_lora), SwiGLU MLPs or mixtures of
// experts (top-K of softmax or sigmoid scores plus a balancing bias, gates
// optionally renormalized and scaled, shared experts, the balance loss), an
// untied or tied head.
// Written from the definition alone in naive loops, one sample and one
// position at a time, with no BLAS and no code shared with worker/, so a
// bug there cannot hide here. Its gradients are checked against central
// differences of its own loss (transformer_reference_test.cc).
//
// Parameters are in the spec's flat order: embed.weight; per layer the
// names LayerNames lists (attn_norm, the attention's projections, mlp_norm,
// gate, up, down); final_norm, then lm_head unless tied. Sample k of a
// stream of N tokens is the window at p = (k T) mod (N - T), as for gpt.
//
// Errors (wrong sizes, bad ids) throw std::invalid_argument: test code.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace muonmesh::reference {

struct RefTransformerDims {
  int64_t vocab = 0;  // V
  int64_t seq = 0;    // T
  int64_t layers = 0;
  int64_t embd = 0;   // C
  int64_t heads = 0;  // H
  int64_t kv_heads = 0;  // mha
  int64_t head_dim = 0;  // D, even (mha)
  int64_t ffn = 0;       // F
  double eps = 1e-5;
  double theta = 10000.0;
  bool tied = false;
  // Multi-head latent attention instead of mha when mla is set.
  bool mla = false;
  int64_t q_rank = 0;  // 0: q_proj from the input
  int64_t kv_rank = 0;
  int64_t dn = 0, dr = 0, dv = 0;  // nope, rope (even) and value head dims
  // A mixture of experts in layers >= first_dense when experts > 0.
  int64_t experts = 0, top_k = 0, expert_ffn = 0, shared = 0, first_dense = 0;
  bool sigmoid = false, norm_topk = true;
  double route_scale = 1.0, aux_coef = 0.0;

  bool Moe(int64_t l) const { return experts > 0 && l >= first_dense; }
};

using TransformerTensors = std::vector<std::vector<double>>;

namespace transformer_internal {

inline void Need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("transformer reference: " + what);
}

// A layer's parameters in order, each with its element count.
struct Named {
  std::string name;
  int64_t size;
};
inline std::vector<Named> LayerNames(const RefTransformerDims& d, int64_t l) {
  const int64_t c = d.embd;
  std::vector<Named> out = {{"attn_norm", c}};
  if (!d.mla) {
    const int64_t qd = d.heads * d.head_dim, kd = d.kv_heads * d.head_dim;
    out.insert(out.end(), {{"q", qd * c}, {"k", kd * c}, {"v", kd * c}, {"o", c * qd}});
  } else {
    const int64_t qk = d.dn + d.dr;
    if (d.q_rank > 0) {
      out.insert(out.end(), {{"q_a", d.q_rank * c}, {"q_a_norm", d.q_rank},
                             {"q_b", d.heads * qk * d.q_rank}});
    } else {
      out.push_back({"q", d.heads * qk * c});
    }
    out.insert(out.end(), {{"kv_a", (d.kv_rank + d.dr) * c}, {"kv_a_norm", d.kv_rank},
                           {"kv_b", d.heads * (d.dn + d.dv) * d.kv_rank},
                           {"o", c * d.heads * d.dv}});
  }
  out.push_back({"mlp_norm", c});
  if (!d.Moe(l)) {
    out.insert(out.end(), {{"gate", d.ffn * c}, {"up", d.ffn * c}, {"down", c * d.ffn}});
    return out;
  }
  const int64_t e = d.experts, fe = d.expert_ffn, fs = d.shared * d.expert_ffn;
  out.insert(out.end(), {{"router", e * c}, {"ex_gate", e * fe * c}, {"ex_up", e * fe * c},
                         {"ex_down", e * c * fe}});
  if (d.shared > 0) {
    out.insert(out.end(), {{"sh_gate", fs * c}, {"sh_up", fs * c}, {"sh_down", c * fs}});
  }
  return out;
}

// Every parameter's element count, flat order.
inline std::vector<int64_t> ParamSizes(const RefTransformerDims& d) {
  std::vector<int64_t> out = {d.vocab * d.embd};
  for (int64_t l = 0; l < d.layers; ++l) {
    for (const Named& n : LayerNames(d, l)) out.push_back(n.size);
  }
  out.push_back(d.embd);
  if (!d.tied) out.push_back(d.vocab * d.embd);
  return out;
}

// y = W x for W [rows, cols] at w[at...] (an expert of a stack).
inline std::vector<double> MatVec(const std::vector<double>& w, const std::vector<double>& x,
                                  int64_t rows, int64_t at = 0) {
  const int64_t cols = static_cast<int64_t>(x.size());
  std::vector<double> y(rows, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) y[r] += w[at + r * cols + c] * x[c];
  }
  return y;
}

// dW += dy x^T; returns W^T dy (W and dW at [at...]).
inline std::vector<double> MatVecBackward(const std::vector<double>& w,
                                          const std::vector<double>& x,
                                          const std::vector<double>& dy, std::vector<double>& dw,
                                          int64_t at = 0) {
  const int64_t cols = static_cast<int64_t>(x.size());
  std::vector<double> dx(cols, 0.0);
  for (size_t r = 0; r < dy.size(); ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      dw[at + r * cols + c] += dy[r] * x[c];
      dx[c] += w[at + r * cols + c] * dy[r];
    }
  }
  return dx;
}

inline void AddTo(std::vector<double>& a, const std::vector<double>& b) {
  for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
}

struct Rms {
  std::vector<double> x, y;
  double r = 0;  // 1 / sqrt(mean(x^2) + eps)
};

inline Rms RmsForward(const std::vector<double>& x, const std::vector<double>& w, double eps) {
  Rms n{x, std::vector<double>(x.size()), 0};
  double ms = 0;
  for (double v : x) ms += v * v;
  n.r = 1.0 / std::sqrt(ms / static_cast<double>(x.size()) + eps);
  for (size_t i = 0; i < x.size(); ++i) n.y[i] = x[i] * n.r * w[i];
  return n;
}

// Accumulates dw; returns dL/dx.
inline std::vector<double> RmsBackward(const Rms& n, const std::vector<double>& w,
                                       const std::vector<double>& dy, std::vector<double>& dw) {
  const double c = static_cast<double>(n.x.size());
  double dot = 0;
  for (size_t i = 0; i < dy.size(); ++i) {
    dw[i] += dy[i] * n.x[i] * n.r;
    dot += dy[i] * w[i] * n.x[i];
  }
  std::vector<double> dx(dy.size());
  for (size_t i = 0; i < dy.size(); ++i) {
    dx[i] = n.r * w[i] * dy[i] - n.x[i] * n.r * n.r * n.r * dot / c;
  }
  return dx;
}

// Rotates the vector of length d at x (position t) by RoPE; `sign` -1
// applies the transpose (the backward pass).
inline void RopeAt(double* x, int64_t d, int64_t t, double theta, double sign) {
  for (int64_t i = 0; i < d / 2; ++i) {
    const double angle = static_cast<double>(t) * std::pow(theta, -2.0 * i / d);
    const double c = std::cos(angle), s = sign * std::sin(angle);
    const double a = x[i], b = x[i + d / 2];
    x[i] = a * c - b * s;
    x[i + d / 2] = b * c + a * s;
  }
}

// RopeAt on each of the `count` consecutive vectors of length d in v.
inline void Rope(std::vector<double>& v, int64_t count, int64_t d, int64_t t, double theta,
                 double sign) {
  for (int64_t h = 0; h < count; ++h) RopeAt(v.data() + h * d, d, t, theta, sign);
}

inline double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// A SwiGLU of width f on x: y = down(silu(gate x) * up x), the weights at
// offsets at_in (gate, up) and at_out (down) of their tensors (an expert).
struct Swi {
  std::vector<double> gate, up, m, y;
};
inline Swi SwiForward(const std::vector<double>& wg, const std::vector<double>& wu,
                      const std::vector<double>& wd, const std::vector<double>& x, int64_t f,
                      int64_t at_in, int64_t at_out) {
  Swi s{MatVec(wg, x, f, at_in), MatVec(wu, x, f, at_in), std::vector<double>(f), {}};
  for (int64_t i = 0; i < f; ++i) s.m[i] = s.gate[i] * Sigmoid(s.gate[i]) * s.up[i];
  s.y = MatVec(wd, s.m, static_cast<int64_t>(x.size()), at_out);
  return s;
}
// Adds the weights' gradients; returns dL/dx.
inline std::vector<double> SwiBackward(const std::vector<double>& wg,
                                       const std::vector<double>& wu,
                                       const std::vector<double>& wd, const Swi& s,
                                       const std::vector<double>& x, const std::vector<double>& dy,
                                       std::vector<double>& gg, std::vector<double>& gu,
                                       std::vector<double>& gd, int64_t at_in, int64_t at_out) {
  const std::vector<double> dm = MatVecBackward(wd, s.m, dy, gd, at_out);
  std::vector<double> dg(dm.size()), du(dm.size());
  for (size_t i = 0; i < dm.size(); ++i) {
    const double sg = Sigmoid(s.gate[i]);
    du[i] = dm[i] * s.gate[i] * sg;
    dg[i] = dm[i] * s.up[i] * sg * (1.0 + s.gate[i] * (1.0 - sg));
  }
  std::vector<double> dx = MatVecBackward(wg, x, dg, gg, at_in);
  AddTo(dx, MatVecBackward(wu, x, du, gu, at_in));
  return dx;
}

// What the mixture-of-experts layers see and do beside the parameters: the
// balancing bias per layer (in: [L][E], empty rows for dense layers, or
// none: 0), the tokens routed to each expert (out: [L][E], added to) and
// the balance term of the loss (out, added to: its mean over samples).
struct MoeState {
  std::vector<std::vector<double>> bias;
  std::vector<std::vector<int64_t>> counts;
  double aux = 0;
};

class Model {
 public:
  Model(const RefTransformerDims& d, const TransformerTensors& p, MoeState& moe)
      : d_(d), p_(p), moe_(moe), slot_(d.layers), first_(d.layers + 1, 1) {
    for (int64_t l = 0; l < d.layers; ++l) {
      const std::vector<Named> names = LayerNames(d, l);
      for (size_t j = 0; j < names.size(); ++j) slot_[l][names[j].name] = static_cast<int64_t>(j);
      first_[l + 1] = first_[l] + static_cast<int64_t>(names.size());
    }
    moe_.counts.resize(d.layers, std::vector<int64_t>(d.experts, 0));
  }

  // The summed cross-entropy of one window's T positions, plus T times its
  // balance term (MoeState::aux gets that term alone); keeps what Backward
  // needs, and raises logit_max ([L H]) to each head's largest pre-softmax
  // logit.
  double Forward(const std::vector<int32_t>& window, std::vector<double>* logit_max);
  // Adds d(scale * that sum)/d params to g.
  void Backward(double scale, TransformerTensors& g);

 private:
  // One position's routing: scores p [E], the K chosen experts, their
  // gates, the sum S of their scores, and their SwiGLUs.
  struct Route {
    std::vector<double> p;
    std::vector<int64_t> chosen;
    std::vector<double> gate;
    double sum = 0;
    std::vector<Swi> ex;
  };
  struct Layer {
    std::vector<Rms> n1, n2, qa, ckv;  // qa, ckv: mla's inner norms
    std::vector<std::vector<double>> q, k, v;  // after RoPE, per kv head for k, v
    std::vector<std::vector<double>> p;        // [H T + t][j <= t]
    std::vector<std::vector<double>> a;        // [T][H dv] attention output
    std::vector<Swi> mlp;                      // [T] the dense MLP, or the shared experts
    std::vector<Route> route;                  // [T] moe
    std::vector<double> f;                     // [E] moe: E / (K T) #{t : e chosen}
  };
  size_t Index(int64_t l, const char* name) const {
    return static_cast<size_t>(first_[l] + slot_[l].at(name));
  }
  const std::vector<double>& P(int64_t l, const char* name) const { return p_[Index(l, name)]; }
  size_t FinalNorm() const { return static_cast<size_t>(first_[d_.layers]); }
  std::vector<double> Mlp(int64_t l, int64_t t, Layer& s);
  Route Choose(int64_t l, const std::vector<double>& m) const;
  double Balance(Layer& s) const;
  std::vector<double> MlpBackward(int64_t l, int64_t t, const Layer& s,
                                  const std::vector<double>& dy, double aux_scale,
                                  TransformerTensors& g);
  const std::vector<double>& HeadWeight() const { return d_.tied ? p_[0] : p_[FinalNorm() + 1]; }
  int64_t Qk() const { return d_.mla ? d_.dn + d_.dr : d_.head_dim; }
  int64_t Vd() const { return d_.mla ? d_.dv : d_.head_dim; }
  int64_t KvHeads() const { return d_.mla ? d_.heads : d_.kv_heads; }
  void Project(int64_t l, int64_t t, Layer& s);
  std::vector<double> ProjectBackward(int64_t l, int64_t t, const Layer& s,
                                      std::vector<double> dq, std::vector<double> dk,
                                      const std::vector<double>& dv, TransformerTensors& g);
  void Attention(int64_t l, Layer& s, std::vector<double>* logit_max);
  std::vector<std::vector<double>> AttentionBackward(int64_t l, const Layer& s,
                                                     const std::vector<std::vector<double>>& da,
                                                     TransformerTensors& g);

  const RefTransformerDims& d_;
  const TransformerTensors& p_;
  MoeState& moe_;
  std::vector<std::map<std::string, int64_t>> slot_;  // per layer: name -> position
  std::vector<int64_t> first_;  // per layer (and final_norm): the first flat index
  std::vector<int32_t> tok_;
  std::vector<std::vector<double>> x_;  // the residual stream [T][C]
  std::vector<Layer> layers_;
  std::vector<Rms> nf_;
  std::vector<std::vector<double>> probs_;  // [T][V]
};

// Position t's q, k, v (after RoPE) from RMSNorm(x; attn_norm).
inline void Model::Project(int64_t l, int64_t t, Layer& s) {
  const std::vector<double>& n1 = s.n1[t].y;
  if (!d_.mla) {
    const int64_t dd = d_.head_dim;
    s.q.push_back(MatVec(P(l, "q"), n1, d_.heads * dd));
    s.k.push_back(MatVec(P(l, "k"), n1, d_.kv_heads * dd));
    s.v.push_back(MatVec(P(l, "v"), n1, d_.kv_heads * dd));
    Rope(s.q[t], d_.heads, dd, t, d_.theta, 1.0);
    Rope(s.k[t], d_.kv_heads, dd, t, d_.theta, 1.0);
    return;
  }
  const int64_t qk = Qk(), h_n = d_.heads;
  if (d_.q_rank > 0) {
    s.qa.push_back(RmsForward(MatVec(P(l, "q_a"), n1, d_.q_rank), P(l, "q_a_norm"), d_.eps));
    s.q.push_back(MatVec(P(l, "q_b"), s.qa[t].y, h_n * qk));
  } else {
    s.q.push_back(MatVec(P(l, "q"), n1, h_n * qk));
  }
  const std::vector<double> kva = MatVec(P(l, "kv_a"), n1, d_.kv_rank + d_.dr);
  s.ckv.push_back(RmsForward(std::vector<double>(kva.begin(), kva.begin() + d_.kv_rank),
                             P(l, "kv_a_norm"), d_.eps));
  std::vector<double> pe(kva.begin() + d_.kv_rank, kva.end());
  RopeAt(pe.data(), d_.dr, t, d_.theta, 1.0);
  const std::vector<double> kvb = MatVec(P(l, "kv_b"), s.ckv[t].y, h_n * (d_.dn + d_.dv));
  std::vector<double> k(h_n * qk), v(h_n * d_.dv);
  for (int64_t h = 0; h < h_n; ++h) {
    RopeAt(s.q[t].data() + h * qk + d_.dn, d_.dr, t, d_.theta, 1.0);
    const double* row = kvb.data() + h * (d_.dn + d_.dv);
    for (int64_t i = 0; i < d_.dn; ++i) k[h * qk + i] = row[i];
    for (int64_t i = 0; i < d_.dr; ++i) k[h * qk + d_.dn + i] = pe[i];
    for (int64_t i = 0; i < d_.dv; ++i) v[h * d_.dv + i] = row[d_.dn + i];
  }
  s.k.push_back(k);
  s.v.push_back(v);
}

inline void Model::Attention(int64_t l, Layer& s, std::vector<double>* logit_max) {
  const int64_t t_len = d_.seq, h_n = d_.heads, qk = Qk(), vd = Vd();
  const int64_t group = d_.heads / KvHeads();
  const double scale = 1.0 / std::sqrt(static_cast<double>(qk));
  s.a.assign(t_len, std::vector<double>(h_n * vd, 0.0));
  s.p.assign(h_n * t_len, {});
  for (int64_t h = 0; h < h_n; ++h) {
    const int64_t kv = h / group;
    for (int64_t t = 0; t < t_len; ++t) {
      std::vector<double> e(t + 1);
      double top = -1e300;
      for (int64_t j = 0; j <= t; ++j) {
        double dot = 0;
        for (int64_t i = 0; i < qk; ++i) dot += s.q[t][h * qk + i] * s.k[j][kv * qk + i];
        e[j] = dot * scale;
        top = std::max(top, e[j]);
      }
      if (logit_max != nullptr) {
        double& m = (*logit_max)[l * h_n + h];
        m = std::max(m, top);
      }
      double z = 0;
      for (double& v : e) z += (v = std::exp(v - top));
      for (double& v : e) v /= z;
      for (int64_t j = 0; j <= t; ++j) {
        for (int64_t i = 0; i < vd; ++i) s.a[t][h * vd + i] += e[j] * s.v[j][kv * vd + i];
      }
      s.p[h * t_len + t] = e;
    }
  }
}

// Scores, the top K of score + bias (the lowest index on ties), the gates.
inline Model::Route Model::Choose(int64_t l, const std::vector<double>& m) const {
  const int64_t e_n = d_.experts;
  Route r;
  r.p = MatVec(P(l, "router"), m, e_n);
  if (d_.sigmoid) {
    for (double& v : r.p) v = Sigmoid(v);
  } else {
    const double top = *std::max_element(r.p.begin(), r.p.end());
    double z = 0;
    for (double& v : r.p) z += (v = std::exp(v - top));
    for (double& v : r.p) v /= z;
  }
  std::vector<int64_t> order(e_n);
  for (int64_t e = 0; e < e_n; ++e) order[e] = e;
  const bool biased = static_cast<size_t>(l) < moe_.bias.size() && !moe_.bias[l].empty();
  auto key = [&](int64_t e) { return r.p[e] + (biased ? moe_.bias[l][e] : 0.0); };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return key(a) > key(b); });
  r.chosen.assign(order.begin(), order.begin() + d_.top_k);
  for (int64_t e : r.chosen) r.sum += r.p[e];
  for (int64_t e : r.chosen) {
    r.gate.push_back(d_.route_scale * r.p[e] / (d_.norm_topk ? r.sum : 1.0));
  }
  return r;
}

// Position t's MLP output from RMSNorm(h; mlp_norm): the dense SwiGLU, or
// the shared experts plus the chosen experts weighed by their gates.
inline std::vector<double> Model::Mlp(int64_t l, int64_t t, Layer& s) {
  const std::vector<double>& m = s.n2[t].y;
  if (!d_.Moe(l)) {
    s.mlp.push_back(SwiForward(P(l, "gate"), P(l, "up"), P(l, "down"), m, d_.ffn, 0, 0));
    return s.mlp.back().y;
  }
  const int64_t c = d_.embd, fe = d_.expert_ffn;
  std::vector<double> out(c, 0.0);
  if (d_.shared > 0) {
    s.mlp.push_back(
        SwiForward(P(l, "sh_gate"), P(l, "sh_up"), P(l, "sh_down"), m, d_.shared * fe, 0, 0));
    out = s.mlp.back().y;
  }
  Route r = Choose(l, m);
  for (size_t k = 0; k < r.chosen.size(); ++k) {
    const int64_t e = r.chosen[k];
    r.ex.push_back(SwiForward(P(l, "ex_gate"), P(l, "ex_up"), P(l, "ex_down"), m, fe,
                              e * fe * c, e * c * fe));
    for (int64_t i = 0; i < c; ++i) out[i] += r.gate[k] * r.ex.back().y[i];
    ++moe_.counts[l][e];
  }
  s.route.push_back(std::move(r));
  return out;
}

// The layer's balance term for this sample, alpha sum_e f_e P_e (f kept).
inline double Model::Balance(Layer& s) const {
  const int64_t e_n = d_.experts;
  const double t_len = static_cast<double>(d_.seq);
  s.f.assign(e_n, 0.0);
  std::vector<double> mean(e_n, 0.0);
  for (const Route& r : s.route) {
    for (int64_t e : r.chosen) s.f[e] += static_cast<double>(e_n) / (d_.top_k * t_len);
    double z = 0;
    for (double v : r.p) z += v;
    for (int64_t e = 0; e < e_n; ++e) mean[e] += r.p[e] / z / t_len;
  }
  double aux = 0;
  for (int64_t e = 0; e < e_n; ++e) aux += d_.aux_coef * s.f[e] * mean[e];
  return aux;
}

// dL/d RMSNorm(h; mlp_norm) at position t from the output's dy; the balance
// term's gradient weighs aux_scale.
inline std::vector<double> Model::MlpBackward(int64_t l, int64_t t, const Layer& s,
                                              const std::vector<double>& dy, double aux_scale,
                                              TransformerTensors& g) {
  const std::vector<double>& m = s.n2[t].y;
  if (!d_.Moe(l)) {
    return SwiBackward(P(l, "gate"), P(l, "up"), P(l, "down"), s.mlp[t], m, dy,
                       g[Index(l, "gate")], g[Index(l, "up")], g[Index(l, "down")], 0, 0);
  }
  const int64_t c = d_.embd, fe = d_.expert_ffn, e_n = d_.experts;
  std::vector<double> dm(c, 0.0);
  if (d_.shared > 0) {
    dm = SwiBackward(P(l, "sh_gate"), P(l, "sh_up"), P(l, "sh_down"), s.mlp[t], m, dy,
                     g[Index(l, "sh_gate")], g[Index(l, "sh_up")], g[Index(l, "sh_down")], 0, 0);
  }
  const Route& r = s.route[t];
  std::vector<double> dgate(r.chosen.size());
  for (size_t k = 0; k < r.chosen.size(); ++k) {
    const int64_t e = r.chosen[k];
    std::vector<double> dye(c);
    for (int64_t i = 0; i < c; ++i) {
      dye[i] = r.gate[k] * dy[i];
      dgate[k] += dy[i] * r.ex[k].y[i];
    }
    AddTo(dm, SwiBackward(P(l, "ex_gate"), P(l, "ex_up"), P(l, "ex_down"), r.ex[k], m, dye,
                          g[Index(l, "ex_gate")], g[Index(l, "ex_up")], g[Index(l, "ex_down")],
                          e * fe * c, e * c * fe));
  }
  // Through the gates g_k = rs p_k / S (or rs p_k) to the scores.
  std::vector<double> dp(e_n, 0.0);
  double weighted = 0;  // sum_k dg_k p_k
  for (size_t k = 0; k < r.chosen.size(); ++k) weighted += dgate[k] * r.p[r.chosen[k]];
  for (size_t k = 0; k < r.chosen.size(); ++k) {
    dp[r.chosen[k]] += d_.norm_topk
                           ? d_.route_scale * (dgate[k] / r.sum - weighted / (r.sum * r.sum))
                           : d_.route_scale * dgate[k];
  }
  if (d_.aux_coef > 0) {
    // P_e averages p_e / sum_j p_j: dL/dphat_e = w alpha f_e / T.
    double z = 0;
    for (double v : r.p) z += v;
    std::vector<double> dhat(e_n);
    double dot = 0;
    for (int64_t e = 0; e < e_n; ++e) {
      dhat[e] = aux_scale * d_.aux_coef * s.f[e] / static_cast<double>(d_.seq);
      dot += dhat[e] * r.p[e] / z;
    }
    for (int64_t e = 0; e < e_n; ++e) dp[e] += (dhat[e] - dot) / z;
  }
  std::vector<double> ds(e_n);
  double pdp = 0;
  for (int64_t e = 0; e < e_n; ++e) pdp += r.p[e] * dp[e];
  for (int64_t e = 0; e < e_n; ++e) {
    ds[e] = d_.sigmoid ? dp[e] * r.p[e] * (1.0 - r.p[e]) : r.p[e] * (dp[e] - pdp);
  }
  AddTo(dm, MatVecBackward(P(l, "router"), m, ds, g[Index(l, "router")]));
  return dm;
}

inline double Model::Forward(const std::vector<int32_t>& window,
                             std::vector<double>* logit_max) {
  const int64_t t_len = d_.seq, c = d_.embd;
  tok_ = window;
  x_.assign(t_len, std::vector<double>(c));
  for (int64_t t = 0; t < t_len; ++t) {
    Need(tok_[t] >= 0 && tok_[t] < d_.vocab, "token id out of range");
    for (int64_t i = 0; i < c; ++i) x_[t][i] = p_[0][tok_[t] * c + i];
  }
  layers_.assign(d_.layers, {});
  double aux = 0;  // this sample's balance term
  for (int64_t l = 0; l < d_.layers; ++l) {
    Layer& s = layers_[l];
    for (int64_t t = 0; t < t_len; ++t) {
      s.n1.push_back(RmsForward(x_[t], P(l, "attn_norm"), d_.eps));
      Project(l, t, s);
    }
    Attention(l, s, logit_max);
    for (int64_t t = 0; t < t_len; ++t) {
      AddTo(x_[t], MatVec(P(l, "o"), s.a[t], c));
      s.n2.push_back(RmsForward(x_[t], P(l, "mlp_norm"), d_.eps));
      AddTo(x_[t], Mlp(l, t, s));
    }
    if (d_.Moe(l)) aux += Balance(s);
  }
  double loss = 0;
  nf_.clear();
  probs_.assign(t_len, {});
  for (int64_t t = 0; t < t_len; ++t) {
    nf_.push_back(RmsForward(x_[t], p_[FinalNorm()], d_.eps));
    std::vector<double> logits = MatVec(HeadWeight(), nf_[t].y, d_.vocab);
    const double top = *std::max_element(logits.begin(), logits.end());
    double z = 0;
    for (double& v : logits) z += (v = std::exp(v - top));
    for (double& v : logits) v /= z;
    Need(window[t + 1] >= 0 && window[t + 1] < d_.vocab, "target id out of range");
    loss -= std::log(logits[window[t + 1]]);
    probs_[t] = logits;
  }
  moe_.aux += aux;
  return loss + static_cast<double>(t_len) * aux;
}

// From position t's dL/dq, dL/dk, dL/dv (after RoPE) back to dL/d
// RMSNorm(x; attn_norm), with the projections' gradients added to g.
inline std::vector<double> Model::ProjectBackward(int64_t l, int64_t t, const Layer& s,
                                                  std::vector<double> dq, std::vector<double> dk,
                                                  const std::vector<double>& dv,
                                                  TransformerTensors& g) {
  const std::vector<double>& n1 = s.n1[t].y;
  if (!d_.mla) {
    Rope(dq, d_.heads, d_.head_dim, t, d_.theta, -1.0);
    Rope(dk, d_.kv_heads, d_.head_dim, t, d_.theta, -1.0);
    std::vector<double> dn = MatVecBackward(P(l, "q"), n1, dq, g[Index(l, "q")]);
    AddTo(dn, MatVecBackward(P(l, "k"), n1, dk, g[Index(l, "k")]));
    AddTo(dn, MatVecBackward(P(l, "v"), n1, dv, g[Index(l, "v")]));
    return dn;
  }
  const int64_t qk = Qk(), h_n = d_.heads;
  std::vector<double> dkvb(h_n * (d_.dn + d_.dv)), dpe(d_.dr, 0.0);
  for (int64_t h = 0; h < h_n; ++h) {
    RopeAt(dq.data() + h * qk + d_.dn, d_.dr, t, d_.theta, -1.0);
    double* row = dkvb.data() + h * (d_.dn + d_.dv);
    for (int64_t i = 0; i < d_.dn; ++i) row[i] = dk[h * qk + i];
    for (int64_t i = 0; i < d_.dr; ++i) dpe[i] += dk[h * qk + d_.dn + i];
    for (int64_t i = 0; i < d_.dv; ++i) row[d_.dn + i] = dv[h * d_.dv + i];
  }
  RopeAt(dpe.data(), d_.dr, t, d_.theta, -1.0);
  const std::vector<double> dc = MatVecBackward(P(l, "kv_b"), s.ckv[t].y, dkvb, g[Index(l, "kv_b")]);
  std::vector<double> dkva = RmsBackward(s.ckv[t], P(l, "kv_a_norm"), dc, g[Index(l, "kv_a_norm")]);
  dkva.insert(dkva.end(), dpe.begin(), dpe.end());
  std::vector<double> dn = MatVecBackward(P(l, "kv_a"), n1, dkva, g[Index(l, "kv_a")]);
  if (d_.q_rank > 0) {
    const std::vector<double> dqa = MatVecBackward(P(l, "q_b"), s.qa[t].y, dq, g[Index(l, "q_b")]);
    const std::vector<double> dx = RmsBackward(s.qa[t], P(l, "q_a_norm"), dqa, g[Index(l, "q_a_norm")]);
    AddTo(dn, MatVecBackward(P(l, "q_a"), n1, dx, g[Index(l, "q_a")]));
  } else {
    AddTo(dn, MatVecBackward(P(l, "q"), n1, dq, g[Index(l, "q")]));
  }
  return dn;
}

inline std::vector<std::vector<double>> Model::AttentionBackward(
    int64_t l, const Layer& s, const std::vector<std::vector<double>>& da, TransformerTensors& g) {
  const int64_t t_len = d_.seq, qk = Qk(), vd = Vd(), kvh = KvHeads();
  const int64_t group = d_.heads / kvh;
  const double scale = 1.0 / std::sqrt(static_cast<double>(qk));
  std::vector<std::vector<double>> dq(t_len, std::vector<double>(d_.heads * qk, 0.0));
  std::vector<std::vector<double>> dk(t_len, std::vector<double>(kvh * qk, 0.0));
  std::vector<std::vector<double>> dv(t_len, std::vector<double>(kvh * vd, 0.0));
  for (int64_t h = 0; h < d_.heads; ++h) {
    const int64_t kv = h / group;
    for (int64_t t = 0; t < t_len; ++t) {
      const std::vector<double>& p = s.p[h * t_len + t];
      std::vector<double> dp(t + 1, 0.0);
      double dot = 0;
      for (int64_t j = 0; j <= t; ++j) {
        for (int64_t i = 0; i < vd; ++i) {
          dp[j] += da[t][h * vd + i] * s.v[j][kv * vd + i];
          dv[j][kv * vd + i] += p[j] * da[t][h * vd + i];
        }
        dot += p[j] * dp[j];
      }
      for (int64_t j = 0; j <= t; ++j) {
        const double ds = p[j] * (dp[j] - dot) * scale;
        for (int64_t i = 0; i < qk; ++i) {
          dq[t][h * qk + i] += ds * s.k[j][kv * qk + i];
          dk[j][kv * qk + i] += ds * s.q[t][h * qk + i];
        }
      }
    }
  }
  std::vector<std::vector<double>> dn(t_len);
  for (int64_t t = 0; t < t_len; ++t) dn[t] = ProjectBackward(l, t, s, dq[t], dk[t], dv[t], g);
  return dn;
}

inline void Model::Backward(double scale, TransformerTensors& g) {
  const int64_t t_len = d_.seq, c = d_.embd;
  std::vector<std::vector<double>> dx(t_len);
  std::vector<double>& dhead = d_.tied ? g[0] : g[FinalNorm() + 1];
  for (int64_t t = 0; t < t_len; ++t) {
    std::vector<double> dlogits = probs_[t];
    dlogits[tok_[t + 1]] -= 1.0;
    for (double& v : dlogits) v *= scale;
    const std::vector<double> dnf = MatVecBackward(HeadWeight(), nf_[t].y, dlogits, dhead);
    dx[t] = RmsBackward(nf_[t], p_[FinalNorm()], dnf, g[FinalNorm()]);
  }
  for (int64_t l = d_.layers - 1; l >= 0; --l) {
    const Layer& s = layers_[l];
    std::vector<std::vector<double>> da(t_len);
    for (int64_t t = 0; t < t_len; ++t) {
      // x += mlp(n2): dx stays, and flows into the MLP (the balance term
      // weighs 1 / samples = scale T).
      const std::vector<double> dn2 =
          MlpBackward(l, t, s, dx[t], scale * static_cast<double>(t_len), g);
      AddTo(dx[t], RmsBackward(s.n2[t], P(l, "mlp_norm"), dn2, g[Index(l, "mlp_norm")]));
      // x += o_proj(a).
      da[t] = MatVecBackward(P(l, "o"), s.a[t], dx[t], g[Index(l, "o")]);
    }
    const std::vector<std::vector<double>> dn1 = AttentionBackward(l, s, da, g);
    for (int64_t t = 0; t < t_len; ++t) {
      AddTo(dx[t], RmsBackward(s.n1[t], P(l, "attn_norm"), dn1[t], g[Index(l, "attn_norm")]));
    }
  }
  for (int64_t t = 0; t < t_len; ++t) {
    for (int64_t i = 0; i < c; ++i) g[0][tok_[t] * c + i] += dx[t][i];
  }
}

inline void CheckShapes(const RefTransformerDims& d, const TransformerTensors& p) {
  if (d.mla) {
    Need(d.dr % 2 == 0 && d.kv_rank > 0, "bad mla dims");
  } else {
    Need(d.heads % d.kv_heads == 0 && d.head_dim % 2 == 0, "bad head counts");
  }
  const std::vector<int64_t> sizes = ParamSizes(d);
  Need(p.size() == sizes.size(), "parameter count");
  for (size_t i = 0; i < sizes.size(); ++i) {
    Need(p[i].size() == static_cast<size_t>(sizes[i]), "parameter " + std::to_string(i) + " size");
  }
}

}  // namespace transformer_internal

using transformer_internal::MoeState;

// The mean cross-entropy over every position of the windows `samples` of
// `tokens` (plus, with experts and aux_coef > 0, the balance term averaged
// over the samples); if grads is not null, its gradient with respect to
// every parameter (flat order, overwritten); if logit_max is not null, each
// head's largest pre-softmax logit ([L H]); if moe is not null, its bias is
// used and its counts and aux filled (else the bias is 0).
inline double TransformerRefLossAndGrad(const RefTransformerDims& d,
                                        const TransformerTensors& params,
                                        const std::vector<int32_t>& tokens,
                                        const std::vector<int64_t>& samples,
                                        TransformerTensors* grads,
                                        std::vector<double>* logit_max = nullptr,
                                        MoeState* moe = nullptr) {
  transformer_internal::CheckShapes(d, params);
  const int64_t num = static_cast<int64_t>(tokens.size());
  transformer_internal::Need(num > d.seq, "stream too short");
  transformer_internal::Need(!samples.empty(), "no samples");
  if (grads != nullptr) {
    grads->clear();
    for (const std::vector<double>& t : params) grads->emplace_back(t.size(), 0.0);
  }
  if (logit_max != nullptr) logit_max->assign(d.layers * d.heads, -1e300);
  MoeState none;
  MoeState& state = moe != nullptr ? *moe : none;
  state.counts.assign(d.layers, std::vector<int64_t>(d.experts, 0));
  state.aux = 0;
  const double scale = 1.0 / static_cast<double>(samples.size() * d.seq);
  double sum = 0;
  for (int64_t k : samples) {
    transformer_internal::Need(k >= 0, "negative sample");
    const int64_t start = (k * d.seq) % (num - d.seq);
    const std::vector<int32_t> window(tokens.begin() + start, tokens.begin() + start + d.seq + 1);
    transformer_internal::Model model(d, params, state);
    sum += model.Forward(window, logit_max);
    if (grads != nullptr) model.Backward(scale, *grads);
  }
  state.aux /= static_cast<double>(samples.size());
  return sum * scale;
}

}  // namespace muonmesh::reference
