#pragma once

// An independent double-precision reference of the `transformer`
// (docs/architecture.md §6; core/model/transformer_spec.h): RMSNorm, RoPE
// (rotate-half, angles in double), grouped-query attention or multi-head
// latent attention (with or without q_lora), SwiGLU, an untied or tied head.
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
inline std::vector<Named> LayerNames(const RefTransformerDims& d) {
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
  out.insert(out.end(), {{"mlp_norm", c}, {"gate", d.ffn * c}, {"up", d.ffn * c},
                         {"down", c * d.ffn}});
  return out;
}

// Every parameter's element count, flat order.
inline std::vector<int64_t> ParamSizes(const RefTransformerDims& d) {
  std::vector<int64_t> out = {d.vocab * d.embd};
  for (int64_t l = 0; l < d.layers; ++l) {
    for (const Named& n : LayerNames(d)) out.push_back(n.size);
  }
  out.push_back(d.embd);
  if (!d.tied) out.push_back(d.vocab * d.embd);
  return out;
}

// y = W x for W [rows, cols].
inline std::vector<double> MatVec(const std::vector<double>& w, const std::vector<double>& x,
                                  int64_t rows) {
  const int64_t cols = static_cast<int64_t>(x.size());
  std::vector<double> y(rows, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) y[r] += w[r * cols + c] * x[c];
  }
  return y;
}

// dW += dy x^T; returns W^T dy.
inline std::vector<double> MatVecBackward(const std::vector<double>& w,
                                          const std::vector<double>& x,
                                          const std::vector<double>& dy, std::vector<double>& dw) {
  const int64_t cols = static_cast<int64_t>(x.size());
  std::vector<double> dx(cols, 0.0);
  for (size_t r = 0; r < dy.size(); ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      dw[r * cols + c] += dy[r] * x[c];
      dx[c] += w[r * cols + c] * dy[r];
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

class Model {
 public:
  Model(const RefTransformerDims& d, const TransformerTensors& p) : d_(d), p_(p) {
    const std::vector<Named> names = LayerNames(d);
    per_layer_ = static_cast<int64_t>(names.size());
    for (size_t j = 0; j < names.size(); ++j) slot_[names[j].name] = static_cast<int64_t>(j);
  }

  // The summed cross-entropy of one window's T positions; keeps what
  // Backward needs, and raises logit_max ([L H]) to each head's largest
  // pre-softmax logit.
  double Forward(const std::vector<int32_t>& window, std::vector<double>* logit_max);
  // Adds d(scale * that sum)/d params to g.
  void Backward(double scale, TransformerTensors& g);

 private:
  struct Layer {
    std::vector<Rms> n1, n2, qa, ckv;  // qa, ckv: mla's inner norms
    std::vector<std::vector<double>> q, k, v;  // after RoPE, per kv head for k, v
    std::vector<std::vector<double>> p;        // [H T + t][j <= t]
    std::vector<std::vector<double>> a;        // [T][H dv] attention output
    std::vector<std::vector<double>> gate, up, m;  // [T][F]
  };
  size_t Index(int64_t l, const char* name) const {
    return static_cast<size_t>(1 + per_layer_ * l + slot_.at(name));
  }
  const std::vector<double>& P(int64_t l, const char* name) const { return p_[Index(l, name)]; }
  size_t FinalNorm() const { return static_cast<size_t>(1 + per_layer_ * d_.layers); }
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
  int64_t per_layer_ = 0;
  std::map<std::string, int64_t> slot_;
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
      s.gate.push_back(MatVec(P(l, "gate"), s.n2[t].y, d_.ffn));
      s.up.push_back(MatVec(P(l, "up"), s.n2[t].y, d_.ffn));
      std::vector<double> m(d_.ffn);
      for (int64_t i = 0; i < d_.ffn; ++i) {
        m[i] = s.gate[t][i] * Sigmoid(s.gate[t][i]) * s.up[t][i];
      }
      s.m.push_back(m);
      AddTo(x_[t], MatVec(P(l, "down"), m, c));
    }
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
  return loss;
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
      // x += down(silu(gate) * up): dx stays, and flows into the MLP.
      std::vector<double> dm = MatVecBackward(P(l, "down"), s.m[t], dx[t], g[Index(l, "down")]);
      std::vector<double> dg(d_.ffn), du(d_.ffn);
      for (int64_t i = 0; i < d_.ffn; ++i) {
        const double sg = Sigmoid(s.gate[t][i]);
        du[i] = dm[i] * s.gate[t][i] * sg;
        dg[i] = dm[i] * s.up[t][i] * sg * (1.0 + s.gate[t][i] * (1.0 - sg));
      }
      std::vector<double> dn2 = MatVecBackward(P(l, "gate"), s.n2[t].y, dg, g[Index(l, "gate")]);
      AddTo(dn2, MatVecBackward(P(l, "up"), s.n2[t].y, du, g[Index(l, "up")]));
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

// The mean cross-entropy over every position of the windows `samples` of
// `tokens`; if grads is not null, its gradient with respect to every
// parameter (flat order, overwritten); if logit_max is not null, each head's
// largest pre-softmax logit ([L H]).
inline double TransformerRefLossAndGrad(const RefTransformerDims& d,
                                        const TransformerTensors& params,
                                        const std::vector<int32_t>& tokens,
                                        const std::vector<int64_t>& samples,
                                        TransformerTensors* grads,
                                        std::vector<double>* logit_max = nullptr) {
  transformer_internal::CheckShapes(d, params);
  const int64_t num = static_cast<int64_t>(tokens.size());
  transformer_internal::Need(num > d.seq, "stream too short");
  transformer_internal::Need(!samples.empty(), "no samples");
  if (grads != nullptr) {
    grads->clear();
    for (const std::vector<double>& t : params) grads->emplace_back(t.size(), 0.0);
  }
  if (logit_max != nullptr) logit_max->assign(d.layers * d.heads, -1e300);
  const double scale = 1.0 / static_cast<double>(samples.size() * d.seq);
  double sum = 0;
  for (int64_t k : samples) {
    transformer_internal::Need(k >= 0, "negative sample");
    const int64_t start = (k * d.seq) % (num - d.seq);
    const std::vector<int32_t> window(tokens.begin() + start, tokens.begin() + start + d.seq + 1);
    transformer_internal::Model model(d, params);
    sum += model.Forward(window, logit_max);
    if (grads != nullptr) model.Backward(scale, *grads);
  }
  return sum * scale;
}

}  // namespace muonmesh::reference
