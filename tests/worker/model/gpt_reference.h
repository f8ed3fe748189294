#pragma once

// An independent double-precision reference of the `gpt` workload's loss
// and gradients, for its tests. Written from the definition alone
// (worker/model/gpt.h's comment, nanoGPT's model.py) in naive loops, one
// sample and one position at a time, with no BLAS: it shares no code with
// worker/ (not the model, not the window arithmetic, not the PRNG), so a
// bug there cannot hide here. Its gradients are checked against central
// differences of its own loss (gpt_test.cc).
//
// Parameters are in the flat order of core/model/gpt_spec.h: wte, wpe, then
// 12 per block (ln_1 w b, c_attn W b, attn c_proj W b, ln_2 w b, c_fc W b,
// mlp c_proj W b), then ln_f w b. Sample k of a token stream of N tokens is
// the window at p = (k T) mod (N - T): inputs tok[p, p + T), targets
// tok[p + 1, p + T + 1).
//
// Errors (wrong sizes, bad ids) throw std::invalid_argument: test code.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <stdexcept>
#include <string>
#include <vector>

namespace muonmesh::reference {

using GptTensors = std::vector<std::vector<double>>;

struct RefGptDims {
  int64_t vocab = 0;   // V
  int64_t block = 0;   // positions in wpe
  int64_t layers = 0;  // L
  int64_t heads = 0;   // H
  int64_t embd = 0;    // C
  int64_t seq = 0;     // T
};

namespace gpt_internal {

inline void Need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("gpt reference: " + what);
}

// Flat index of parameter j (0..11) of block l; of ln_f's weight for l = L.
inline size_t BlockIndex(int64_t l, int j) { return static_cast<size_t>(2 + 12 * l + j); }

// One LayerNorm of a C-vector: y = xhat w + b; keeps xhat and rstd.
struct Norm {
  std::vector<double> xhat;
  double rstd = 0;
  std::vector<double> y;
};

inline Norm NormForward(const double* x, const std::vector<double>& w,
                        const std::vector<double>& b) {
  const size_t c = w.size();
  double mean = 0;
  for (size_t i = 0; i < c; ++i) mean += x[i];
  mean /= static_cast<double>(c);
  double var = 0;
  for (size_t i = 0; i < c; ++i) var += (x[i] - mean) * (x[i] - mean);
  var /= static_cast<double>(c);
  Norm out;
  out.rstd = 1.0 / std::sqrt(var + 1e-5);
  out.xhat.resize(c);
  out.y.resize(c);
  for (size_t i = 0; i < c; ++i) {
    out.xhat[i] = (x[i] - mean) * out.rstd;
    out.y[i] = out.xhat[i] * w[i] + b[i];
  }
  return out;
}

// Accumulates dw, db and adds dL/dx to dx from dy = dL/dy.
inline void NormBackward(const Norm& n, const std::vector<double>& w, const double* dy, double* dx,
                         std::vector<double>& dw, std::vector<double>& db) {
  const size_t c = w.size();
  std::vector<double> dxhat(c);
  double mean_d = 0;
  double mean_dx = 0;
  for (size_t i = 0; i < c; ++i) {
    dw[i] += dy[i] * n.xhat[i];
    db[i] += dy[i];
    dxhat[i] = dy[i] * w[i];
    mean_d += dxhat[i];
    mean_dx += dxhat[i] * n.xhat[i];
  }
  mean_d /= static_cast<double>(c);
  mean_dx /= static_cast<double>(c);
  for (size_t i = 0; i < c; ++i) {
    dx[i] += n.rstd * (dxhat[i] - mean_d - n.xhat[i] * mean_dx);
  }
}

// y [out] = W x + b for W [out, in].
inline std::vector<double> Affine(const std::vector<double>& w, const std::vector<double>& b,
                                  const std::vector<double>& x) {
  const size_t out = b.size();
  const size_t in = x.size();
  std::vector<double> y(out);
  for (size_t o = 0; o < out; ++o) {
    double s = b[o];
    for (size_t i = 0; i < in; ++i) s += w[o * in + i] * x[i];
    y[o] = s;
  }
  return y;
}

// Accumulates dW, db; returns dL/dx.
inline std::vector<double> AffineBackward(const std::vector<double>& w,
                                          const std::vector<double>& x,
                                          const std::vector<double>& dy, std::vector<double>& dw,
                                          std::vector<double>& db) {
  const size_t in = x.size();
  std::vector<double> dx(in, 0.0);
  for (size_t o = 0; o < dy.size(); ++o) {
    db[o] += dy[o];
    for (size_t i = 0; i < in; ++i) {
      dw[o * in + i] += dy[o] * x[i];
      dx[i] += dy[o] * w[o * in + i];
    }
  }
  return dx;
}

inline double Gelu(double x) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}

inline double GeluSlope(double x) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  const double u = k * (x + 0.044715 * x * x * x);
  const double th = std::tanh(u);
  const double du = k * (1.0 + 3.0 * 0.044715 * x * x);
  return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du;
}

// Everything one block's backward pass needs, per position t.
struct BlockState {
  std::vector<Norm> n1, n2;
  std::vector<std::vector<double>> qkv;   // [T][3C]
  std::vector<std::vector<double>> p;     // [H * T + t][j <= t] probabilities
  std::vector<std::vector<double>> att;   // [T][C] attention output
  std::vector<std::vector<double>> pre;   // [T][4C] before gelu
  std::vector<std::vector<double>> post;  // [T][4C] after gelu
};

class Model {
 public:
  Model(const RefGptDims& d, const GptTensors& p) : d_(d), p_(p) {}

  // Forward pass of one window; returns the summed cross-entropy over its T
  // positions. Keeps what Backward needs.
  double Forward(const std::vector<int32_t>& window) {
    const int64_t t_len = d_.seq;
    const int64_t c = d_.embd;
    tok_ = window;
    x_.assign(t_len, std::vector<double>(c));
    for (int64_t t = 0; t < t_len; ++t) {
      Need(tok_[t] >= 0 && tok_[t] < d_.vocab, "token id out of range");
      for (int64_t i = 0; i < c; ++i) x_[t][i] = p_[0][tok_[t] * c + i] + p_[1][t * c + i];
    }
    blocks_.assign(d_.layers, {});
    logit_max_.assign(d_.layers * d_.heads, -1e300);
    for (int64_t l = 0; l < d_.layers; ++l) BlockForward(l);
    return HeadForward();
  }

  // Adds d(scale * that sum)/d params to g.
  void Backward(double scale, GptTensors& g) {
    const int64_t t_len = d_.seq;
    const int64_t c = d_.embd;
    std::vector<std::vector<double>> dx = HeadBackward(scale, g);
    for (int64_t l = d_.layers - 1; l >= 0; --l) BlockBackward(l, dx, g);
    for (int64_t t = 0; t < t_len; ++t) {
      for (int64_t i = 0; i < c; ++i) {
        g[0][tok_[t] * c + i] += dx[t][i];
        g[1][t * c + i] += dx[t][i];
      }
    }
  }

  // [L H] the largest pre-softmax logit of each head in the last Forward.
  const std::vector<double>& logit_max() const { return logit_max_; }

 private:
  const std::vector<double>& P(int64_t l, int j) const { return p_[BlockIndex(l, j)]; }

  void BlockForward(int64_t l) {
    layer_ = l;
    BlockState& s = blocks_[l];
    const int64_t t_len = d_.seq;
    const int64_t c = d_.embd;
    for (int64_t t = 0; t < t_len; ++t) {
      s.n1.push_back(NormForward(x_[t].data(), P(l, 0), P(l, 1)));
      s.qkv.push_back(Affine(P(l, 2), P(l, 3), s.n1[t].y));
    }
    Attention(s);
    for (int64_t t = 0; t < t_len; ++t) {
      const std::vector<double> proj = Affine(P(l, 4), P(l, 5), s.att[t]);
      for (int64_t i = 0; i < c; ++i) x_[t][i] += proj[i];
      s.n2.push_back(NormForward(x_[t].data(), P(l, 6), P(l, 7)));
      s.pre.push_back(Affine(P(l, 8), P(l, 9), s.n2[t].y));
      std::vector<double> post(s.pre[t].size());
      for (size_t i = 0; i < post.size(); ++i) post[i] = Gelu(s.pre[t][i]);
      s.post.push_back(post);
      const std::vector<double> out = Affine(P(l, 10), P(l, 11), post);
      for (int64_t i = 0; i < c; ++i) x_[t][i] += out[i];
    }
  }

  void Attention(BlockState& s) {
    const int64_t t_len = d_.seq;
    const int64_t c = d_.embd;
    const int64_t hs = c / d_.heads;
    const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
    s.att.assign(t_len, std::vector<double>(c, 0.0));
    s.p.assign(d_.heads * t_len, {});
    for (int64_t h = 0; h < d_.heads; ++h) {
      for (int64_t t = 0; t < t_len; ++t) {
        std::vector<double> e(t + 1);
        double top = -1e300;
        for (int64_t j = 0; j <= t; ++j) {
          double dot = 0;
          for (int64_t k = 0; k < hs; ++k) dot += s.qkv[t][h * hs + k] * s.qkv[j][c + h * hs + k];
          e[j] = dot * scale;
          top = std::max(top, e[j]);
          logit_max_[layer_ * d_.heads + h] = std::max(logit_max_[layer_ * d_.heads + h], e[j]);
        }
        double z = 0;
        for (double& v : e) z += (v = std::exp(v - top));
        for (double& v : e) v /= z;
        for (int64_t j = 0; j <= t; ++j) {
          for (int64_t k = 0; k < hs; ++k) {
            s.att[t][h * hs + k] += e[j] * s.qkv[j][2 * c + h * hs + k];
          }
        }
        s.p[h * t_len + t] = e;
      }
    }
  }

  double HeadForward() {
    const int64_t t_len = d_.seq;
    const int64_t c = d_.embd;
    const size_t f = BlockIndex(d_.layers, 0);
    nf_.clear();
    probs_.assign(t_len, std::vector<double>(d_.vocab));
    double sum = 0;
    for (int64_t t = 0; t < t_len; ++t) {
      nf_.push_back(NormForward(x_[t].data(), p_[f], p_[f + 1]));
      std::vector<double>& z = probs_[t];
      double top = -1e300;
      for (int64_t v = 0; v < d_.vocab; ++v) {
        double s = 0;
        for (int64_t i = 0; i < c; ++i) s += nf_[t].y[i] * p_[0][v * c + i];
        z[v] = s;
        top = std::max(top, s);
      }
      const int32_t target = tok_[t + 1];
      Need(target >= 0 && target < d_.vocab, "target id out of range");
      double norm = 0;
      for (double s : z) norm += std::exp(s - top);
      sum += top + std::log(norm) - z[target];
      for (double& s : z) s = std::exp(s - top) / norm;
    }
    return sum;
  }

  std::vector<std::vector<double>> HeadBackward(double scale, GptTensors& g) {
    const int64_t t_len = d_.seq;
    const int64_t c = d_.embd;
    const size_t f = BlockIndex(d_.layers, 0);
    std::vector<std::vector<double>> dx(t_len, std::vector<double>(c, 0.0));
    for (int64_t t = 0; t < t_len; ++t) {
      std::vector<double> dy(c, 0.0);
      for (int64_t v = 0; v < d_.vocab; ++v) {
        const double dz = scale * (probs_[t][v] - (v == tok_[t + 1] ? 1.0 : 0.0));
        for (int64_t i = 0; i < c; ++i) {
          g[0][v * c + i] += dz * nf_[t].y[i];
          dy[i] += dz * p_[0][v * c + i];
        }
      }
      NormBackward(nf_[t], p_[f], dy.data(), dx[t].data(), g[f], g[f + 1]);
    }
    return dx;
  }

  // dx holds dL/d(block l's output) per position; becomes dL/d(its input).
  void BlockBackward(int64_t l, std::vector<std::vector<double>>& dx, GptTensors& g) {
    const BlockState& s = blocks_[l];
    const int64_t t_len = d_.seq;
    const size_t base = BlockIndex(l, 0);
    for (int64_t t = 0; t < t_len; ++t) {
      std::vector<double> dpost =
          AffineBackward(P(l, 10), s.post[t], dx[t], g[base + 10], g[base + 11]);
      for (size_t i = 0; i < dpost.size(); ++i) dpost[i] *= GeluSlope(s.pre[t][i]);
      const std::vector<double> dn2 =
          AffineBackward(P(l, 8), s.n2[t].y, dpost, g[base + 8], g[base + 9]);
      NormBackward(s.n2[t], P(l, 6), dn2.data(), dx[t].data(), g[base + 6], g[base + 7]);
    }
    std::vector<std::vector<double>> datt(t_len);
    for (int64_t t = 0; t < t_len; ++t) {
      datt[t] = AffineBackward(P(l, 4), s.att[t], dx[t], g[base + 4], g[base + 5]);
    }
    const std::vector<std::vector<double>> dqkv = AttentionBackward(s, datt);
    for (int64_t t = 0; t < t_len; ++t) {
      const std::vector<double> dn1 =
          AffineBackward(P(l, 2), s.n1[t].y, dqkv[t], g[base + 2], g[base + 3]);
      NormBackward(s.n1[t], P(l, 0), dn1.data(), dx[t].data(), g[base + 0], g[base + 1]);
    }
  }

  std::vector<std::vector<double>> AttentionBackward(
      const BlockState& s, const std::vector<std::vector<double>>& datt) const {
    const int64_t t_len = d_.seq;
    const int64_t c = d_.embd;
    const int64_t hs = c / d_.heads;
    const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
    std::vector<std::vector<double>> dqkv(t_len, std::vector<double>(3 * c, 0.0));
    for (int64_t h = 0; h < d_.heads; ++h) {
      for (int64_t t = 0; t < t_len; ++t) {
        const std::vector<double>& pr = s.p[h * t_len + t];
        std::vector<double> dp(t + 1, 0.0);
        double mix = 0;
        for (int64_t j = 0; j <= t; ++j) {
          for (int64_t k = 0; k < hs; ++k) {
            dp[j] += datt[t][h * hs + k] * s.qkv[j][2 * c + h * hs + k];
            dqkv[j][2 * c + h * hs + k] += pr[j] * datt[t][h * hs + k];
          }
          mix += pr[j] * dp[j];
        }
        for (int64_t j = 0; j <= t; ++j) {
          const double ds = pr[j] * (dp[j] - mix) * scale;
          for (int64_t k = 0; k < hs; ++k) {
            dqkv[t][h * hs + k] += ds * s.qkv[j][c + h * hs + k];
            dqkv[j][c + h * hs + k] += ds * s.qkv[t][h * hs + k];
          }
        }
      }
    }
    return dqkv;
  }

  RefGptDims d_;
  const GptTensors& p_;
  std::vector<int32_t> tok_;
  std::vector<std::vector<double>> x_;  // the residual stream [T][C]
  std::vector<BlockState> blocks_;
  std::vector<double> logit_max_;
  int64_t layer_ = 0;  // the block BlockForward is in
  std::vector<Norm> nf_;
  std::vector<std::vector<double>> probs_;  // [T][V] softmax of the logits
};

inline void CheckShapes(const RefGptDims& d, const GptTensors& p) {
  Need(d.vocab >= 1 && d.layers >= 1 && d.heads >= 1 && d.embd % d.heads == 0, "bad dims");
  Need(d.seq >= 1 && d.seq <= d.block, "bad seq");
  Need(p.size() == static_cast<size_t>(4 + 12 * d.layers), "wrong number of parameters");
  const int64_t c = d.embd;
  Need(p[0].size() == static_cast<size_t>(d.vocab * c), "wte size");
  Need(p[1].size() == static_cast<size_t>(d.block * c), "wpe size");
  const int64_t sizes[12] = {c, c, 3 * c * c, 3 * c, c * c,     c,
                             c, c, 4 * c * c, 4 * c, 4 * c * c, c};
  for (int64_t l = 0; l < d.layers; ++l) {
    for (int j = 0; j < 12; ++j) {
      Need(p[BlockIndex(l, j)].size() == static_cast<size_t>(sizes[j]),
           "block " + std::to_string(l) + " parameter " + std::to_string(j) + " size");
    }
  }
  Need(p[BlockIndex(d.layers, 0)].size() == static_cast<size_t>(c), "ln_f weight size");
  Need(p[BlockIndex(d.layers, 1)].size() == static_cast<size_t>(c), "ln_f bias size");
}

}  // namespace gpt_internal

// The mean cross-entropy over every position of the windows `samples` of
// `tokens` and, if grads is not null, its gradient with respect to every
// parameter (flat order, overwritten); if logit_max is not null, each head's
// largest pre-softmax logit over the samples' causal positions ([L H]).
inline double GptRefLossAndGrad(const RefGptDims& d, const GptTensors& params,
                                const std::vector<int32_t>& tokens,
                                const std::vector<int64_t>& samples, GptTensors* grads,
                                std::vector<double>* logit_max = nullptr) {
  gpt_internal::CheckShapes(d, params);
  const int64_t num = static_cast<int64_t>(tokens.size());
  gpt_internal::Need(num > d.seq, "stream too short");
  gpt_internal::Need(!samples.empty(), "no samples");
  if (grads != nullptr) {
    grads->clear();
    for (const std::vector<double>& t : params) grads->emplace_back(t.size(), 0.0);
  }
  const double scale = 1.0 / static_cast<double>(samples.size() * d.seq);
  double sum = 0;
  for (int64_t k : samples) {
    gpt_internal::Need(k >= 0, "negative sample");
    const int64_t start = (k * d.seq) % (num - d.seq);
    const std::vector<int32_t> window(tokens.begin() + start, tokens.begin() + start + d.seq + 1);
    gpt_internal::Model model(d, params);
    sum += model.Forward(window);
    if (logit_max != nullptr) {
      logit_max->resize(model.logit_max().size(), -1e300);
      for (size_t i = 0; i < logit_max->size(); ++i) {
        (*logit_max)[i] = std::max((*logit_max)[i], model.logit_max()[i]);
      }
    }
    if (grads != nullptr) model.Backward(scale, *grads);
  }
  return sum * scale;
}

}  // namespace muonmesh::reference
