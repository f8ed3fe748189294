#include "worker/model/moe_mlp.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/model/checks.h"
#include "worker/model/expert_groups.h"
#include "worker/model/rng.h"

namespace muonmesh::worker {
namespace {

using internal::AnyNull;
using internal::CheckFinite;

constexpr uint64_t kTeacherInputStream = 1'000'000;
constexpr int kNumParams = 7;
constexpr int kUnitParams[3] = {2, 3, 2};  // parameters per unit
constexpr int kUnitFirst[3] = {0, 2, 5};   // flat index of each unit's first

// C [m, n] = alpha * op(A) op(B) + beta * C, row-major, k the inner size.
// op(A) is A [m, k] or, transposed, A [k, m]; op(B) is B [k, n] or B [n, k].
void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, const float* b, float beta, float* c) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, a, static_cast<int>(trans_a ? m : k), b,
              static_cast<int>(trans_b ? k : n), beta, c, static_cast<int>(n));
}

std::vector<std::vector<int64_t>> Shapes(const MoeMlpDims& d) { return model::MoeMlpShapes(d); }

int64_t FanIn(const MoeMlpDims& d, int p) {
  if (p <= 1) return d.d_in;
  if (p == 4) return d.d_expert;
  return d.d_model;
}

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t v : shape) n *= v;
  return n;
}

void InitParam(const MoeMlpDims& d, uint64_t seed, int p, float* out) {
  const int64_t n = Elements(Shapes(d)[p]);
  const double root = std::sqrt(static_cast<double>(FanIn(d, p)));
  const UniformStream s(seed, static_cast<uint64_t>(p));
  for (int64_t k = 0; k < n; ++k) {
    out[k] = static_cast<float>(static_cast<double>(s.At(static_cast<uint64_t>(k))) / root);
  }
}


// out[c] = float(sum over rows r, in order, of double(x[r, c])): a bias
// gradient.
void ColumnSums(const float* x, int64_t n, int64_t width, float* out) {
  for (int64_t c = 0; c < width; ++c) {
    double sum = 0.0;
    for (int64_t r = 0; r < n; ++r) sum += x[r * width + c];
    out[c] = static_cast<float>(sum);
  }
}

absl::Status CheckTensors(absl::Span<const float* const> ts, const char* what) {
  if (ts.size() != kNumParams || AnyNull(ts)) {
    return absl::InvalidArgumentError(absl::StrCat("moe_mlp: ", what, " must be ", kNumParams,
                                                   " non-null tensors, got ", ts.size()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::vector<float>>> MoeMlpInitialParams(const MoeMlpDims& d,
                                                                    uint64_t seed) {
  MUONMESH_RETURN_IF_ERROR(ValidateMoeMlpDims(d));
  std::vector<std::vector<float>> out;
  const std::vector<std::vector<int64_t>> shapes = Shapes(d);
  for (int p = 0; p < kNumParams; ++p) {
    out.emplace_back(static_cast<size_t>(Elements(shapes[p])));
    InitParam(d, seed, p, out.back().data());
  }
  return out;
}

void RouteTokens(float* probs, int64_t n, int64_t num_experts, MoeRouting* r) {
  r->expert.resize(n);
  r->gate.resize(n);
  r->per_expert.assign(num_experts + 1, 0);
  for (int64_t s = 0; s < n; ++s) {
    float* row = probs + s * num_experts;
    double m = row[0];
    for (int64_t j = 1; j < num_experts; ++j) m = std::max(m, static_cast<double>(row[j]));
    double sum = 0.0;
    for (int64_t j = 0; j < num_experts; ++j) sum += std::exp(static_cast<double>(row[j]) - m);
    int32_t best = 0;
    for (int64_t j = 0; j < num_experts; ++j) {
      row[j] = static_cast<float>(std::exp(static_cast<double>(row[j]) - m) / sum);
      if (row[j] > row[best]) best = static_cast<int32_t>(j);
    }
    r->expert[s] = best;
    r->gate[s] = row[best];
    ++r->per_expert[best + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) r->per_expert[e + 1] += r->per_expert[e];
  r->order.resize(n);
  std::vector<int64_t> next(r->per_expert.begin(), r->per_expert.end() - 1);
  for (int64_t s = 0; s < n; ++s) r->order[next[r->expert[s]]++] = s;
}

void RouterLogitGradient(const float* probs, const MoeRouting& r, const double* dgate, int64_t n,
                         int64_t num_experts, float* dlogits) {
  for (int64_t s = 0; s < n; ++s) {
    const float* gs = probs + s * num_experts;
    const double ge = gs[r.expert[s]];
    for (int64_t j = 0; j < num_experts; ++j) {
      const double delta = j == r.expert[s] ? 1.0 : 0.0;
      dlogits[s * num_experts + j] = static_cast<float>(ge * (delta - gs[j]) * dgate[s]);
    }
  }
}

// ---------------------------------------------------------------- MoeMlp

MoeMlp::MoeMlp(const MoeMlpDims& dims, std::vector<float> x, std::vector<float> y,
               plan::ModelSpec spec)
    : dims_(dims),
      x_(std::move(x)),
      y_(std::move(y)),
      num_samples_(static_cast<int64_t>(x_.size()) / dims.d_in),
      spec_(std::move(spec)) {}

absl::StatusOr<MoeMlp> MoeMlp::Create(const MoeMlpDims& dims, std::vector<float> x,
                                      std::vector<float> y) {
  MUONMESH_ASSIGN_OR_RETURN(plan::ModelSpec spec, MoeMlpSpec(dims));
  const int64_t x_size = static_cast<int64_t>(x.size());
  if (x_size == 0 || x_size % dims.d_in != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "moe_mlp data: x has ", x_size, " elements, not a positive multiple of d_in = ",
        dims.d_in));
  }
  const int64_t n = x_size / dims.d_in;
  if (n > kMoeMaxElements / std::max(dims.d_in, std::max(dims.d_model, dims.d_out))) {
    return absl::InvalidArgumentError(
        absl::StrCat("moe_mlp data: ", n, " samples exceed ", kMoeMaxElements,
                     " elements per tensor"));
  }
  if (static_cast<int64_t>(y.size()) != n * dims.d_out) {
    return absl::InvalidArgumentError(absl::StrCat("moe_mlp data: y has ", y.size(),
                                                   " elements, expected N * d_out = ", n, " * ",
                                                   dims.d_out, " = ", n * dims.d_out));
  }
  MUONMESH_RETURN_IF_ERROR(CheckFinite(x, "moe_mlp data: x"));
  MUONMESH_RETURN_IF_ERROR(CheckFinite(y, "moe_mlp data: y"));
  return MoeMlp(dims, std::move(x), std::move(y), std::move(spec));
}

absl::StatusOr<MoeMlp> MoeMlp::FromTeacher(const MoeMlpDims& dims, uint64_t teacher_seed,
                                           int64_t samples) {
  MUONMESH_RETURN_IF_ERROR(ValidateMoeMlpDims(dims));
  const int64_t limit =
      std::min(kMoeMaxSamplesPerCall,
               kMoeMaxElements / std::max(dims.d_in, std::max(dims.d_model, dims.d_out)));
  if (samples < 1 || samples > limit) {
    return absl::InvalidArgumentError(absl::StrCat("moe_mlp teacher: samples = ", samples,
                                                   " is not in [1, ", limit, "]"));
  }
  std::vector<float> x(static_cast<size_t>(samples * dims.d_in));
  UniformStream(teacher_seed, kTeacherInputStream).Fill(0, samples * dims.d_in, 1.0, x.data());
  MUONMESH_ASSIGN_OR_RETURN(std::vector<std::vector<float>> teacher,
                            MoeMlpInitialParams(dims, teacher_seed + 1));
  MUONMESH_ASSIGN_OR_RETURN(
      MoeMlp probe,
      Create(dims, x, std::vector<float>(static_cast<size_t>(samples * dims.d_out), 0.0f)));
  std::vector<const float*> ptrs;
  for (const std::vector<float>& t : teacher) ptrs.push_back(t.data());
  MUONMESH_ASSIGN_OR_RETURN(std::vector<float> y, probe.Forward(ptrs, samples));
  return Create(dims, std::move(x), std::move(y));
}

absl::Status MoeMlp::Initialize(uint64_t seed, absl::Span<float* const> params) const {
  if (params.size() != kNumParams || AnyNull(params)) {
    return absl::InvalidArgumentError(absl::StrCat("moe_mlp init: need ", kNumParams,
                                                   " non-null tensors, got ", params.size()));
  }
  for (int p = 0; p < kNumParams; ++p) InitParam(dims_, seed, p, params[p]);
  return absl::OkStatus();
}

absl::Status MoeMlp::InitializeUnit(uint64_t seed, int unit,
                                    absl::Span<float* const> params) const {
  if (unit < 0 || unit > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("moe_mlp init: unit ", unit, " is outside [0, 3)"));
  }
  if (static_cast<int>(params.size()) != kUnitParams[unit] || AnyNull(params)) {
    return absl::InvalidArgumentError(absl::StrCat("moe_mlp init: unit ", unit, " needs ",
                                                   kUnitParams[unit], " non-null tensors, got ",
                                                   params.size()));
  }
  for (int j = 0; j < kUnitParams[unit]; ++j) {
    InitParam(dims_, seed, kUnitFirst[unit] + j, params[j]);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> MoeMlp::Forward(absl::Span<const float* const> params,
                                                   int64_t n) {
  MUONMESH_RETURN_IF_ERROR(CheckTensors(params, "params"));
  if (n < 1 || n > num_samples_) {
    return absl::InvalidArgumentError(
        absl::StrCat("moe_mlp forward: n = ", n, " is not in [1, ", num_samples_, "]"));
  }
  std::vector<int64_t> samples(static_cast<size_t>(n));
  for (int64_t s = 0; s < n; ++s) samples[s] = s;
  WholeModelAccess units(spec_, params, {});
  MUONMESH_RETURN_IF_ERROR(
      RunMoeMlpPasses(dims_, num_samples_, *this, units, samples, /*gradients=*/false).status());
  return std::vector<float>(y_out_.begin(), y_out_.begin() + n * dims_.d_out);
}

absl::StatusOr<double> MoeMlp::ForwardBackward(int64_t step,
                                               absl::Span<const float* const> params,
                                               absl::Span<const int64_t> samples,
                                               absl::Span<float* const> grads) {
  MUONMESH_RETURN_IF_ERROR(CheckTensors(params, "params"));
  if (grads.size() != kNumParams || AnyNull(grads)) {
    return absl::InvalidArgumentError(absl::StrCat("moe_mlp: grads must be ", kNumParams,
                                                   " non-null tensors, got ", grads.size()));
  }
  WholeModelAccess units(spec_, params, grads);
  return ForwardBackwardByUnit(step, units, samples);
}

absl::StatusOr<double> MoeMlp::ForwardBackwardByUnit(int64_t /*step*/, UnitAccess& units,
                                                     absl::Span<const int64_t> samples) {
  return RunMoeMlpPasses(dims_, num_samples_, *this, units, samples, /*gradients=*/true);
}

absl::Status MoeMlp::Gather(absl::Span<const int64_t> samples, int /*ep*/) {
  const int64_t n = static_cast<int64_t>(samples.size());
  const int64_t d_in = dims_.d_in;
  xs_.resize(n * d_in);
  for (int64_t s = 0; s < n; ++s) {
    std::copy_n(x_.data() + samples[s] * d_in, d_in, xs_.data() + s * d_in);
  }
  return absl::OkStatus();
}

absl::Status MoeMlp::InputForward(int64_t n, const float* weight, const float* bias) {
  const int64_t d = dims_.d_model;
  h_.resize(n * d);
  Gemm(false, true, n, d, dims_.d_in, 1.0f, xs_.data(), weight, 0.0f, h_.data());
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t j = 0; j < d; ++j) h_[s * d + j] = std::tanh(h_[s * d + j] + bias[j]);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> MoeMlp::Route(int64_t n, int ep, const float* w_router) {
  const int64_t e_total = dims_.num_experts;
  const int64_t local = e_total / ep;
  g_.resize(n * e_total);
  Gemm(false, true, n, e_total, dims_.d_model, 1.0f, h_.data(), w_router, 0.0f, g_.data());
  RouteTokens(g_.data(), n, e_total, &routing_);
  std::vector<int64_t> send_tokens(ep);
  count_send_.assign(ep, 0.0f);
  count_recv_.assign(ep, 0.0f);
  for (int q = 0; q < ep; ++q) {
    send_tokens[q] = routing_.per_expert[(q + 1) * local] - routing_.per_expert[q * local];
    count_send_[q] = static_cast<float>(send_tokens[q]);
  }
  local_experts_ = local;
  return send_tokens;
}

absl::StatusOr<std::vector<float>> MoeMlp::ReceivedCounts(int /*ep*/) { return count_recv_; }

absl::Status MoeMlp::PackTokens(int64_t n, int64_t received) {
  const int64_t d = dims_.d_model;
  const int64_t row = d + 1;  // local expert id, then h
  send_.resize(std::max<int64_t>(n * row, 1));
  recv_.resize(std::max<int64_t>(received * row, 1));
  for (int64_t j = 0; j < n; ++j) {
    const int64_t s = routing_.order[j];
    send_[j * row] = static_cast<float>(routing_.expert[s] % local_experts_);
    std::copy_n(h_.data() + s * d, d, send_.data() + j * row + 1);
  }
  return absl::OkStatus();
}

absl::Status MoeMlp::ExpertsForward(int64_t received, int64_t local, const float* w1,
                                    const float* w2) {
  // Expert side: group the received tokens by local expert.
  const int64_t d = dims_.d_model;
  const int64_t row = d + 1;
  MUONMESH_RETURN_IF_ERROR(internal::GroupByLocalExpert(recv_.data(), row, received, local,
                                                        &ex_local_, &ex_begin_, &ex_order_));
  ex_h_.resize(std::max<int64_t>(received * d, 1));
  for (int64_t i = 0; i < received; ++i) {
    std::copy_n(recv_.data() + static_cast<int64_t>(ex_order_[i]) * row + 1, d,
                ex_h_.data() + i * d);
  }
  RunExperts(w1, w2);
  return absl::OkStatus();
}

void MoeMlp::RunExperts(const float* w1, const float* w2) {
  const int64_t d = dims_.d_model;
  const int64_t de = dims_.d_expert;
  const int64_t local = static_cast<int64_t>(ex_begin_.size()) - 1;
  const int64_t received = static_cast<int64_t>(ex_local_.size());
  ex_a_.resize(std::max<int64_t>(received * de, 1));
  std::vector<float> ex_o(std::max<int64_t>(received * d, 1));
  for (int64_t l = 0; l < local; ++l) {
    const int64_t b = ex_begin_[l];
    const int64_t c = ex_begin_[l + 1] - b;
    if (c == 0) continue;
    float* a = ex_a_.data() + b * de;
    Gemm(false, true, c, de, d, 1.0f, ex_h_.data() + b * d, w1 + l * de * d, 0.0f, a);
    for (int64_t k = 0; k < c * de; ++k) a[k] = std::tanh(a[k]);
    Gemm(false, true, c, d, de, 1.0f, a, w2 + l * d * de, 0.0f, ex_o.data() + b * d);
  }
  // Back in the order received (recv_ is free: the inputs were copied out).
  for (int64_t i = 0; i < received; ++i) {
    std::copy_n(ex_o.data() + i * d, d, recv_.data() + static_cast<int64_t>(ex_order_[i]) * d);
  }
}

absl::Status MoeMlp::Combine(int64_t n) {
  const int64_t d = dims_.d_model;
  o_.resize(n * d);
  z_.resize(n * d);
  for (int64_t j = 0; j < n; ++j) {
    std::copy_n(send_.data() + j * d, d, o_.data() + routing_.order[j] * d);
  }
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t k = 0; k < d; ++k) {
      z_[s * d + k] = h_[s * d + k] + routing_.gate[s] * o_[s * d + k];
    }
  }
  return absl::OkStatus();
}

absl::Status MoeMlp::OutputLayer(int64_t n, const float* weight, const float* bias) {
  const int64_t d_out = dims_.d_out;
  y_out_.resize(n * d_out);
  Gemm(false, true, n, d_out, dims_.d_model, 1.0f, z_.data(), weight, 0.0f, y_out_.data());
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t o = 0; o < d_out; ++o) y_out_[s * d_out + o] += bias[o];
  }
  return absl::OkStatus();
}

absl::StatusOr<double> MoeMlp::OutputLoss(absl::Span<const int64_t> samples) {
  const int64_t n = static_cast<int64_t>(samples.size());
  const int64_t d_out = dims_.d_out;
  const double denom = static_cast<double>(n) * static_cast<double>(d_out);
  double loss_sum = 0.0;
  dy_.resize(n * d_out);
  for (int64_t s = 0; s < n; ++s) {
    const float* target = y_.data() + samples[s] * d_out;
    for (int64_t o = 0; o < d_out; ++o) {
      const double diff =
          static_cast<double>(y_out_[s * d_out + o]) - static_cast<double>(target[o]);
      loss_sum += diff * diff;
      dy_[s * d_out + o] = static_cast<float>(diff * 2.0 / denom);
    }
  }
  return loss_sum;
}

absl::Status MoeMlp::OutputBackward(int64_t n, const float* weight, float* dw, float* db) {
  const int64_t d = dims_.d_model;
  const int64_t d_out = dims_.d_out;
  dz_.assign(n * d, 0.0f);
  Gemm(true, false, d_out, d, n, 1.0f, dy_.data(), z_.data(), 0.0f, dw);
  ColumnSums(dy_.data(), n, d_out, db);
  Gemm(false, false, n, d, d_out, 1.0f, dy_.data(), weight, 0.0f, dz_.data());
  return absl::OkStatus();
}

absl::Status MoeMlp::PackGateGradients(int64_t n) {
  const int64_t d = dims_.d_model;
  dgate_.resize(n);
  for (int64_t s = 0; s < n; ++s) {
    double sum = 0.0;
    for (int64_t k = 0; k < d; ++k) {
      sum += static_cast<double>(dz_[s * d + k]) * static_cast<double>(o_[s * d + k]);
    }
    dgate_[s] = sum;
  }
  for (int64_t j = 0; j < n; ++j) {
    const int64_t s = routing_.order[j];
    for (int64_t k = 0; k < d; ++k) send_[j * d + k] = routing_.gate[s] * dz_[s * d + k];
  }
  return absl::OkStatus();
}

absl::Status MoeMlp::ExpertsBackward(int64_t /*received*/, int64_t /*local*/, int ep,
                                     const float* w1, const float* w2, float* gw1, float* gw2) {
  ExpertGradients(ep, w1, w2, gw1, gw2);
  return absl::OkStatus();
}

absl::Status MoeMlp::RouterBackward(int64_t n, const float* w_router, float* gw_router) {
  const int64_t d = dims_.d_model;
  const int64_t e_total = dims_.num_experts;
  dh_ = dz_;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t s = routing_.order[j];
    for (int64_t k = 0; k < d; ++k) dh_[s * d + k] += send_[j * d + k];
  }
  // Router: dL/dlogit_j = g_e (delta_je - g_j) dL/dg_e.
  std::vector<float> dlogits(n * e_total);
  RouterLogitGradient(g_.data(), routing_, dgate_.data(), n, e_total, dlogits.data());
  Gemm(true, false, e_total, d, n, 1.0f, dlogits.data(), h_.data(), 0.0f, gw_router);
  Gemm(false, false, n, d, e_total, 1.0f, dlogits.data(), w_router, 1.0f, dh_.data());
  return absl::OkStatus();
}

absl::Status MoeMlp::InputBackward(int64_t n, float* dw, float* db) {
  const int64_t d = dims_.d_model;
  for (int64_t k = 0; k < n * d; ++k) dh_[k] *= 1.0f - h_[k] * h_[k];
  Gemm(true, false, d, dims_.d_in, n, 1.0f, dh_.data(), xs_.data(), 0.0f, dw);
  ColumnSums(dh_.data(), n, d, db);
  return absl::OkStatus();
}

void MoeMlp::ExpertGradients(int ep, const float* w1, const float* w2, float* gw1, float* gw2) {
  const int64_t d = dims_.d_model;
  const int64_t de = dims_.d_expert;
  const int64_t local = static_cast<int64_t>(ex_begin_.size()) - 1;
  const int64_t received = static_cast<int64_t>(ex_local_.size());
  // Expert gradients are with respect to the mean loss of the EP ranks.
  const float alpha = 1.0f / static_cast<float>(ep);
  std::vector<float> ex_do(std::max<int64_t>(received * d, 1));
  std::vector<float> ex_da(std::max<int64_t>(received * de, 1));
  for (int64_t i = 0; i < received; ++i) {
    std::copy_n(recv_.data() + static_cast<int64_t>(ex_order_[i]) * d, d, ex_do.data() + i * d);
  }
  for (int64_t l = 0; l < local; ++l) {
    const int64_t b = ex_begin_[l];
    const int64_t c = ex_begin_[l + 1] - b;
    float* g1 = gw1 + l * de * d;
    float* g2 = gw2 + l * d * de;
    if (c == 0) {
      std::fill_n(g1, de * d, 0.0f);
      std::fill_n(g2, d * de, 0.0f);
      continue;
    }
    const float* a = ex_a_.data() + b * de;
    float* dob = ex_do.data() + b * d;
    float* da = ex_da.data() + b * de;
    Gemm(true, false, d, de, c, alpha, dob, a, 0.0f, g2);
    Gemm(false, false, c, de, d, 1.0f, dob, w2 + l * d * de, 0.0f, da);
    for (int64_t k = 0; k < c * de; ++k) da[k] *= 1.0f - a[k] * a[k];
    Gemm(true, false, de, d, c, alpha, da, ex_h_.data() + b * d, 0.0f, g1);
    // dL/dh of these tokens, over their dL/do rows (no longer needed).
    Gemm(false, false, c, d, de, 1.0f, da, w1 + l * de * d, 0.0f, dob);
  }
  for (int64_t i = 0; i < received; ++i) {
    std::copy_n(ex_do.data() + i * d, d, recv_.data() + static_cast<int64_t>(ex_order_[i]) * d);
  }
}

}  // namespace muonmesh::worker
