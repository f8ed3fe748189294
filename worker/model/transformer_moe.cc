#include "worker/model/transformer_moe.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/model/expert_groups.h"
#include "worker/model/host_ops.h"

namespace muonmesh::worker {
namespace {

// A group may announce at most this many tokens (a peer's count is a float).
constexpr float kMaxAnnounced = 16777216.0f;  // 2^24

// Grows v to at least n elements.
template <typename T>
T* Grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

// Router logits into scores in place: sigmoid, or softmax with the max,
// the exps and their sum in double, each rounded once.
void Scores(model::RouterScore score, int64_t e_n, float* p) {
  if (score == model::RouterScore::kSigmoid) {
    for (int64_t e = 0; e < e_n; ++e) {
      p[e] = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(p[e]))));
    }
    return;
  }
  const double top = *std::max_element(p, p + e_n);
  double z = 0.0;
  for (int64_t e = 0; e < e_n; ++e) z += std::exp(static_cast<double>(p[e]) - top);
  for (int64_t e = 0; e < e_n; ++e) {
    p[e] = static_cast<float>(std::exp(static_cast<double>(p[e]) - top) / z);
  }
}

}  // namespace

MoeLayer::MoeLayer(const model::TransformerDims& dims)
    : dims_(dims),
      e_(dims.moe->n_routed_experts),
      k_(dims.moe->top_k),
      fe_(dims.moe->moe_ffn_hidden),
      fs_(dims.moe->n_shared_experts * dims.moe->moe_ffn_hidden),
      c_(dims.d_model),
      bias_(static_cast<size_t>(e_), 0.0f),
      counts_(static_cast<size_t>(e_), 0.0f) {}

void MoeLayer::ResetCounts() { std::fill(counts_.begin(), counts_.end(), 0.0f); }

void MoeLayer::UpdateBias(absl::Span<const float> global) {
  const double rate = dims_.moe->bias_update_rate;
  if (rate == 0.0 || global.size() != bias_.size()) return;
  double mean = 0.0;
  for (float c : global) mean += c;
  mean /= static_cast<double>(e_);
  for (int64_t e = 0; e < e_; ++e) {
    const double gap = mean - static_cast<double>(global[e]);
    const double sign = gap > 0 ? 1.0 : gap < 0 ? -1.0 : 0.0;
    bias_[e] = static_cast<float>(static_cast<double>(bias_[e]) + rate * sign);
  }
}

double MoeLayer::Route(int64_t n, const float* m, const float* router, bool record) {
  const model::MoeDims& moe = *dims_.moe;
  const int64_t t_len = dims_.seq_len;
  float* probs = Grow(probs_, rows_ * e_);
  LinearNoBias(rows_, c_, e_, m, router, probs);
  Grow(chosen_, rows_ * k_);
  Grow(gates_, rows_ * k_);
  Grow(sums_, rows_);
  f_.assign(static_cast<size_t>(n * e_), 0.0);
  std::vector<double> mean(static_cast<size_t>(e_));
  double aux = 0.0;
  for (int64_t r = 0; r < rows_; ++r) {
    float* p = probs + r * e_;
    Scores(moe.score, e_, p);
    // The K largest p_e + b_e, lowest index first among equals.
    int32_t* chosen = chosen_.data() + r * k_;
    double sum = 0.0;
    for (int64_t k = 0; k < k_; ++k) {
      int32_t best = -1;
      double key = -std::numeric_limits<double>::infinity();
      for (int64_t e = 0; e < e_; ++e) {
        if (std::find(chosen, chosen + k, e) != chosen + k) continue;
        const double v = static_cast<double>(p[e]) + static_cast<double>(bias_[e]);
        if (best < 0 || v > key) {
          best = static_cast<int32_t>(e);
          key = v;
        }
      }
      chosen[k] = best;
      sum += p[best];
    }
    sums_[r] = sum;
    const int64_t sample = r / t_len;
    for (int64_t k = 0; k < k_; ++k) {
      const double g = moe.route_scale * p[chosen[k]] / (moe.norm_topk_prob ? sum : 1.0);
      gates_[r * k_ + k] = static_cast<float>(g);
      f_[sample * e_ + chosen[k]] += static_cast<double>(e_) / static_cast<double>(k_ * t_len);
      if (record) counts_[chosen[k]] += 1.0f;
    }
    if (moe.aux_loss_coef > 0) {
      double z = 0.0;
      for (int64_t e = 0; e < e_; ++e) z += p[e];
      for (int64_t e = 0; e < e_; ++e) mean[e] += p[e] / z / static_cast<double>(t_len);
      if ((r + 1) % t_len == 0) {
        for (int64_t e = 0; e < e_; ++e) aux += moe.aux_loss_coef * f_[sample * e_ + e] * mean[e];
        std::fill(mean.begin(), mean.end(), 0.0);
      }
    }
  }
  return aux;
}

absl::Status MoeLayer::Dispatch(UnitAccess& units, MoeExchange& ex, int ep, int64_t local) {
  // Assignments a = r K + k, stably by expert.
  const int64_t total = rows_ * k_;
  std::vector<int64_t> begin(static_cast<size_t>(e_ + 1), 0);
  for (int64_t a = 0; a < total; ++a) ++begin[chosen_[a] + 1];
  for (int64_t e = 0; e < e_; ++e) begin[e + 1] += begin[e];
  order_.resize(static_cast<size_t>(total));
  std::vector<int64_t> next(begin.begin(), begin.end() - 1);
  for (int64_t a = 0; a < total; ++a) order_[next[chosen_[a]]++] = a;
  send_tokens_.assign(static_cast<size_t>(ep), 0);
  for (int q = 0; q < ep; ++q) send_tokens_[q] = begin[(q + 1) * local] - begin[q * local];
  Grow(ex.counts_send, ep);
  Grow(ex.counts_recv, ep);
  for (int q = 0; q < ep; ++q) ex.counts_send[q] = static_cast<float>(send_tokens_[q]);
  std::vector<int64_t> ones(static_cast<size_t>(ep), 1);
  MUONMESH_RETURN_IF_ERROR(
      units.ExchangeTokens(ex.counts_send.data(), ones, ex.counts_recv.data(), ones));
  recv_tokens_.assign(static_cast<size_t>(ep), 0);
  received_ = 0;
  for (int q = 0; q < ep; ++q) {
    const float c = ex.counts_recv[q];
    if (!(c >= 0.0f && c <= kMaxAnnounced) || c != std::floor(c)) {
      return absl::InternalError(absl::StrCat("transformer moe: expert-parallel group ", q,
                                              " announced ", c, " tokens"));
    }
    recv_tokens_[q] = static_cast<int64_t>(c);
    received_ += recv_tokens_[q];
  }
  return absl::OkStatus();
}

absl::StatusOr<double> MoeLayer::Forward(UnitAccess& units, MoeExchange& ex, int64_t n,
                                         const float* m, const MoeWeights& w, bool record,
                                         float* out) {
  const int ep = units.expert_parallel_size();
  if (ep < 1 || e_ % ep != 0) {
    return absl::InvalidArgumentError(absl::StrCat("transformer moe: ", e_,
                                                   " experts do not split over ", ep,
                                                   " expert-parallel groups"));
  }
  const int64_t local = e_ / ep;
  rows_ = n * dims_.seq_len;
  if (fs_ > 0) {
    LinearNoBias(rows_, c_, fs_, m, w.shared_gate, Grow(sh_gate_, rows_ * fs_));
    LinearNoBias(rows_, c_, fs_, m, w.shared_up, Grow(sh_up_, rows_ * fs_));
    SwiGlu(rows_ * fs_, sh_gate_.data(), sh_up_.data(), Grow(sh_m_, rows_ * fs_));
    LinearNoBias(rows_, fs_, c_, sh_m_.data(), w.shared_down, Grow(ex.tmp, rows_ * c_));
    for (int64_t i = 0; i < rows_ * c_; ++i) out[i] += ex.tmp[i];
  }
  const double aux = Route(n, m, w.router, record);
  MUONMESH_RETURN_IF_ERROR(Dispatch(units, ex, ep, local));
  // Tokens out: [local expert | m row], in dispatch order.
  const int64_t total = rows_ * k_;
  float* send = Grow(ex.send, total * (c_ + 1));
  for (int64_t j = 0; j < total; ++j) {
    const int64_t a = order_[j];
    float* row = send + j * (c_ + 1);
    row[0] = static_cast<float>(chosen_[a] % local);
    std::copy(m + (a / k_) * c_, m + (a / k_ + 1) * c_, row + 1);
  }
  std::vector<int64_t> out_counts(static_cast<size_t>(ep)), in_counts(static_cast<size_t>(ep));
  for (int q = 0; q < ep; ++q) {
    out_counts[q] = send_tokens_[q] * (c_ + 1);
    in_counts[q] = recv_tokens_[q] * (c_ + 1);
  }
  MUONMESH_RETURN_IF_ERROR(units.ExchangeTokens(
      send, out_counts, Grow(ex.recv, received_ * (c_ + 1)), in_counts));
  MUONMESH_RETURN_IF_ERROR(internal::GroupByLocalExpert(ex.recv.data(), c_ + 1, received_, local,
                                                        &ex_local_, &ex_begin_, &ex_order_));
  ExpertsForward(ex, local, w);
  // Outputs home: C floats per token, back in dispatch order.
  for (int q = 0; q < ep; ++q) {
    out_counts[q] = recv_tokens_[q] * c_;
    in_counts[q] = send_tokens_[q] * c_;
  }
  MUONMESH_RETURN_IF_ERROR(units.ExchangeTokens(ex.recv.data(), out_counts, ex.send.data(),
                                                in_counts));
  Grow(y_, total * c_);
  for (int64_t j = 0; j < total; ++j) {
    std::copy(ex.send.data() + j * c_, ex.send.data() + (j + 1) * c_, y_.data() + order_[j] * c_);
  }
  for (int64_t r = 0; r < rows_; ++r) {
    float* o = out + r * c_;
    for (int64_t k = 0; k < k_; ++k) {
      const float g = gates_[r * k_ + k];
      const float* y = y_.data() + (r * k_ + k) * c_;
      for (int64_t i = 0; i < c_; ++i) o[i] += g * y[i];
    }
  }
  return aux;
}

void MoeLayer::ExpertsForward(MoeExchange& ex, int64_t local, const MoeWeights& w) {
  // The received tokens' inputs grouped by expert; each expert's outputs
  // back into ex.recv at the token's arrival position (C floats each).
  float* x = Grow(ex_x_, received_ * c_);
  for (int64_t j = 0; j < received_; ++j) {
    const float* row = ex.recv.data() + ex_order_[j] * (c_ + 1) + 1;
    std::copy(row, row + c_, x + j * c_);
  }
  Grow(ex_gate_, received_ * fe_);
  Grow(ex_up_, received_ * fe_);
  Grow(ex_m_, received_ * fe_);
  float* y = Grow(ex.tmp, received_ * c_);
  for (int64_t l = 0; l < local; ++l) {
    const int64_t j0 = ex_begin_[l];
    const int64_t cnt = ex_begin_[l + 1] - j0;
    if (cnt == 0) continue;
    LinearNoBias(cnt, c_, fe_, x + j0 * c_, w.gate + l * fe_ * c_, ex_gate_.data() + j0 * fe_);
    LinearNoBias(cnt, c_, fe_, x + j0 * c_, w.up + l * fe_ * c_, ex_up_.data() + j0 * fe_);
    SwiGlu(cnt * fe_, ex_gate_.data() + j0 * fe_, ex_up_.data() + j0 * fe_,
           ex_m_.data() + j0 * fe_);
    LinearNoBias(cnt, fe_, c_, ex_m_.data() + j0 * fe_, w.down + l * c_ * fe_, y + j0 * c_);
  }
  float* back = Grow(ex.recv, received_ * c_);
  for (int64_t j = 0; j < received_; ++j) {
    std::copy(y + j * c_, y + (j + 1) * c_, back + ex_order_[j] * c_);
  }
}

absl::Status MoeLayer::Backward(UnitAccess& units, MoeExchange& ex, const float* m,
                                const MoeWeights& w, const float* dout, double aux_weight,
                                const MoeGrads& g, float* dm) {
  const int ep = units.expert_parallel_size();
  const int64_t local = e_ / ep;
  const int64_t total = rows_ * k_;
  if (fs_ > 0) {
    float* dsm = Grow(ex.tmp2, rows_ * fs_);
    LinearNoBiasBackward(rows_, fs_, c_, dout, sh_m_.data(), w.shared_down, g.shared_down, dsm,
                         false);
    float* dup = Grow(ex.tmp, rows_ * fs_);
    SwiGluBackward(rows_ * fs_, sh_gate_.data(), sh_up_.data(), dsm, dsm, dup);
    LinearNoBiasBackward(rows_, c_, fs_, dsm, m, w.shared_gate, g.shared_gate, dm, false);
    LinearNoBiasBackward(rows_, c_, fs_, dup, m, w.shared_up, g.shared_up, dm, true);
  } else {
    std::fill(dm, dm + rows_ * c_, 0.0f);
  }
  // Each assignment's gate gradient dout . y, and g dout out in dispatch order.
  ex.dgate.assign(static_cast<size_t>(total), 0.0);
  float* send = Grow(ex.send, total * c_);
  for (int64_t j = 0; j < total; ++j) {
    const int64_t a = order_[j];
    const float* d = dout + (a / k_) * c_;
    const float* y = y_.data() + a * c_;
    double dot = 0.0;
    for (int64_t i = 0; i < c_; ++i) dot += static_cast<double>(d[i]) * y[i];
    ex.dgate[a] = dot;
    const float gate = gates_[a];
    for (int64_t i = 0; i < c_; ++i) send[j * c_ + i] = gate * d[i];
  }
  std::vector<int64_t> out_counts(static_cast<size_t>(ep)), in_counts(static_cast<size_t>(ep));
  for (int q = 0; q < ep; ++q) {
    out_counts[q] = send_tokens_[q] * c_;
    in_counts[q] = recv_tokens_[q] * c_;
  }
  MUONMESH_RETURN_IF_ERROR(
      units.ExchangeTokens(send, out_counts, Grow(ex.recv, received_ * c_), in_counts));
  ExpertsBackward(ex, local, ep, w, g);
  MUONMESH_RETURN_IF_ERROR(
      units.ExchangeTokens(ex.recv.data(), in_counts, ex.send.data(), out_counts));
  for (int64_t j = 0; j < total; ++j) {
    const float* d = ex.send.data() + j * c_;
    float* row = dm + (order_[j] / k_) * c_;
    for (int64_t i = 0; i < c_; ++i) row[i] += d[i];
  }
  ScoreGradients(ex.dgate.data(), aux_weight);
  LinearNoBiasBackward(rows_, c_, e_, probs_.data(), m, w.router, g.router, dm, true);
  return absl::OkStatus();
}

void MoeLayer::ExpertsBackward(MoeExchange& ex, int64_t local, int ep, const MoeWeights& w,
                               const MoeGrads& g) {
  // dy of the received tokens grouped by expert; dL/dx back into ex.recv at
  // the arrival positions.
  float* dy = Grow(ex.tmp, received_ * c_);
  for (int64_t j = 0; j < received_; ++j) {
    const float* row = ex.recv.data() + ex_order_[j] * c_;
    std::copy(row, row + c_, dy + j * c_);
  }
  float* dhm = Grow(ex.tmp2, received_ * fe_);
  float* dup = Grow(ex.tmp3, received_ * fe_);
  float* dx = Grow(ex.dx, received_ * c_);
  const float scale = 1.0f / static_cast<float>(ep);
  for (int64_t l = 0; l < local; ++l) {
    const int64_t j0 = ex_begin_[l];
    const int64_t cnt = ex_begin_[l + 1] - j0;
    float* gg = g.gate + l * fe_ * c_;
    float* gu = g.up + l * fe_ * c_;
    float* gd = g.down + l * c_ * fe_;
    if (cnt == 0) {
      std::fill(gg, gg + fe_ * c_, 0.0f);
      std::fill(gu, gu + fe_ * c_, 0.0f);
      std::fill(gd, gd + c_ * fe_, 0.0f);
      continue;
    }
    LinearNoBiasBackward(cnt, fe_, c_, dy + j0 * c_, ex_m_.data() + j0 * fe_,
                         w.down + l * c_ * fe_, gd, dhm + j0 * fe_, false);
    SwiGluBackward(cnt * fe_, ex_gate_.data() + j0 * fe_, ex_up_.data() + j0 * fe_,
                   dhm + j0 * fe_, dhm + j0 * fe_, dup + j0 * fe_);
    LinearNoBiasBackward(cnt, c_, fe_, dhm + j0 * fe_, ex_x_.data() + j0 * c_,
                         w.gate + l * fe_ * c_, gg, dx + j0 * c_, false);
    LinearNoBiasBackward(cnt, c_, fe_, dup + j0 * fe_, ex_x_.data() + j0 * c_,
                         w.up + l * fe_ * c_, gu, dx + j0 * c_, true);
    if (ep > 1) {
      for (float* t : {gg, gu, gd}) {
        for (int64_t i = 0; i < fe_ * c_; ++i) t[i] *= scale;
      }
    }
  }
  for (int64_t j = 0; j < received_; ++j) {
    std::copy(dx + j * c_, dx + (j + 1) * c_, ex.recv.data() + ex_order_[j] * c_);
  }
}

void MoeLayer::ScoreGradients(const double* dgate, double aux_weight) {
  const model::MoeDims& moe = *dims_.moe;
  const int64_t t_len = dims_.seq_len;
  std::vector<double> dp(static_cast<size_t>(e_));
  for (int64_t r = 0; r < rows_; ++r) {
    float* p = probs_.data() + r * e_;  // the scores; dL/ds on return
    std::fill(dp.begin(), dp.end(), 0.0);
    const int32_t* chosen = chosen_.data() + r * k_;
    const double sum = sums_[r];
    double weighted = 0.0;  // sum_k dg_k p_k
    for (int64_t k = 0; k < k_; ++k) weighted += dgate[r * k_ + k] * p[chosen[k]];
    for (int64_t k = 0; k < k_; ++k) {
      const double dg = dgate[r * k_ + k];
      dp[chosen[k]] += moe.norm_topk_prob ? moe.route_scale * (dg / sum - weighted / (sum * sum))
                                          : moe.route_scale * dg;
    }
    if (moe.aux_loss_coef > 0) {
      // P_e averages p_e / z: dL/d(p_e / z) = w alpha f_e / T.
      const double* f = f_.data() + (r / t_len) * e_;
      double z = 0.0;
      for (int64_t e = 0; e < e_; ++e) z += p[e];
      const double w = aux_weight * moe.aux_loss_coef / static_cast<double>(t_len);
      double dot = 0.0;
      for (int64_t e = 0; e < e_; ++e) dot += w * f[e] * p[e] / z;
      for (int64_t e = 0; e < e_; ++e) dp[e] += (w * f[e] - dot) / z;
    }
    double pdp = 0.0;
    for (int64_t e = 0; e < e_; ++e) pdp += p[e] * dp[e];
    for (int64_t e = 0; e < e_; ++e) {
      const double pe = p[e];
      p[e] = static_cast<float>(moe.score == model::RouterScore::kSigmoid ? dp[e] * pe * (1.0 - pe)
                                                                          : pe * (dp[e] - pdp));
    }
  }
}

}  // namespace muonmesh::worker
