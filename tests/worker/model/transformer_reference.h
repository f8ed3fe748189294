#pragma once

// An independent double-precision reference of the dense `transformer`
// (docs/architecture.md §6; core/model/transformer_spec.h): RMSNorm, RoPE
// (rotate-half, angles in double), grouped-query attention, SwiGLU, an
// untied or tied head. Written from the definition alone in naive loops, one
// sample and one position at a time, with no BLAS and no code shared with
// worker/, so a bug there cannot hide here. Its gradients are checked
// against central differences of its own loss (transformer_reference_test.cc).
//
// Parameters are in the spec's flat order: embed.weight; per layer
// attn_norm, q_proj, k_proj, v_proj, o_proj, mlp_norm, gate_proj, up_proj,
// down_proj; final_norm, then lm_head unless tied. Sample k of a stream of N
// tokens is the window at p = (k T) mod (N - T), as for gpt.
//
// Errors (wrong sizes, bad ids) throw std::invalid_argument: test code.

#include <algorithm>
#include <cmath>
#include <cstdint>
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
  int64_t kv_heads = 0;
  int64_t head_dim = 0;  // D, even
  int64_t ffn = 0;       // F
  double eps = 1e-5;
  double theta = 10000.0;
  bool tied = false;
};

using TransformerTensors = std::vector<std::vector<double>>;

namespace transformer_internal {

inline void Need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("transformer reference: " + what);
}

constexpr int kPerLayer = 9;
inline size_t LayerIndex(int64_t l, int j) { return static_cast<size_t>(1 + kPerLayer * l + j); }

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

// Rotates each of the `count` vectors of length d in v (at position t) by
// RoPE; `sign` -1 applies the transpose (the backward pass).
inline void Rope(std::vector<double>& v, int64_t count, int64_t d, int64_t t, double theta,
                 double sign) {
  for (int64_t h = 0; h < count; ++h) {
    double* x = v.data() + h * d;
    for (int64_t i = 0; i < d / 2; ++i) {
      const double angle = static_cast<double>(t) * std::pow(theta, -2.0 * i / d);
      const double c = std::cos(angle), s = sign * std::sin(angle);
      const double a = x[i], b = x[i + d / 2];
      x[i] = a * c - b * s;
      x[i + d / 2] = b * c + a * s;
    }
  }
}

inline double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

class Model {
 public:
  Model(const RefTransformerDims& d, const TransformerTensors& p) : d_(d), p_(p) {}

  // The summed cross-entropy of one window's T positions; keeps what
  // Backward needs, and raises logit_max ([L H]) to each head's largest
  // pre-softmax logit.
  double Forward(const std::vector<int32_t>& window, std::vector<double>* logit_max);
  // Adds d(scale * that sum)/d params to g.
  void Backward(double scale, TransformerTensors& g);

 private:
  struct Layer {
    std::vector<Rms> n1, n2;
    std::vector<std::vector<double>> q, k, v;  // after RoPE: [T][H D], [T][Hkv D]
    std::vector<std::vector<double>> p;        // [H T + t][j <= t]
    std::vector<std::vector<double>> a;        // [T][H D] attention output
    std::vector<std::vector<double>> gate, up, m;  // [T][F]
  };
  const std::vector<double>& P(int64_t l, int j) const { return p_[LayerIndex(l, j)]; }
  const std::vector<double>& HeadWeight() const {
    return d_.tied ? p_[0] : p_[LayerIndex(d_.layers, 1)];
  }
  void Attention(int64_t l, Layer& s, std::vector<double>* logit_max);
  std::vector<std::vector<double>> AttentionBackward(int64_t l, const Layer& s,
                                                     const std::vector<std::vector<double>>& da,
                                                     TransformerTensors& g);

  const RefTransformerDims& d_;
  const TransformerTensors& p_;
  std::vector<int32_t> tok_;
  std::vector<std::vector<double>> x_;  // the residual stream [T][C]
  std::vector<Layer> layers_;
  std::vector<Rms> nf_;
  std::vector<std::vector<double>> probs_;  // [T][V]
};

inline void Model::Attention(int64_t l, Layer& s, std::vector<double>* logit_max) {
  const int64_t t_len = d_.seq, h_n = d_.heads, dd = d_.head_dim;
  const int64_t group = d_.heads / d_.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dd));
  s.a.assign(t_len, std::vector<double>(h_n * dd, 0.0));
  s.p.assign(h_n * t_len, {});
  for (int64_t h = 0; h < h_n; ++h) {
    const int64_t kv = h / group;
    for (int64_t t = 0; t < t_len; ++t) {
      std::vector<double> e(t + 1);
      double top = -1e300;
      for (int64_t j = 0; j <= t; ++j) {
        double dot = 0;
        for (int64_t i = 0; i < dd; ++i) dot += s.q[t][h * dd + i] * s.k[j][kv * dd + i];
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
        for (int64_t i = 0; i < dd; ++i) s.a[t][h * dd + i] += e[j] * s.v[j][kv * dd + i];
      }
      s.p[h * t_len + t] = e;
    }
  }
}

inline double Model::Forward(const std::vector<int32_t>& window,
                             std::vector<double>* logit_max) {
  const int64_t t_len = d_.seq, c = d_.embd, dd = d_.head_dim;
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
      s.n1.push_back(RmsForward(x_[t], P(l, 0), d_.eps));
      s.q.push_back(MatVec(P(l, 1), s.n1[t].y, d_.heads * dd));
      s.k.push_back(MatVec(P(l, 2), s.n1[t].y, d_.kv_heads * dd));
      s.v.push_back(MatVec(P(l, 3), s.n1[t].y, d_.kv_heads * dd));
      Rope(s.q[t], d_.heads, dd, t, d_.theta, 1.0);
      Rope(s.k[t], d_.kv_heads, dd, t, d_.theta, 1.0);
    }
    Attention(l, s, logit_max);
    for (int64_t t = 0; t < t_len; ++t) {
      const std::vector<double> o = MatVec(P(l, 4), s.a[t], c);
      for (int64_t i = 0; i < c; ++i) x_[t][i] += o[i];
      s.n2.push_back(RmsForward(x_[t], P(l, 5), d_.eps));
      s.gate.push_back(MatVec(P(l, 6), s.n2[t].y, d_.ffn));
      s.up.push_back(MatVec(P(l, 7), s.n2[t].y, d_.ffn));
      std::vector<double> m(d_.ffn);
      for (int64_t i = 0; i < d_.ffn; ++i) {
        m[i] = s.gate[t][i] * Sigmoid(s.gate[t][i]) * s.up[t][i];
      }
      s.m.push_back(m);
      const std::vector<double> down = MatVec(P(l, 8), m, c);
      for (int64_t i = 0; i < c; ++i) x_[t][i] += down[i];
    }
  }
  double loss = 0;
  nf_.clear();
  probs_.assign(t_len, {});
  for (int64_t t = 0; t < t_len; ++t) {
    nf_.push_back(RmsForward(x_[t], p_[LayerIndex(d_.layers, 0)], d_.eps));
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

inline std::vector<std::vector<double>> Model::AttentionBackward(
    int64_t l, const Layer& s, const std::vector<std::vector<double>>& da, TransformerTensors& g) {
  const int64_t t_len = d_.seq, dd = d_.head_dim, group = d_.heads / d_.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dd));
  std::vector<std::vector<double>> dq(t_len, std::vector<double>(d_.heads * dd, 0.0));
  std::vector<std::vector<double>> dk(t_len, std::vector<double>(d_.kv_heads * dd, 0.0));
  std::vector<std::vector<double>> dv(t_len, std::vector<double>(d_.kv_heads * dd, 0.0));
  for (int64_t h = 0; h < d_.heads; ++h) {
    const int64_t kv = h / group;
    for (int64_t t = 0; t < t_len; ++t) {
      const std::vector<double>& p = s.p[h * t_len + t];
      std::vector<double> dp(t + 1, 0.0);
      double dot = 0;
      for (int64_t j = 0; j <= t; ++j) {
        for (int64_t i = 0; i < dd; ++i) {
          dp[j] += da[t][h * dd + i] * s.v[j][kv * dd + i];
          dv[j][kv * dd + i] += p[j] * da[t][h * dd + i];
        }
        dot += p[j] * dp[j];
      }
      for (int64_t j = 0; j <= t; ++j) {
        const double ds = p[j] * (dp[j] - dot) * scale;
        for (int64_t i = 0; i < dd; ++i) {
          dq[t][h * dd + i] += ds * s.k[j][kv * dd + i];
          dk[j][kv * dd + i] += ds * s.q[t][h * dd + i];
        }
      }
    }
  }
  std::vector<std::vector<double>> dn(t_len);
  for (int64_t t = 0; t < t_len; ++t) {
    Rope(dq[t], d_.heads, dd, t, d_.theta, -1.0);
    Rope(dk[t], d_.kv_heads, dd, t, d_.theta, -1.0);
    const std::vector<double> a = MatVecBackward(P(l, 1), s.n1[t].y, dq[t], g[LayerIndex(l, 1)]);
    const std::vector<double> b = MatVecBackward(P(l, 2), s.n1[t].y, dk[t], g[LayerIndex(l, 2)]);
    const std::vector<double> c = MatVecBackward(P(l, 3), s.n1[t].y, dv[t], g[LayerIndex(l, 3)]);
    dn[t].resize(a.size());
    for (size_t i = 0; i < a.size(); ++i) dn[t][i] = a[i] + b[i] + c[i];
  }
  return dn;
}

inline void Model::Backward(double scale, TransformerTensors& g) {
  const int64_t t_len = d_.seq, c = d_.embd;
  std::vector<std::vector<double>> dx(t_len);
  std::vector<double>& dhead = d_.tied ? g[0] : g[LayerIndex(d_.layers, 1)];
  for (int64_t t = 0; t < t_len; ++t) {
    std::vector<double> dlogits = probs_[t];
    dlogits[tok_[t + 1]] -= 1.0;
    for (double& v : dlogits) v *= scale;
    const std::vector<double> dnf = MatVecBackward(HeadWeight(), nf_[t].y, dlogits, dhead);
    dx[t] = RmsBackward(nf_[t], p_[LayerIndex(d_.layers, 0)], dnf, g[LayerIndex(d_.layers, 0)]);
  }
  for (int64_t l = d_.layers - 1; l >= 0; --l) {
    const Layer& s = layers_[l];
    std::vector<std::vector<double>> da(t_len);
    for (int64_t t = 0; t < t_len; ++t) {
      // x += down(silu(gate) * up): dx stays, and flows into the MLP.
      std::vector<double> dm = MatVecBackward(P(l, 8), s.m[t], dx[t], g[LayerIndex(l, 8)]);
      std::vector<double> dg(d_.ffn), du(d_.ffn);
      for (int64_t i = 0; i < d_.ffn; ++i) {
        const double sg = Sigmoid(s.gate[t][i]);
        du[i] = dm[i] * s.gate[t][i] * sg;
        dg[i] = dm[i] * s.up[t][i] * sg * (1.0 + s.gate[t][i] * (1.0 - sg));
      }
      const std::vector<double> a = MatVecBackward(P(l, 6), s.n2[t].y, dg, g[LayerIndex(l, 6)]);
      const std::vector<double> b = MatVecBackward(P(l, 7), s.n2[t].y, du, g[LayerIndex(l, 7)]);
      std::vector<double> dn2(c);
      for (int64_t i = 0; i < c; ++i) dn2[i] = a[i] + b[i];
      const std::vector<double> dh = RmsBackward(s.n2[t], P(l, 5), dn2, g[LayerIndex(l, 5)]);
      for (int64_t i = 0; i < c; ++i) dx[t][i] += dh[i];
      // x += o_proj(a).
      da[t] = MatVecBackward(P(l, 4), s.a[t], dx[t], g[LayerIndex(l, 4)]);
    }
    const std::vector<std::vector<double>> dn1 = AttentionBackward(l, s, da, g);
    for (int64_t t = 0; t < t_len; ++t) {
      const std::vector<double> d1 = RmsBackward(s.n1[t], P(l, 0), dn1[t], g[LayerIndex(l, 0)]);
      for (int64_t i = 0; i < c; ++i) dx[t][i] += d1[i];
    }
  }
  for (int64_t t = 0; t < t_len; ++t) {
    for (int64_t i = 0; i < c; ++i) g[0][tok_[t] * c + i] += dx[t][i];
  }
}

inline void CheckShapes(const RefTransformerDims& d, const TransformerTensors& p) {
  Need(d.heads % d.kv_heads == 0 && d.head_dim % 2 == 0, "bad head counts");
  const int64_t c = d.embd, qd = d.heads * d.head_dim, kd = d.kv_heads * d.head_dim;
  Need(p.size() == static_cast<size_t>(1 + kPerLayer * d.layers + (d.tied ? 1 : 2)),
       "parameter count");
  Need(p[0].size() == static_cast<size_t>(d.vocab * c), "embed size");
  const int64_t sizes[kPerLayer] = {c, qd * c, kd * c, kd * c, c * qd, c, d.ffn * c, d.ffn * c,
                                    c * d.ffn};
  for (int64_t l = 0; l < d.layers; ++l) {
    for (int j = 0; j < kPerLayer; ++j) {
      Need(p[LayerIndex(l, j)].size() == static_cast<size_t>(sizes[j]),
           "layer " + std::to_string(l) + " parameter " + std::to_string(j) + " size");
    }
  }
  Need(p[LayerIndex(d.layers, 0)].size() == static_cast<size_t>(c), "final_norm size");
  if (!d.tied) Need(p[LayerIndex(d.layers, 1)].size() == static_cast<size_t>(d.vocab * c), "lm_head size");
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
