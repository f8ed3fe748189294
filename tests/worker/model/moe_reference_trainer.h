#pragma once

// An independent, single-process reference for training the `moe_mlp`
// workload with Muon + AdamW, for the runtime's tests: what a sharded,
// expert-parallel run must reproduce. Written from the definition alone
// (design §6; the header comment of worker/model/moe_mlp.h) in plain loops
// and double precision, with hand-written back-propagation. Like
// reference_trainer.h (whose optimizer steps it uses) it shares no code with
// worker/.
//
// Parameters (flat order): 0 W_in [d, d_in], 1 b_in [d], 2 W_r [E, d],
// 3 W1 [E, d_e, d], 4 W2 [E, d, d_e], 5 W_out [d_out, d], 6 b_out [d_out].
// Per sample: h = tanh(W_in x + b_in), g = softmax(W_r h), e = argmax g (the
// lowest index on ties), a = tanh(W1[e] h), z = h + g_e W2[e] a,
// y = W_out z + b_out; loss = mean over the batch's elements of (y - t)^2.
// The choice e is not differentiated, the gate g_e is.
//
// Training, step s = 0 .. steps-1, batch (s B + j) mod N: Muon on W_in,
// W_out and on every expert's W1[e] and W2[e] as a matrix of its own;
// AdamW on b_in, W_r and b_out; the steps of reference_trainer.h.
//
// Routing is discontinuous: an fp32 run routes a sample like this reference
// only when its two largest router logits are further apart than fp32
// rounding. Every call reports the smallest such gap it saw, so a test can
// require a comfortable one instead of hoping.
//
// Errors (wrong sizes) throw std::invalid_argument: this is test code.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "tests/worker/model/reference_trainer.h"

namespace muonmesh::reference {

struct RefMoeDims {
  int64_t d_in = 0;
  int64_t d = 0;    // d_model
  int64_t d_e = 0;  // d_expert
  int64_t experts = 0;
  int64_t d_out = 0;
};

namespace internal {

inline void CheckMoe(const RefMoeDims& m, const Tensors& p) {
  Require(m.d_in >= 1 && m.d >= 1 && m.d_e >= 1 && m.experts >= 1 && m.d_out >= 1,
          "non-positive moe dim");
  const size_t want[7] = {static_cast<size_t>(m.d * m.d_in),
                          static_cast<size_t>(m.d),
                          static_cast<size_t>(m.experts * m.d),
                          static_cast<size_t>(m.experts * m.d_e * m.d),
                          static_cast<size_t>(m.experts * m.d * m.d_e),
                          static_cast<size_t>(m.d_out * m.d),
                          static_cast<size_t>(m.d_out)};
  Require(p.size() == 7, "moe_mlp has 7 parameters");
  for (size_t i = 0; i < 7; ++i) {
    Require(p[i].size() == want[i], "moe parameter " + std::to_string(i) + " has the wrong size");
  }
}

}  // namespace internal

// Loss on `batch` (sample indices into x [N, d_in], y [N, d_out]) and, when
// `grads` is not null, its gradient with respect to every parameter. When
// `min_gap` is not null it is lowered to the smallest difference between the
// largest and the second largest router logit of any sample of the batch
// (infinity with one expert).
inline double MoeLossAndGrad(const RefMoeDims& m, const Tensors& p, const std::vector<double>& x,
                             const std::vector<double>& y, const std::vector<int64_t>& batch,
                             Tensors* grads, double* min_gap = nullptr) {
  internal::CheckMoe(m, p);
  internal::Require(x.size() % m.d_in == 0, "x is not [N, d_in]");
  const int64_t num = static_cast<int64_t>(x.size()) / m.d_in;
  internal::Require(y.size() == static_cast<size_t>(num * m.d_out), "y is not [N, d_out]");
  internal::Require(!batch.empty(), "empty batch");
  const int64_t d = m.d, de = m.d_e, ne = m.experts;
  const double count = static_cast<double>(batch.size() * m.d_out);
  if (grads != nullptr) {
    grads->assign(7, {});
    for (size_t i = 0; i < 7; ++i) (*grads)[i].assign(p[i].size(), 0.0);
  }
  double loss = 0.0;
  std::vector<double> h(d), logits(ne), g(ne), a(de), v(d), z(d), dy(m.d_out), dz(d), dh(d),
      dv(d), dpre_a(de), dlogits(ne);
  for (int64_t s : batch) {
    internal::Require(s >= 0 && s < num, "sample out of range");
    const double* xs = &x[s * m.d_in];
    // Forward.
    for (int64_t j = 0; j < d; ++j) {
      double acc = p[1][j];
      for (int64_t c = 0; c < m.d_in; ++c) acc += p[0][j * m.d_in + c] * xs[c];
      h[j] = std::tanh(acc);
    }
    int64_t e = 0;
    for (int64_t k = 0; k < ne; ++k) {
      logits[k] = 0.0;
      for (int64_t j = 0; j < d; ++j) logits[k] += p[2][k * d + j] * h[j];
      if (logits[k] > logits[e]) e = k;
    }
    if (min_gap != nullptr) {
      for (int64_t k = 0; k < ne; ++k) {
        if (k != e) *min_gap = std::min(*min_gap, logits[e] - logits[k]);
      }
    }
    double sum = 0.0;
    for (int64_t k = 0; k < ne; ++k) sum += std::exp(logits[k] - logits[e]);
    for (int64_t k = 0; k < ne; ++k) g[k] = std::exp(logits[k] - logits[e]) / sum;
    const double* w1 = &p[3][e * de * d];  // [d_e, d]
    const double* w2 = &p[4][e * d * de];  // [d, d_e]
    for (int64_t k = 0; k < de; ++k) {
      double acc = 0.0;
      for (int64_t j = 0; j < d; ++j) acc += w1[k * d + j] * h[j];
      a[k] = std::tanh(acc);
    }
    for (int64_t j = 0; j < d; ++j) {
      double acc = 0.0;
      for (int64_t k = 0; k < de; ++k) acc += w2[j * de + k] * a[k];
      v[j] = acc;
      z[j] = h[j] + g[e] * acc;
    }
    for (int64_t o = 0; o < m.d_out; ++o) {
      double acc = p[6][o];
      for (int64_t j = 0; j < d; ++j) acc += p[5][o * d + j] * z[j];
      const double diff = acc - y[s * m.d_out + o];
      loss += diff * diff;
      dy[o] = 2.0 * diff / count;
    }
    if (grads == nullptr) continue;
    Tensors& gr = *grads;
    // Backward: output layer, then the expert, the gate, the router, input.
    std::fill(dz.begin(), dz.end(), 0.0);
    for (int64_t o = 0; o < m.d_out; ++o) {
      gr[6][o] += dy[o];
      for (int64_t j = 0; j < d; ++j) {
        gr[5][o * d + j] += dy[o] * z[j];
        dz[j] += p[5][o * d + j] * dy[o];
      }
    }
    double dgate = 0.0;
    for (int64_t j = 0; j < d; ++j) {
      dh[j] = dz[j];
      dgate += dz[j] * v[j];
      dv[j] = g[e] * dz[j];
    }
    double* gw1 = &gr[3][e * de * d];
    double* gw2 = &gr[4][e * d * de];
    for (int64_t k = 0; k < de; ++k) {
      double da = 0.0;
      for (int64_t j = 0; j < d; ++j) {
        gw2[j * de + k] += dv[j] * a[k];
        da += w2[j * de + k] * dv[j];
      }
      dpre_a[k] = da * (1.0 - a[k] * a[k]);
    }
    for (int64_t k = 0; k < de; ++k) {
      for (int64_t j = 0; j < d; ++j) {
        gw1[k * d + j] += dpre_a[k] * h[j];
        dh[j] += w1[k * d + j] * dpre_a[k];
      }
    }
    // d g_e / d logit_k = g_e (delta_ek - g_k).
    for (int64_t k = 0; k < ne; ++k) {
      dlogits[k] = g[e] * ((k == e ? 1.0 : 0.0) - g[k]) * dgate;
      for (int64_t j = 0; j < d; ++j) {
        gr[2][k * d + j] += dlogits[k] * h[j];
        dh[j] += p[2][k * d + j] * dlogits[k];
      }
    }
    for (int64_t j = 0; j < d; ++j) {
      const double dpre_h = dh[j] * (1.0 - h[j] * h[j]);
      gr[1][j] += dpre_h;
      for (int64_t c = 0; c < m.d_in; ++c) gr[0][j * m.d_in + c] += dpre_h * xs[c];
    }
  }
  return loss / count;
}

// Trains the moe_mlp `m` from `init` on x [N, d_in], y [N, d_out] for `steps`
// steps of batch B, as the header comment describes. `min_gap`, when not
// null, receives the smallest router-logit gap of every sample trained on.
inline RefTrainResult ReferenceTrainMoe(const RefMoeDims& m, const Tensors& init,
                                        const std::vector<double>& x, const std::vector<double>& y,
                                        int64_t N, int64_t steps, int64_t B,
                                        const RefMuonOptions& muon, const RefAdamWOptions& adamw,
                                        double* min_gap = nullptr, const RefRecipe& recipe = {}) {
  internal::CheckMoe(m, init);
  internal::Require(N >= 1 && x.size() == static_cast<size_t>(N * m.d_in) &&
                        y.size() == static_cast<size_t>(N * m.d_out),
                    "x, y are not [N, d_in], [N, d_out]");
  internal::Require(steps >= 0 && B >= 1, "steps < 0 or B < 1");
  if (min_gap != nullptr) *min_gap = std::numeric_limits<double>::infinity();
  RefTrainResult result;
  result.params = init;
  Tensors m1(7), m2(7);
  for (size_t i = 0; i < 7; ++i) {
    m1[i].assign(init[i].size(), 0.0);
    m2[i].assign(init[i].size(), 0.0);
  }
  // One Muon step on rows x cols matrix `index` of parameter `i` (a stack
  // holds several back to back), with its own momentum.
  RefMuonOptions muon_s = muon;
  RefAdamWOptions adamw_s = adamw;
  auto muon_step = [&](size_t i, int64_t index, int64_t rows, int64_t cols, const Tensors& grads) {
    const size_t size = static_cast<size_t>(rows * cols);
    const size_t at = static_cast<size_t>(index) * size;
    std::vector<double> gm(grads[i].begin() + at, grads[i].begin() + at + size);
    std::vector<double> mm(m1[i].begin() + at, m1[i].begin() + at + size);
    std::vector<double> pm(result.params[i].begin() + at, result.params[i].begin() + at + size);
    MuonStepBlocks(ForParam(recipe, i, muon_s), rows, cols, BlockRows(recipe, i), gm, &mm, &pm);
    std::copy(mm.begin(), mm.end(), m1[i].begin() + at);
    std::copy(pm.begin(), pm.end(), result.params[i].begin() + at);
  };
  std::vector<int64_t> batch(static_cast<size_t>(B));
  Tensors grads;
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t j = 0; j < B; ++j) batch[j] = (s * B + j) % N;
    result.losses.push_back(MoeLossAndGrad(m, result.params, x, y, batch, &grads, min_gap));
    muon_s = muon;
    adamw_s = adamw;
    ApplyRecipe(recipe, s, &muon_s, &adamw_s, &grads, &result);
    muon_step(0, 0, m.d, m.d_in, grads);
    for (int64_t e = 0; e < m.experts; ++e) {
      muon_step(3, e, m.d_e, m.d, grads);
      muon_step(4, e, m.d, m.d_e, grads);
    }
    muon_step(5, 0, m.d_out, m.d, grads);
    for (size_t i : {size_t{1}, size_t{2}, size_t{6}}) {
      AdamWStep(ForParam(recipe, i, adamw_s), s + 1, grads[i], &m1[i], &m2[i], &result.params[i]);
    }
  }
  return result;
}

}  // namespace muonmesh::reference
