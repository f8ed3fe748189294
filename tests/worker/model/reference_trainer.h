#pragma once

// An independent, single-process reference for training the `mlp` workload
// with Muon + AdamW, for the runtime's tests: its final weights are what a
// sharded run must reproduce. Written from the definitions alone (design §5,
// §6; worker/model/mlp.h for the model; torch.optim.Muon and
// torch.optim.AdamW for the optimizers) in plain loops and double precision.
// It deliberately shares no code with worker/ (not the model, not the math,
// not the PRNG): a bug there cannot hide here.
//
// Training, for step s = 0 .. steps-1:
//   batch   = samples (s B + j) mod N for j < B
//   loss_s  = mean over the batch's elements of (y - t)^2, at the weights
//             before the step's update (the loss the runtime reports)
//   grads   = d loss_s / d params
//   each Muon parameter (default: every weight layers.{i}.weight):
//     p <- p (1 - lr wd)
//     m <- m + (1 - beta)(g - m)                       (m starts at 0)
//     u  = nesterov ? g + beta (m - g) : m
//     O  = NewtonSchulz(u)
//     p <- p - lr scale O,  scale = sqrt(max(1, rows/cols)) ("original")
//                             or 0.2 sqrt(max(rows, cols)) (match_rms_adamw)
//   each AdamW parameter (default: every bias), t = s + 1:
//     p <- p (1 - lr wd)
//     m <- beta1 m + (1 - beta1) g ;  v <- beta2 v + (1 - beta2) g^2
//     p <- p - lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
// NewtonSchulz(u), u rows x cols: X = u, transposed if rows > cols;
// X <- X / max(||X||_F, eps); then per iteration k (coefficients row k, the
// last row repeating) A = X X^T, B = b A + c A A, X = a X + B X; transposed
// back.
//
// Errors (wrong sizes) throw std::invalid_argument: this is test code.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace muonmesh::reference {

using Tensors = std::vector<std::vector<double>>;

struct RefMuonOptions {
  double lr = 0.02;
  double momentum = 0.95;
  bool nesterov = true;
  int ns_steps = 5;
  double weight_decay = 0.0;
  bool match_rms_adamw = false;  // scale 0.2 sqrt(max(rows, cols)) instead of "original"
  double eps = 1e-7;
  // Row k for Newton-Schulz iteration k, the last row repeating.
  std::vector<std::array<double, 3>> coefficients = {{3.4445, -4.7750, 2.0315}};
};

struct RefAdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

// The recipe's per-step changes (docs/architecture.md §5, "The recipe"), given
// step by step so that the reference computes no schedule itself: step s
// runs both optimizers at lr * lr_scale[s] (weight decay with it) and Muon
// at momentum[s] (empty vectors: 1 and the options' momentum); with
// clip_grad_norm > 0 every gradient is first multiplied by
// min(1, clip / (norm + 1e-6)), norm over all of them.
// Per parameter i (flat order; empty: none), optimizer.rules' rates: its lr
// times param_lr_scale[i], and param_weight_decay[i] instead of its
// optimizer's unless NaN.
struct RefRecipe {
  std::vector<double> lr_scale;
  std::vector<double> momentum;
  double clip_grad_norm = 0;
  std::vector<double> param_lr_scale;
  std::vector<double> param_weight_decay;
  // Per parameter: Muon orthogonalizes each block of this many rows alone
  // (0 or missing: the whole matrix).
  std::vector<int64_t> param_block_rows;
  // Per parameter, with param_block_rows: blocks of two sizes in turn, this
  // many rows the second (0 or missing: one size); and whether the blocks of
  // each size form one matrix, their rows stacked in order.
  std::vector<int64_t> param_block_rows_next;
  std::vector<bool> param_stack_blocks;
};

// `o` for parameter i under the recipe's per-parameter rates.
template <typename Options>
Options ForParam(const RefRecipe& recipe, size_t i, Options o) {
  if (i < recipe.param_lr_scale.size()) o.lr *= recipe.param_lr_scale[i];
  if (i < recipe.param_weight_decay.size() && !std::isnan(recipe.param_weight_decay[i])) {
    o.weight_decay = recipe.param_weight_decay[i];
  }
  return o;
}

struct RefTrainResult {
  Tensors params;              // flat order: W_0, b_0, W_1, b_1, ...
  std::vector<double> losses;  // one per step, before that step's update
  std::vector<double> grad_norms;  // one per step, before clipping
};

// Step s's options under `recipe`; clips `grads` in place and records their
// norm.
inline void ApplyRecipe(const RefRecipe& recipe, int64_t s, RefMuonOptions* muon,
                        RefAdamWOptions* adamw, std::vector<std::vector<double>>* grads,
                        RefTrainResult* result) {
  const size_t k = static_cast<size_t>(s);
  if (k < recipe.lr_scale.size()) {
    muon->lr *= recipe.lr_scale[k];
    adamw->lr *= recipe.lr_scale[k];
  }
  if (k < recipe.momentum.size()) muon->momentum = recipe.momentum[k];
  double sq = 0;
  for (const auto& g : *grads) {
    for (double v : g) sq += v * v;
  }
  const double norm = std::sqrt(sq);
  result->grad_norms.push_back(norm);
  if (recipe.clip_grad_norm > 0 && recipe.clip_grad_norm / (norm + 1e-6) < 1) {
    const double f = recipe.clip_grad_norm / (norm + 1e-6);
    for (auto& g : *grads) {
      for (double& v : g) v *= f;
    }
  }
}

namespace internal {

inline void Require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("reference: " + what);
}

inline void CheckMlp(const std::vector<int64_t>& dims, const Tensors& params) {
  Require(dims.size() >= 2, "need at least two dims");
  Require(params.size() == 2 * (dims.size() - 1), "wrong number of parameters");
  for (size_t i = 0; i + 1 < dims.size(); ++i) {
    Require(dims[i] >= 1 && dims[i + 1] >= 1, "non-positive dim");
    Require(params[2 * i].size() == static_cast<size_t>(dims[i + 1] * dims[i]),
            "weight " + std::to_string(i) + " has the wrong size");
    Require(params[2 * i + 1].size() == static_cast<size_t>(dims[i + 1]),
            "bias " + std::to_string(i) + " has the wrong size");
  }
}

}  // namespace internal

// Outputs [n, d_L] of the mlp on inputs x [n, d_0] (row-major).
inline std::vector<double> MlpOutputs(const std::vector<int64_t>& dims, const Tensors& params,
                                      const std::vector<double>& x, int64_t n) {
  internal::CheckMlp(dims, params);
  internal::Require(x.size() == static_cast<size_t>(n * dims[0]), "x has the wrong size");
  const size_t layers = dims.size() - 1;
  std::vector<double> h = x;
  for (size_t i = 0; i < layers; ++i) {
    const int64_t in = dims[i];
    const int64_t out = dims[i + 1];
    const std::vector<double>& w = params[2 * i];
    const std::vector<double>& b = params[2 * i + 1];
    std::vector<double> z(static_cast<size_t>(n * out));
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t o = 0; o < out; ++o) {
        double s = 0.0;
        for (int64_t c = 0; c < in; ++c) s += w[o * in + c] * h[r * in + c];
        s += b[o];
        z[r * out + o] = i + 1 < layers ? std::tanh(s) : s;
      }
    }
    h = std::move(z);
  }
  return h;
}

// Loss (mean of (y - t)^2 over every element of the batch) and, if `grads`
// is not null, its gradient with respect to every parameter (flat order).
// x [N, d_0], y [N, d_L]; `batch` holds sample indices in [0, N).
inline double MlpLossAndGrad(const std::vector<int64_t>& dims, const Tensors& params,
                             const std::vector<double>& x, const std::vector<double>& y,
                             const std::vector<int64_t>& batch, Tensors* grads) {
  internal::CheckMlp(dims, params);
  const int64_t d_in = dims.front();
  const int64_t d_out = dims.back();
  internal::Require(x.size() % d_in == 0, "x is not [N, d_in]");
  const int64_t num = static_cast<int64_t>(x.size()) / d_in;
  internal::Require(y.size() == static_cast<size_t>(num * d_out), "y is not [N, d_out]");
  internal::Require(!batch.empty(), "empty batch");
  const int64_t n = static_cast<int64_t>(batch.size());
  const size_t layers = dims.size() - 1;

  // Forward, keeping every layer's activations.
  std::vector<std::vector<double>> h(layers + 1);
  h[0].resize(static_cast<size_t>(n * d_in));
  for (int64_t r = 0; r < n; ++r) {
    internal::Require(batch[r] >= 0 && batch[r] < num, "sample out of range");
    for (int64_t c = 0; c < d_in; ++c) h[0][r * d_in + c] = x[batch[r] * d_in + c];
  }
  for (size_t i = 0; i < layers; ++i) {
    const int64_t in = dims[i];
    const int64_t out = dims[i + 1];
    h[i + 1].resize(static_cast<size_t>(n * out));
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t o = 0; o < out; ++o) {
        double s = params[2 * i + 1][o];
        for (int64_t c = 0; c < in; ++c) s += params[2 * i][o * in + c] * h[i][r * in + c];
        h[i + 1][r * out + o] = i + 1 < layers ? std::tanh(s) : s;
      }
    }
  }

  const double count = static_cast<double>(n * d_out);
  double loss = 0.0;
  std::vector<double> delta(static_cast<size_t>(n * d_out));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t o = 0; o < d_out; ++o) {
      const double d = h[layers][r * d_out + o] - y[batch[r] * d_out + o];
      loss += d * d;
      delta[r * d_out + o] = 2.0 * d / count;
    }
  }
  loss /= count;
  if (grads == nullptr) return loss;

  grads->assign(params.size(), {});
  for (size_t ii = layers; ii-- > 0;) {
    const int64_t in = dims[ii];
    const int64_t out = dims[ii + 1];
    std::vector<double>& gw = (*grads)[2 * ii];
    std::vector<double>& gb = (*grads)[2 * ii + 1];
    gw.assign(static_cast<size_t>(out * in), 0.0);
    gb.assign(static_cast<size_t>(out), 0.0);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t o = 0; o < out; ++o) {
        const double d = delta[r * out + o];
        gb[o] += d;
        for (int64_t c = 0; c < in; ++c) gw[o * in + c] += d * h[ii][r * in + c];
      }
    }
    if (ii == 0) break;
    std::vector<double> prev(static_cast<size_t>(n * in), 0.0);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t c = 0; c < in; ++c) {
        double s = 0.0;
        for (int64_t o = 0; o < out; ++o) s += delta[r * out + o] * params[2 * ii][o * in + c];
        const double a = h[ii][r * in + c];
        prev[r * in + c] = s * (1.0 - a * a);
      }
    }
    delta = std::move(prev);
  }
  return loss;
}

// The Newton-Schulz orthogonalisation of u (rows x cols, row-major).
inline std::vector<double> NewtonSchulz(const std::vector<double>& u, int64_t rows, int64_t cols,
                                        const RefMuonOptions& opt) {
  internal::Require(u.size() == static_cast<size_t>(rows * cols), "u has the wrong size");
  internal::Require(!opt.coefficients.empty(), "no Newton-Schulz coefficients");
  const bool transpose = rows > cols;
  const int64_t m = transpose ? cols : rows;  // m <= n
  const int64_t n = transpose ? rows : cols;
  std::vector<double> x(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) x[i * n + j] = transpose ? u[j * cols + i] : u[i * cols + j];
  }
  double norm = 0.0;
  for (double v : x) norm += v * v;
  norm = std::max(std::sqrt(norm), opt.eps);
  for (double& v : x) v /= norm;

  std::vector<double> a(static_cast<size_t>(m * m));
  std::vector<double> bm(static_cast<size_t>(m * m));
  std::vector<double> next(static_cast<size_t>(m * n));
  for (int k = 0; k < opt.ns_steps; ++k) {
    const std::array<double, 3>& co =
        opt.coefficients[std::min<size_t>(static_cast<size_t>(k), opt.coefficients.size() - 1)];
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < m; ++j) {
        double s = 0.0;
        for (int64_t l = 0; l < n; ++l) s += x[i * n + l] * x[j * n + l];
        a[i * m + j] = s;
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < m; ++j) {
        double s = 0.0;
        for (int64_t l = 0; l < m; ++l) s += a[i * m + l] * a[l * m + j];
        bm[i * m + j] = co[1] * a[i * m + j] + co[2] * s;
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double s = 0.0;
        for (int64_t l = 0; l < m; ++l) s += bm[i * m + l] * x[l * n + j];
        next[i * n + j] = co[0] * x[i * n + j] + s;
      }
    }
    x.swap(next);
  }
  std::vector<double> out(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      if (transpose) {
        out[j * cols + i] = x[i * n + j];
      } else {
        out[i * cols + j] = x[i * n + j];
      }
    }
  }
  return out;
}

// One Muon step on a whole rows x cols matrix (torch.optim.Muon).
inline void MuonStep(const RefMuonOptions& opt, int64_t rows, int64_t cols,
                     const std::vector<double>& grad, std::vector<double>* momentum,
                     std::vector<double>* param) {
  const size_t size = static_cast<size_t>(rows * cols);
  internal::Require(grad.size() == size && momentum->size() == size && param->size() == size,
                    "Muon buffers have the wrong size");
  std::vector<double> u(size);
  for (size_t k = 0; k < size; ++k) {
    (*param)[k] *= 1.0 - opt.lr * opt.weight_decay;
    (*momentum)[k] += (1.0 - opt.momentum) * (grad[k] - (*momentum)[k]);
    u[k] = opt.nesterov ? grad[k] + opt.momentum * ((*momentum)[k] - grad[k]) : (*momentum)[k];
  }
  const std::vector<double> o = NewtonSchulz(u, rows, cols, opt);
  const double r = static_cast<double>(rows);
  const double c = static_cast<double>(cols);
  const double scale =
      opt.match_rms_adamw ? 0.2 * std::sqrt(std::max(r, c)) : std::sqrt(std::max(1.0, r / c));
  for (size_t k = 0; k < size; ++k) (*param)[k] -= opt.lr * scale * o[k];
}

// How Muon cuts one parameter's rows into matrices: blocks of `rows` rows
// (0: the whole matrix), of `next` rows in turn when next > 0, the blocks of
// each size stacked into one matrix when `stacked`.
struct RefBlocks {
  int64_t rows = 0;
  int64_t next = 0;
  bool stacked = false;
};

// The row indices of each Muon matrix of a `rows`-row parameter under `b`:
// each row goes to its block (stacked: to its block's size), and the
// groups come in order of their first row.
inline std::vector<std::vector<int64_t>> RowGroups(int64_t rows, const RefBlocks& b) {
  std::map<int64_t, std::vector<int64_t>> by_group;
  const int64_t period = b.rows + std::max<int64_t>(b.next, 0);
  internal::Require(b.rows <= 0 || rows % period == 0, "the blocks do not divide the rows");
  for (int64_t r = 0; r < rows; ++r) {
    const bool second = b.next > 0 && r % period >= b.rows;
    int64_t group = 0;
    if (b.rows <= 0) {
      group = 0;
    } else if (b.next > 0 && b.stacked) {
      group = second ? 1 : 0;
    } else if (b.next > 0) {
      group = 2 * (r / period) + (second ? 1 : 0);
    } else {
      group = r / b.rows;
    }
    by_group[group].push_back(r);
  }
  std::vector<std::vector<int64_t>> groups;
  for (auto& [group, members] : by_group) groups.push_back(std::move(members));
  return groups;
}

// MuonStep on each matrix RowGroups makes of a rows x cols parameter alone,
// each with its momentum rows.
inline void MuonStepBlocks(const RefMuonOptions& opt, int64_t rows, int64_t cols,
                           const RefBlocks& blocks, const std::vector<double>& grad,
                           std::vector<double>* momentum, std::vector<double>* param) {
  for (const std::vector<int64_t>& group : RowGroups(rows, blocks)) {
    const int64_t n = static_cast<int64_t>(group.size());
    std::vector<double> g, m, p;
    for (int64_t r : group) {
      for (int64_t c = 0; c < cols; ++c) {
        const size_t at = static_cast<size_t>(r * cols + c);
        g.push_back(grad[at]);
        m.push_back((*momentum)[at]);
        p.push_back((*param)[at]);
      }
    }
    MuonStep(opt, n, cols, g, &m, &p);
    for (int64_t k = 0; k < n; ++k) {
      for (int64_t c = 0; c < cols; ++c) {
        const size_t at = static_cast<size_t>(group[k] * cols + c);
        (*momentum)[at] = m[static_cast<size_t>(k * cols + c)];
        (*param)[at] = p[static_cast<size_t>(k * cols + c)];
      }
    }
  }
}

// The blocks the recipe gives parameter i.
inline RefBlocks BlockRows(const RefRecipe& recipe, size_t i) {
  RefBlocks b;
  if (i < recipe.param_block_rows.size()) b.rows = recipe.param_block_rows[i];
  if (i < recipe.param_block_rows_next.size()) b.next = recipe.param_block_rows_next[i];
  if (i < recipe.param_stack_blocks.size()) b.stacked = recipe.param_stack_blocks[i];
  return b;
}

// One AdamW step (torch.optim.AdamW); t is the 1-based step count.
inline void AdamWStep(const RefAdamWOptions& opt, int64_t t, const std::vector<double>& grad,
                      std::vector<double>* m, std::vector<double>* v, std::vector<double>* param) {
  const size_t size = grad.size();
  internal::Require(m->size() == size && v->size() == size && param->size() == size,
                    "AdamW buffers have the wrong size");
  internal::Require(t >= 1, "AdamW step count starts at 1");
  const double bc1 = 1.0 - std::pow(opt.beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(opt.beta2, static_cast<double>(t));
  for (size_t k = 0; k < size; ++k) {
    (*param)[k] *= 1.0 - opt.lr * opt.weight_decay;
    (*m)[k] = opt.beta1 * (*m)[k] + (1.0 - opt.beta1) * grad[k];
    (*v)[k] = opt.beta2 * (*v)[k] + (1.0 - opt.beta2) * grad[k] * grad[k];
    (*param)[k] -= opt.lr * ((*m)[k] / bc1) / (std::sqrt((*v)[k] / bc2) + opt.eps);
  }
}

// Trains the mlp `dims` from `init` (flat order) on x [N, d_0], y [N, d_L]
// for `steps` steps of batch B, as the header comment describes.
// `use_muon[i]` picks Muon (true) or AdamW (false) for parameter i; empty
// means Muon for every weight and AdamW for every bias.
inline RefTrainResult ReferenceTrain(const std::vector<int64_t>& dims, const Tensors& init,
                                     const std::vector<double>& x, const std::vector<double>& y,
                                     int64_t N, int64_t steps, int64_t B,
                                     const RefMuonOptions& muon, const RefAdamWOptions& adamw,
                                     std::vector<bool> use_muon = {},
                                     const RefRecipe& recipe = {}) {
  internal::CheckMlp(dims, init);
  internal::Require(N >= 1 && x.size() == static_cast<size_t>(N * dims.front()) &&
                        y.size() == static_cast<size_t>(N * dims.back()),
                    "x, y are not [N, d_in], [N, d_out]");
  internal::Require(steps >= 0 && B >= 1, "steps < 0 or B < 1");
  if (use_muon.empty()) {
    for (size_t i = 0; i < init.size(); ++i) use_muon.push_back(i % 2 == 0);
  }
  internal::Require(use_muon.size() == init.size(), "use_muon has the wrong size");
  for (size_t i = 0; i < init.size(); ++i) {
    internal::Require(!use_muon[i] || i % 2 == 0, "Muon on a bias (not a matrix)");
  }

  RefTrainResult result;
  result.params = init;
  Tensors m1(init.size());
  Tensors m2(init.size());
  for (size_t i = 0; i < init.size(); ++i) {
    m1[i].assign(init[i].size(), 0.0);
    m2[i].assign(init[i].size(), 0.0);
  }
  std::vector<int64_t> batch(static_cast<size_t>(B));
  Tensors grads;
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t j = 0; j < B; ++j) batch[j] = (s * B + j) % N;
    result.losses.push_back(MlpLossAndGrad(dims, result.params, x, y, batch, &grads));
    RefMuonOptions muon_s = muon;
    RefAdamWOptions adamw_s = adamw;
    ApplyRecipe(recipe, s, &muon_s, &adamw_s, &grads, &result);
    for (size_t i = 0; i < init.size(); ++i) {
      if (use_muon[i]) {
        const size_t layer = i / 2;
        MuonStepBlocks(ForParam(recipe, i, muon_s), dims[layer + 1], dims[layer],
                       BlockRows(recipe, i), grads[i], &m1[i], &result.params[i]);
      } else {
        AdamWStep(ForParam(recipe, i, adamw_s), s + 1, grads[i], &m1[i], &m2[i],
                  &result.params[i]);
      }
    }
  }
  return result;
}

}  // namespace muonmesh::reference
