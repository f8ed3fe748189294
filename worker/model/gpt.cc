#include "worker/model/gpt.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/plan/validate.h"
#include "worker/math/elementwise.h"
#include "worker/model/checks.h"
#include "worker/model/host_ops.h"
#include "worker/model/rng.h"

namespace muonmesh::worker {
namespace {

using internal::AnyNull;

constexpr int kEmbedUnit = 0;
constexpr double kLayerNormEps = 1e-5;
constexpr double kInitStd = 0.02;

// ---------------------------------------------------------------- math

// y [rows, out] = x [rows, in] W^T + b, W [out, in].
void LinearForward(int64_t rows, int64_t in, int64_t out, const float* x, const float* w,
                   const float* b, float* y) {
  Gemm(false, true, rows, out, in, 1.0f, x, in, w, in, y, out);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = y + r * out;
    for (int64_t o = 0; o < out; ++o) row[o] += b[o];
  }
}

// db[o] = sum_r dy[r, o], summed in double in `acc` ([cols]) and rounded once.
void ColumnSums(int64_t rows, int64_t cols, const float* dy, double* acc, float* db) {
  std::fill(acc, acc + cols, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = dy + r * cols;
    for (int64_t o = 0; o < cols; ++o) acc[o] += static_cast<double>(row[o]);
  }
  for (int64_t o = 0; o < cols; ++o) db[o] = static_cast<float>(acc[o]);
}

// The gradients of LinearForward from dy [rows, out]: dW = dy^T x, db, and
// dx [rows, in] = dy W (overwritten).
void LinearBackward(int64_t rows, int64_t in, int64_t out, const float* dy, const float* x,
                    const float* w, float* dw, float* db, float* dx, double* acc) {
  Gemm(true, false, out, in, rows, 1.0f, dy, out, x, in, dw, in);
  ColumnSums(rows, out, dy, acc, db);
  Gemm(false, false, rows, in, out, 1.0f, dy, out, w, in, dx, in);
}

// xhat = (x - mean) rstd in fp32, the one formula forward and backward use.
inline float Normalized(float x, float mean, float rstd) { return (x - mean) * rstd; }

// y = xhat w + b per row of x [rows, c]; the row's mean and 1 / sqrt(var +
// eps) (double, rounded to float) go to mean[r], rstd[r].
void LayerNormForward(int64_t rows, int64_t c, const float* x, const float* w, const float* b,
                      float* y, float* mean, float* rstd) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * c;
    double sum = 0.0;
    for (int64_t i = 0; i < c; ++i) sum += static_cast<double>(xr[i]);
    const double m = sum / static_cast<double>(c);
    double var = 0.0;
    for (int64_t i = 0; i < c; ++i) {
      const double d = static_cast<double>(xr[i]) - m;
      var += d * d;
    }
    var /= static_cast<double>(c);
    const float mf = static_cast<float>(m);
    const float rf = static_cast<float>(1.0 / std::sqrt(var + kLayerNormEps));
    float* yr = y + r * c;
    for (int64_t i = 0; i < c; ++i) yr[i] = Normalized(xr[i], mf, rf) * w[i] + b[i];
    mean[r] = mf;
    rstd[r] = rf;
  }
}

// Adds dL/dx to dx [rows, c] from dy = dL/dy of LayerNormForward, and
// writes dw, db (column sums in acc [2c]). dx = rstd (g - mean(g) -
// xhat mean(g xhat)) with g = dy w, the row means in double.
void LayerNormBackward(int64_t rows, int64_t c, const float* x, const float* mean,
                       const float* rstd, const float* w, const float* dy, float* dx, float* dw,
                       float* db, double* acc) {
  double* acc_w = acc;
  double* acc_b = acc + c;
  std::fill(acc, acc + 2 * c, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * c;
    const float* dyr = dy + r * c;
    double sum_g = 0.0;
    double sum_gx = 0.0;
    for (int64_t i = 0; i < c; ++i) {
      const double xhat = Normalized(xr[i], mean[r], rstd[r]);
      const double g = static_cast<double>(dyr[i] * w[i]);
      sum_g += g;
      sum_gx += g * xhat;
      acc_w[i] += static_cast<double>(dyr[i]) * xhat;
      acc_b[i] += static_cast<double>(dyr[i]);
    }
    const double mean_g = sum_g / static_cast<double>(c);
    const double mean_gx = sum_gx / static_cast<double>(c);
    float* dxr = dx + r * c;
    for (int64_t i = 0; i < c; ++i) {
      const double xhat = Normalized(xr[i], mean[r], rstd[r]);
      const double g = static_cast<double>(dyr[i] * w[i]);
      dxr[i] += static_cast<float>(static_cast<double>(rstd[r]) * (g - mean_g - xhat * mean_gx));
    }
  }
  for (int64_t i = 0; i < c; ++i) {
    dw[i] = static_cast<float>(acc_w[i]);
    db[i] = static_cast<float>(acc_b[i]);
  }
}

void GeluForward(int64_t count, const float* x, float* y) {
  for (int64_t i = 0; i < count; ++i) y[i] = math::Gelu(x[i]);
}

// d *= gelu'(x).
void GeluBackward(int64_t count, const float* x, float* d) {
  for (int64_t i = 0; i < count; ++i) d[i] = d[i] * math::GeluSlope(x[i]);
}

// ---------------------------------------------------------------- access

absl::Status CheckWhole(const plan::ModelSpec& spec, size_t count, bool any_null,
                        const char* what) {
  size_t expected = 0;
  for (const plan::UnitSpec& unit : spec.units) expected += unit.params.size();
  if (count != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": got ", count, " tensors, the gpt has ", expected, " parameters"));
  }
  if (any_null) return absl::InvalidArgumentError(absl::StrCat(what, ": null tensor"));
  return absl::OkStatus();
}

// ---------------------------------------------------------------- init

// sigma of the documented initialisation for parameter j of a block, or 0
// for a constant (ones for the LayerNorm weights 0 and 6, zeros otherwise).
double BlockInitStd(int j, int64_t layers) {
  switch (j) {
    case 2:  // attn.c_attn.weight
    case 8:  // mlp.c_fc.weight
      return kInitStd;
    case 4:   // attn.c_proj.weight
    case 10:  // mlp.c_proj.weight
      return kInitStd / std::sqrt(2.0 * static_cast<double>(layers));
    default:
      return 0.0;
  }
}

// z of element e of the tensor whose uniforms `stream` gives
// (GptStandardNormal).
double StandardNormal(const UniformStream& stream, uint64_t e) {
  const double u1 = (static_cast<double>(stream.At(2 * e)) + 1.0) / 2.0 + 0x1p-24;
  const double u2 = (static_cast<double>(stream.At(2 * e + 1)) + 1.0) / 2.0;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

void FillNormal(uint64_t seed, int param, int64_t count, double sigma, float* out) {
  const UniformStream stream(seed, static_cast<uint64_t>(param));
  for (int64_t e = 0; e < count; ++e) {
    out[e] = static_cast<float>(sigma * StandardNormal(stream, static_cast<uint64_t>(e)));
  }
}

}  // namespace

double GptStandardNormal(uint64_t seed, uint64_t param, uint64_t element) {
  return StandardNormal(UniformStream(seed, param), element);
}

// ---------------------------------------------------------------- Gpt

Gpt::Gpt(model::GptDims dims, std::shared_ptr<const TokenStream> train, plan::ModelSpec spec)
    : dims_(dims),
      train_(std::move(train)),
      spec_(std::move(spec)),
      num_samples_(WindowPeriod(train_->num_tokens(), dims.seq_len)),
      logit_max_(static_cast<size_t>(dims.n_layer * dims.n_head),
                 -std::numeric_limits<float>::infinity()),
      blocks_(static_cast<size_t>(dims.n_layer)),
      datt_(static_cast<size_t>(dims.seq_len * dims.seq_len)),
      col_sums_(static_cast<size_t>(8 * dims.n_embd)) {}

absl::StatusOr<Gpt> Gpt::Create(model::GptDims dims, std::shared_ptr<const TokenStream> train) {
  MUONMESH_ASSIGN_OR_RETURN(plan::ModelSpec spec, model::GptSpec(dims));
  MUONMESH_RETURN_IF_ERROR(CheckTrainingStream(train.get(), dims.seq_len));
  return Gpt(dims, std::move(train), std::move(spec));
}

absl::Status Gpt::Initialize(uint64_t seed, absl::Span<float* const> params) const {
  MUONMESH_RETURN_IF_ERROR(CheckWhole(spec_, params.size(), AnyNull(params), "gpt init"));
  size_t first = 0;
  for (size_t u = 0; u < spec_.units.size(); ++u) {
    const size_t count = spec_.units[u].params.size();
    MUONMESH_RETURN_IF_ERROR(
        InitializeUnit(seed, static_cast<int>(u), params.subspan(first, count)));
    first += count;
  }
  return absl::OkStatus();
}

absl::Status Gpt::InitializeUnit(uint64_t seed, int unit, absl::Span<float* const> params) const {
  const int units = static_cast<int>(spec_.units.size());
  if (unit < 0 || unit >= units) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpt init: unit ", unit, " is outside [0, ", units, ")"));
  }
  const std::vector<plan::ParamSpec>& specs = spec_.units[unit].params;
  MUONMESH_RETURN_IF_ERROR(internal::CheckUnitTensors("gpt", params, specs.size(), "init", unit));
  // Flat index of the unit's first parameter (gpt_spec.h).
  const int first = unit == kEmbedUnit ? 0 : model::GptBlockParam(unit - 1);
  for (size_t j = 0; j < specs.size(); ++j) {
    const int64_t count = plan::NumElements(specs[j]);
    double sigma = 0.0;
    float constant = 0.0f;
    if (unit == kEmbedUnit) {
      sigma = kInitStd;
    } else if (unit == head_unit()) {
      constant = j == 0 ? 1.0f : 0.0f;
    } else {
      sigma = BlockInitStd(static_cast<int>(j), dims_.n_layer);
      constant = (j == 0 || j == 6) ? 1.0f : 0.0f;
    }
    if (sigma > 0.0) {
      FillNormal(seed, first + static_cast<int>(j), count, sigma, params[j]);
    } else {
      std::fill(params[j], params[j] + count, constant);
    }
  }
  return absl::OkStatus();
}

void Gpt::Reserve(int64_t n) {
  if (n <= capacity_) return;
  const size_t rows = static_cast<size_t>(n * dims_.seq_len);
  const size_t c = static_cast<size_t>(dims_.n_embd);
  for (BlockActs& a : blocks_) {
    a.resid_in.resize(rows * c);
    a.ln1.resize(rows * c);
    a.ln1_mean.resize(rows);
    a.ln1_rstd.resize(rows);
    a.qkv.resize(rows * 3 * c);
    a.att.resize(static_cast<size_t>(n * dims_.n_head * dims_.seq_len * dims_.seq_len));
    a.atty.resize(rows * c);
    a.resid_mid.resize(rows * c);
    a.ln2.resize(rows * c);
    a.ln2_mean.resize(rows);
    a.ln2_rstd.resize(rows);
    a.fch.resize(rows * 4 * c);
    a.fch_gelu.resize(rows * 4 * c);
  }
  resid_out_.resize(rows * c);
  lnf_.resize(rows * c);
  lnf_mean_.resize(rows);
  lnf_rstd_.resize(rows);
  logits_.resize(rows * static_cast<size_t>(dims_.vocab_size));
  dresid_.resize(rows * c);
  dc_.resize(rows * c);
  dqkv_.resize(rows * 3 * c);
  dfch_.resize(rows * 4 * c);
  exp_.resize(static_cast<size_t>(std::max(dims_.vocab_size, dims_.seq_len)));
  capacity_ = n;
}

absl::Status Gpt::Prepare(absl::Span<const int32_t> /*windows*/, int64_t n) {
  // The windows are in tokens_ already: RunGptPasses read them there.
  Reserve(n);
  return absl::OkStatus();
}

float* Gpt::BlockOutput(int64_t layer) {
  return layer + 1 < dims_.n_layer ? blocks_[layer + 1].resid_in.data() : resid_out_.data();
}

// ---------------------------------------------------------------- forward math

absl::Status Gpt::EmbedForward(int64_t n, const float* wte, const float* wpe) {
  const int64_t t_len = dims_.seq_len;
  const int64_t c = dims_.n_embd;
  float* x = blocks_.front().resid_in.data();
  for (int64_t b = 0; b < n; ++b) {
    for (int64_t t = 0; t < t_len; ++t) {
      const float* te = wte + tokens_[b * (t_len + 1) + t] * c;
      const float* pe = wpe + t * c;
      float* row = x + (b * t_len + t) * c;
      for (int64_t i = 0; i < c; ++i) row[i] = te[i] + pe[i];
    }
  }
  return absl::OkStatus();
}

void Gpt::AttentionForward(BlockActs& a, int64_t n, float* head_max) {
  const int64_t t_len = dims_.seq_len;
  const int64_t c = dims_.n_embd;
  const int64_t hs = c / dims_.n_head;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)));
  for (int64_t b = 0; b < n; ++b) {
    const float* qkv = a.qkv.data() + b * t_len * 3 * c;
    for (int64_t h = 0; h < dims_.n_head; ++h) {
      const float* q = qkv + h * hs;
      const float* k = qkv + c + h * hs;
      const float* v = qkv + 2 * c + h * hs;
      float* att = a.att.data() + (b * dims_.n_head + h) * t_len * t_len;
      Gemm(false, true, t_len, t_len, hs, scale, q, 3 * c, k, 3 * c, att, t_len);
      const float top = CausalSoftmax(t_len, att, exp_.data());
      if (head_max != nullptr) head_max[h] = std::max(head_max[h], top);
      float* y = a.atty.data() + b * t_len * c + h * hs;
      Gemm(false, false, t_len, hs, t_len, 1.0f, att, t_len, v, 3 * c, y, c);
    }
  }
}

absl::Status Gpt::BlockForward(int64_t layer, int64_t n, absl::Span<const float* const> p) {
  const int64_t rows = n * dims_.seq_len;
  const int64_t c = dims_.n_embd;
  BlockActs& a = blocks_[layer];
  LayerNormForward(rows, c, a.resid_in.data(), p[0], p[1], a.ln1.data(), a.ln1_mean.data(),
                   a.ln1_rstd.data());
  LinearForward(rows, c, 3 * c, a.ln1.data(), p[2], p[3], a.qkv.data());
  AttentionForward(a, n, record_logits_ ? logit_max_.data() + layer * dims_.n_head : nullptr);
  LinearForward(rows, c, c, a.atty.data(), p[4], p[5], a.resid_mid.data());
  for (int64_t i = 0; i < rows * c; ++i) a.resid_mid[i] += a.resid_in[i];
  LayerNormForward(rows, c, a.resid_mid.data(), p[6], p[7], a.ln2.data(), a.ln2_mean.data(),
                   a.ln2_rstd.data());
  LinearForward(rows, c, 4 * c, a.ln2.data(), p[8], p[9], a.fch.data());
  GeluForward(rows * 4 * c, a.fch.data(), a.fch_gelu.data());
  float* out = BlockOutput(layer);
  LinearForward(rows, 4 * c, c, a.fch_gelu.data(), p[10], p[11], out);
  for (int64_t i = 0; i < rows * c; ++i) out[i] += a.resid_mid[i];
  return absl::OkStatus();
}

absl::Status Gpt::FinalNorm(int64_t n, const float* w, const float* b) {
  LayerNormForward(n * dims_.seq_len, dims_.n_embd, resid_out_.data(), w, b, lnf_.data(),
                   lnf_mean_.data(), lnf_rstd_.data());
  return absl::OkStatus();
}

// The logits, the summed cross-entropy (returned, in double) and, if
// `gradients`, dL/dlogits = (softmax - onehot) / (n T) written over them.
absl::StatusOr<double> Gpt::LogitsAndLoss(int64_t n, const float* wte, bool gradients) {
  const int64_t rows = n * dims_.seq_len;
  Gemm(false, true, rows, dims_.vocab_size, dims_.n_embd, 1.0f, lnf_.data(), dims_.n_embd, wte,
       dims_.n_embd, logits_.data(), dims_.vocab_size);
  return WindowCrossEntropy(n, dims_.seq_len, dims_.vocab_size, tokens_.data(), logits_.data(),
                            exp_.data(), gradients);
}

// ---------------------------------------------------------------- backward
// math

absl::Status Gpt::HeadBackward(int64_t n, const float* wte, const float* lnf_w, float* dwte,
                               float* dlnf_w, float* dlnf_b) {
  const int64_t rows = n * dims_.seq_len;
  const int64_t c = dims_.n_embd;
  const int64_t v_size = dims_.vocab_size;
  Gemm(true, false, v_size, c, rows, 1.0f, logits_.data(), v_size, lnf_.data(), c, dwte, c);
  Gemm(false, false, rows, c, v_size, 1.0f, logits_.data(), v_size, wte, c, dc_.data(), c);
  std::fill(dresid_.begin(), dresid_.begin() + rows * c, 0.0f);
  LayerNormBackward(rows, c, resid_out_.data(), lnf_mean_.data(), lnf_rstd_.data(), lnf_w,
                    dc_.data(), dresid_.data(), dlnf_w, dlnf_b, col_sums_.data());
  return absl::OkStatus();
}

void Gpt::AttentionBackward(const BlockActs& a, int64_t n, const float* datty, float* dqkv) {
  const int64_t t_len = dims_.seq_len;
  const int64_t c = dims_.n_embd;
  const int64_t hs = c / dims_.n_head;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)));
  float* datt = datt_.data();
  for (int64_t b = 0; b < n; ++b) {
    const float* qkv = a.qkv.data() + b * t_len * 3 * c;
    float* dqkv_b = dqkv + b * t_len * 3 * c;
    for (int64_t h = 0; h < dims_.n_head; ++h) {
      const int64_t q_off = h * hs;
      const int64_t k_off = c + h * hs;
      const int64_t v_off = 2 * c + h * hs;
      const float* att = a.att.data() + (b * dims_.n_head + h) * t_len * t_len;
      const float* dy = datty + b * t_len * c + h * hs;
      // dP = dY V^T; dV = P^T dY; dS = softmax'(dP); dQ = s dS K; dK = s dS^T
      // Q.
      Gemm(false, true, t_len, t_len, hs, 1.0f, dy, c, qkv + v_off, 3 * c, datt, t_len);
      Gemm(true, false, t_len, hs, t_len, 1.0f, att, t_len, dy, c, dqkv_b + v_off, 3 * c);
      CausalSoftmaxBackward(t_len, att, datt);
      Gemm(false, false, t_len, hs, t_len, scale, datt, t_len, qkv + k_off, 3 * c, dqkv_b + q_off,
           3 * c);
      Gemm(true, false, t_len, hs, t_len, scale, datt, t_len, qkv + q_off, 3 * c, dqkv_b + k_off,
           3 * c);
    }
  }
}

// dresid_ holds dL/d(block output); becomes dL/d(block input).
absl::Status Gpt::BlockBackward(int64_t layer, int64_t n, absl::Span<const float* const> p,
                                absl::Span<float* const> g) {
  const int64_t rows = n * dims_.seq_len;
  const int64_t c = dims_.n_embd;
  const BlockActs& a = blocks_[layer];
  double* acc = col_sums_.data();
  LinearBackward(rows, 4 * c, c, dresid_.data(), a.fch_gelu.data(), p[10], g[10], g[11],
                 dfch_.data(), acc);
  GeluBackward(rows * 4 * c, a.fch.data(), dfch_.data());
  LinearBackward(rows, c, 4 * c, dfch_.data(), a.ln2.data(), p[8], g[8], g[9], dc_.data(), acc);
  LayerNormBackward(rows, c, a.resid_mid.data(), a.ln2_mean.data(), a.ln2_rstd.data(), p[6],
                    dc_.data(), dresid_.data(), g[6], g[7], acc);
  LinearBackward(rows, c, c, dresid_.data(), a.atty.data(), p[4], g[4], g[5], dc_.data(), acc);
  AttentionBackward(a, n, dc_.data(), dqkv_.data());
  LinearBackward(rows, c, 3 * c, dqkv_.data(), a.ln1.data(), p[2], g[2], g[3], dc_.data(), acc);
  LayerNormBackward(rows, c, a.resid_in.data(), a.ln1_mean.data(), a.ln1_rstd.data(), p[0],
                    dc_.data(), dresid_.data(), g[0], g[1], acc);
  return absl::OkStatus();
}

// dwte (holding the head's gradient) += the lookup's rows; dwpe = the sum
// over samples per position (double), 0 at positions >= T.
absl::Status Gpt::EmbedBackward(int64_t n, float* dwte, float* dwpe) {
  const int64_t t_len = dims_.seq_len;
  const int64_t c = dims_.n_embd;
  for (int64_t b = 0; b < n; ++b) {
    for (int64_t t = 0; t < t_len; ++t) {
      float* te = dwte + tokens_[b * (t_len + 1) + t] * c;
      const float* d = dresid_.data() + (b * t_len + t) * c;
      for (int64_t i = 0; i < c; ++i) te[i] += d[i];
    }
  }
  double* acc = col_sums_.data();
  for (int64_t t = 0; t < t_len; ++t) {
    std::fill(acc, acc + c, 0.0);
    for (int64_t b = 0; b < n; ++b) {
      const float* d = dresid_.data() + (b * t_len + t) * c;
      for (int64_t i = 0; i < c; ++i) acc[i] += static_cast<double>(d[i]);
    }
    for (int64_t i = 0; i < c; ++i) dwpe[t * c + i] = static_cast<float>(acc[i]);
  }
  std::fill(dwpe + t_len * c, dwpe + dims_.block_size * c, 0.0f);
  return absl::OkStatus();
}

// ---------------------------------------------------------------- entry points

absl::StatusOr<double> Gpt::ForwardBackward(int64_t /*step*/, absl::Span<const float* const> params,
                                            absl::Span<const int64_t> samples,
                                            absl::Span<float* const> grads) {
  MUONMESH_RETURN_IF_ERROR(CheckWhole(spec_, params.size(), AnyNull(params), "gpt params"));
  MUONMESH_RETURN_IF_ERROR(CheckWhole(spec_, grads.size(), AnyNull(grads), "gpt grads"));
  WholeModelAccess whole(spec_, params, grads);
  record_logits_ = true;
  absl::StatusOr<double> loss =
      RunGptPasses(dims_, *this, whole, *train_, samples, /*gradients=*/true, tokens_);
  record_logits_ = false;
  return loss;
}

absl::StatusOr<double> Gpt::ForwardBackwardByUnit(int64_t /*step*/, UnitAccess& units,
                                                  absl::Span<const int64_t> samples) {
  record_logits_ = true;
  absl::StatusOr<double> loss =
      RunGptPasses(dims_, *this, units, *train_, samples, /*gradients=*/true, tokens_);
  record_logits_ = false;
  return loss;
}

void Gpt::ResetAttentionLogits() {
  std::fill(logit_max_.begin(), logit_max_.end(), -std::numeric_limits<float>::infinity());
}

std::vector<RowScale> Gpt::QkClipRows(absl::Span<const float> logits, double tau) const {
  std::vector<RowScale> rows;
  const int64_t hs = dims_.n_embd / dims_.n_head;
  for (int64_t l = 0; l < dims_.n_layer; ++l) {
    for (int64_t h = 0; h < dims_.n_head; ++h) {
      const size_t i = static_cast<size_t>(l * dims_.n_head + h);
      if (i >= logits.size() || !(logits[i] > tau)) continue;
      // MHA: q and k each take the square root, so q.k scales by tau / S.
      const float factor = static_cast<float>(std::sqrt(tau / static_cast<double>(logits[i])));
      const int32_t w = model::GptBlockParam(l) + 2;  // h.{l}.attn.c_attn.weight
      rows.push_back({w, h * hs, hs, factor});
      rows.push_back({w, dims_.n_embd + h * hs, hs, factor});
    }
  }
  return rows;
}

absl::StatusOr<double> Gpt::Loss(absl::Span<const float* const> params, const TokenStream& tokens,
                                 absl::Span<const int64_t> samples) {
  MUONMESH_RETURN_IF_ERROR(CheckWhole(spec_, params.size(), AnyNull(params), "gpt params"));
  WholeModelAccess whole(spec_, params, {});
  return RunGptPasses(dims_, *this, whole, tokens, samples, /*gradients=*/false, tokens_);
}

absl::StatusOr<double> Gpt::LossByUnit(UnitAccess& units, const TokenStream& tokens,
                                       absl::Span<const int64_t> samples) {
  return RunGptPasses(dims_, *this, units, tokens, samples, /*gradients=*/false, tokens_);
}

absl::Status Gpt::SetValidation(std::shared_ptr<const TokenStream> val) {
  int64_t windows = 0;
  MUONMESH_RETURN_IF_ERROR(ValidationWindows(val.get(), dims_.seq_len, &windows));
  num_val_samples_ = windows;
  val_ = std::move(val);
  return absl::OkStatus();
}

absl::StatusOr<double> Gpt::ValidationLossByUnit(UnitAccess& units,
                                                 absl::Span<const int64_t> samples) {
  if (val_ == nullptr) return absl::FailedPreconditionError("gpt: no validation data");
  return LossByUnit(units, *val_, samples);
}

absl::StatusOr<std::vector<float>> Gpt::NextTokenLogits(absl::Span<const float* const> params,
                                                     absl::Span<const int32_t> context) {
  if (static_cast<int64_t>(context.size()) != dims_.seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("gpt: a context of ", context.size(),
                                                   " tokens for seq_len ", dims_.seq_len));
  }
  // One window: the context, then any target (its loss is not used).
  std::vector<int32_t> window(context.begin(), context.end());
  window.push_back(0);
  const InMemoryTokens stream(std::move(window));
  const int64_t sample = 0;
  MUONMESH_RETURN_IF_ERROR(Loss(params, stream, absl::MakeConstSpan(&sample, 1)).status());
  const float* last = logits_.data() + (dims_.seq_len - 1) * dims_.vocab_size;
  return std::vector<float>(last, last + dims_.vocab_size);
}

}  // namespace muonmesh::worker
