#include "worker/model/mlp.h"

#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/model/checks.h"
#include "worker/model/rng.h"

namespace muonmesh::worker {
namespace {

using internal::AnyNull;
using internal::CheckFinite;

// Stream of the teacher inputs x (parameter streams are 2i and 2i+1).
constexpr uint64_t kTeacherInputStream = 1'000'000;

int64_t NumLayers(absl::Span<const int64_t> dims) { return static_cast<int64_t>(dims.size()) - 1; }

// z = a W^T (sgemm), then z += b and, if `activate`, z = tanh(z), elementwise
// in that order. a [n, in], W [out, in], b [out], z [n, out].
void LinearForward(int64_t n, int64_t in, int64_t out, const float* a, const float* w,
                   const float* b, bool activate, float* z) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n), static_cast<int>(out),
              static_cast<int>(in), 1.0f, a, static_cast<int>(in), w, static_cast<int>(in), 0.0f, z,
              static_cast<int>(out));
  for (int64_t r = 0; r < n; ++r) {
    float* row = z + r * out;
    for (int64_t o = 0; o < out; ++o) {
      const float v = row[o] + b[o];
      row[o] = activate ? std::tanh(v) : v;
    }
  }
}

// The forward pass over n samples: acts[0] holds the inputs [n, d_0]; writes
// acts[i] = h_i for 1 <= i <= L (acts[L] is the output). The one
// implementation behind both MlpForward and Mlp::ForwardBackward, so that
// they agree bit for bit.
void Forward(absl::Span<const int64_t> dims, absl::Span<const float* const> params, int64_t n,
             absl::Span<float* const> acts) {
  const int64_t layers = NumLayers(dims);
  for (int64_t i = 0; i < layers; ++i) {
    LinearForward(n, dims[i], dims[i + 1], acts[i], params[2 * i], params[2 * i + 1],
                  /*activate=*/i + 1 < layers, acts[i + 1]);
  }
}

absl::Status CheckPointers(absl::Span<const int64_t> dims, size_t count, bool any_null,
                           const char* what) {
  const size_t expected = 2 * static_cast<size_t>(NumLayers(dims));
  if (count != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": got ", count, " tensors, the mlp has ", expected, " parameters"));
  }
  if (any_null) return absl::InvalidArgumentError(absl::StrCat(what, ": null tensor"));
  return absl::OkStatus();
}

}  // namespace

namespace {

// Layer i's documented initial weight [d_{i+1}, d_i] and bias [d_{i+1}].
void InitLayer(absl::Span<const int64_t> dims, uint64_t seed, int64_t i, float* w, float* b) {
  const int64_t in = dims[i];
  const int64_t out = dims[i + 1];
  // float(u / sqrt(in)) with one rounding: u * (1 / sqrt(in)) would round
  // twice, so divide element by element.
  const UniformStream ws(seed, static_cast<uint64_t>(2 * i));
  for (int64_t k = 0; k < out * in; ++k) {
    w[k] = static_cast<float>(static_cast<double>(ws.At(static_cast<uint64_t>(k))) /
                              std::sqrt(static_cast<double>(in)));
  }
  const UniformStream bs(seed, static_cast<uint64_t>(2 * i + 1));
  for (int64_t r = 0; r < out; ++r) {
    b[r] = static_cast<float>(static_cast<double>(bs.At(static_cast<uint64_t>(r))) /
                              std::sqrt(static_cast<double>(in)));
  }
}

}  // namespace

absl::StatusOr<std::vector<std::vector<float>>> MlpInitialParams(absl::Span<const int64_t> dims,
                                                                 uint64_t seed) {
  MUONMESH_RETURN_IF_ERROR(ValidateMlpDims(dims));
  std::vector<std::vector<float>> params;
  for (int64_t i = 0; i < NumLayers(dims); ++i) {
    std::vector<float> w(static_cast<size_t>(dims[i + 1] * dims[i]));
    std::vector<float> b(static_cast<size_t>(dims[i + 1]));
    InitLayer(dims, seed, i, w.data(), b.data());
    params.push_back(std::move(w));
    params.push_back(std::move(b));
  }
  return params;
}

absl::StatusOr<std::vector<float>> MlpForward(absl::Span<const int64_t> dims,
                                              absl::Span<const float* const> params,
                                              absl::Span<const float> x, int64_t n) {
  MUONMESH_RETURN_IF_ERROR(ValidateMlpDims(dims));
  MUONMESH_RETURN_IF_ERROR(CheckPointers(dims, params.size(), AnyNull(params), "mlp params"));
  if (n < 1 || n > INT_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("mlp forward: n = ", n, " is not in [1, ", INT_MAX, "]"));
  }
  if (static_cast<int64_t>(x.size()) != n * dims[0]) {
    return absl::InvalidArgumentError(absl::StrCat("mlp forward: x has ", x.size(),
                                                   " elements, expected n * d_0 = ", n * dims[0]));
  }
  const int64_t layers = NumLayers(dims);
  std::vector<std::vector<float>> acts(static_cast<size_t>(layers + 1));
  std::vector<float*> act_ptrs(acts.size());
  acts[0].assign(x.begin(), x.end());
  act_ptrs[0] = acts[0].data();
  for (int64_t i = 1; i <= layers; ++i) {
    acts[i].resize(static_cast<size_t>(n * dims[i]));
    act_ptrs[i] = acts[i].data();
  }
  Forward(dims, params, n, act_ptrs);
  return std::move(acts[layers]);
}

absl::StatusOr<std::vector<float>> MlpForward(absl::Span<const int64_t> dims,
                                              absl::Span<const std::vector<float>> params,
                                              absl::Span<const float> x, int64_t n) {
  MUONMESH_ASSIGN_OR_RETURN(plan::ModelSpec spec, MlpSpec(dims));
  std::vector<const float*> ptrs;
  size_t index = 0;
  for (const plan::UnitSpec& unit : spec.units) {
    for (const plan::ParamSpec& p : unit.params) {
      int64_t size = 1;
      for (int64_t d : p.shape) size *= d;
      if (index < params.size() && static_cast<int64_t>(params[index].size()) != size) {
        return absl::InvalidArgumentError(absl::StrCat("mlp params[", index, "] (", p.name,
                                                       "): ", params[index].size(),
                                                       " elements, expected ", size));
      }
      if (index < params.size()) ptrs.push_back(params[index].data());
      ++index;
    }
  }
  if (params.size() != index) {
    return absl::InvalidArgumentError(absl::StrCat("mlp params: got ", params.size(),
                                                   " tensors, the mlp has ", index, " parameters"));
  }
  return MlpForward(dims, absl::MakeConstSpan(ptrs), x, n);
}

// ---------------------------------------------------------------- Mlp

Mlp::Mlp(std::vector<int64_t> dims, std::vector<float> x, std::vector<float> y,
         plan::ModelSpec spec)
    : dims_(std::move(dims)),
      x_(std::move(x)),
      y_(std::move(y)),
      num_samples_(static_cast<int64_t>(x_.size()) / dims_.front()),
      spec_(std::move(spec)),
      acts_(dims_.size()),
      act_ptrs_(dims_.size(), nullptr) {}

absl::StatusOr<Mlp> Mlp::Create(std::vector<int64_t> dims, std::vector<float> x,
                                std::vector<float> y) {
  MUONMESH_ASSIGN_OR_RETURN(plan::ModelSpec spec, MlpSpec(dims));
  const int64_t d_in = dims.front();
  const int64_t d_out = dims.back();
  const int64_t x_size = static_cast<int64_t>(x.size());
  if (x_size == 0 || x_size % d_in != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mlp data: x has ", x_size, " elements, not a positive multiple of d_in = ", d_in));
  }
  const int64_t n = x_size / d_in;
  if (n > kMlpMaxDataElements / std::max(d_in, d_out)) {
    return absl::InvalidArgumentError(absl::StrCat("mlp data: ", n, " samples of dims ", d_in,
                                                   " -> ", d_out, " exceed ", kMlpMaxDataElements,
                                                   " elements per tensor"));
  }
  if (static_cast<int64_t>(y.size()) != n * d_out) {
    return absl::InvalidArgumentError(absl::StrCat("mlp data: y has ", y.size(),
                                                   " elements, expected N * d_out = ", n, " * ",
                                                   d_out, " = ", n * d_out));
  }
  MUONMESH_RETURN_IF_ERROR(CheckFinite(x, "mlp data: x"));
  MUONMESH_RETURN_IF_ERROR(CheckFinite(y, "mlp data: y"));
  return Mlp(std::move(dims), std::move(x), std::move(y), std::move(spec));
}

absl::StatusOr<Mlp> Mlp::FromTeacher(std::vector<int64_t> dims, uint64_t teacher_seed,
                                     int64_t samples) {
  MUONMESH_RETURN_IF_ERROR(ValidateMlpDims(dims));
  const int64_t d_in = dims.front();
  const int64_t d_out = dims.back();
  if (samples < 1 || samples > kMlpMaxDataElements / std::max(d_in, d_out)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mlp teacher: samples = ", samples, " is not in [1, ",
        kMlpMaxDataElements / std::max(d_in, d_out), "] for dims ", d_in, " -> ", d_out));
  }
  std::vector<float> x(static_cast<size_t>(samples * d_in));
  UniformStream(teacher_seed, kTeacherInputStream).Fill(0, samples * d_in, 1.0, x.data());
  MUONMESH_ASSIGN_OR_RETURN(std::vector<std::vector<float>> teacher,
                            MlpInitialParams(dims, teacher_seed + 1));
  MUONMESH_ASSIGN_OR_RETURN(std::vector<float> y,
                            MlpForward(dims, absl::MakeConstSpan(teacher), x, samples));
  return Create(std::move(dims), std::move(x), std::move(y));
}

absl::Status Mlp::Initialize(uint64_t seed, absl::Span<float* const> params) const {
  MUONMESH_RETURN_IF_ERROR(CheckPointers(dims_, params.size(), AnyNull(params), "mlp init"));
  MUONMESH_ASSIGN_OR_RETURN(std::vector<std::vector<float>> init, MlpInitialParams(dims_, seed));
  for (size_t i = 0; i < init.size(); ++i) {
    std::copy(init[i].begin(), init[i].end(), params[i]);
  }
  return absl::OkStatus();
}

absl::Status Mlp::InitializeUnit(uint64_t seed, int unit, absl::Span<float* const> params) const {
  if (unit < 0 || unit >= NumLayers(dims_)) {
    return absl::InvalidArgumentError(
        absl::StrCat("mlp init: unit ", unit, " is outside [0, ", NumLayers(dims_), ")"));
  }
  if (params.size() != 2 || AnyNull(params)) {
    return absl::InvalidArgumentError(
        absl::StrCat("mlp init: unit ", unit, " needs 2 non-null tensors, got ", params.size()));
  }
  InitLayer(dims_, seed, unit, params[0], params[1]);
  return absl::OkStatus();
}

void Mlp::Reserve(int64_t n) {
  if (n <= capacity_) return;
  const int64_t max_dim = *std::max_element(dims_.begin(), dims_.end());
  for (size_t i = 0; i < dims_.size(); ++i) acts_[i].resize(static_cast<size_t>(n * dims_[i]));
  delta_.resize(static_cast<size_t>(n * max_dim));
  delta_next_.resize(static_cast<size_t>(n * max_dim));
  capacity_ = n;
}

absl::Status Mlp::CheckSamples(absl::Span<const int64_t> samples) const {
  return internal::CheckSampleList("mlp", samples, num_samples_, INT_MAX);
}

double Mlp::LossAndOutputDelta(absl::Span<const int64_t> samples) {
  const int64_t n = static_cast<int64_t>(samples.size());
  const int64_t d_out = dims_.back();
  const float* out = acts_[NumLayers(dims_)].data();
  const double denom = static_cast<double>(n) * static_cast<double>(d_out);
  double sum = 0.0;
  float* delta = delta_.data();
  for (int64_t r = 0; r < n; ++r) {
    const float* target = y_.data() + samples[r] * d_out;
    for (int64_t o = 0; o < d_out; ++o) {
      const double d = static_cast<double>(out[r * d_out + o]) - static_cast<double>(target[o]);
      sum += d * d;
      delta[r * d_out + o] = static_cast<float>(d * 2.0 / denom);
    }
  }
  return sum;
}

void Mlp::LayerBackward(int64_t i, int64_t n, const float* weight, const float* delta,
                        float* delta_next, float* dw, float* db) const {
  const int64_t in = dims_[i];
  const int64_t width = dims_[i + 1];
  const float* h = acts_[i].data();
  // dW_i = delta^T h_i   [width, in]
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(width),
              static_cast<int>(in), static_cast<int>(n), 1.0f, delta, static_cast<int>(width), h,
              static_cast<int>(in), 0.0f, dw, static_cast<int>(in));
  // db_i = column sums of delta, in double.
  for (int64_t o = 0; o < width; ++o) {
    double s = 0.0;
    for (int64_t r = 0; r < n; ++r) s += static_cast<double>(delta[r * width + o]);
    db[o] = static_cast<float>(s);
  }
  if (i == 0) return;
  // dL/dh_i = delta W_i   [n, in]; through tanh: * (1 - h_i^2).
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(n), static_cast<int>(in),
              static_cast<int>(width), 1.0f, delta, static_cast<int>(width), weight,
              static_cast<int>(in), 0.0f, delta_next, static_cast<int>(in));
  for (int64_t k = 0; k < n * in; ++k) delta_next[k] *= 1.0f - h[k] * h[k];
}

absl::StatusOr<double> Mlp::ForwardBackward(int64_t /*step*/, absl::Span<const float* const> params,
                                            absl::Span<const int64_t> samples,
                                            absl::Span<float* const> grads) {
  MUONMESH_RETURN_IF_ERROR(CheckPointers(dims_, params.size(), AnyNull(params), "mlp params"));
  MUONMESH_RETURN_IF_ERROR(CheckPointers(dims_, grads.size(), AnyNull(grads), "mlp grads"));
  MUONMESH_RETURN_IF_ERROR(CheckSamples(samples));

  const int64_t n = static_cast<int64_t>(samples.size());
  const int64_t layers = NumLayers(dims_);
  const int64_t d_in = dims_.front();
  const int64_t d_out = dims_.back();
  Reserve(n);

  // Forward.
  float* const x = acts_[0].data();
  for (int64_t r = 0; r < n; ++r) {
    std::copy_n(x_.data() + samples[r] * d_in, d_in, x + r * d_in);
  }
  // Refreshed every call (no allocation): a copied or moved Mlp must not
  // keep pointers into another instance's buffers.
  for (size_t i = 0; i < acts_.size(); ++i) act_ptrs_[i] = acts_[i].data();
  Forward(dims_, params, n, act_ptrs_);

  const double denom = static_cast<double>(n) * static_cast<double>(d_out);
  const double sum = LossAndOutputDelta(samples);
  float* delta = delta_.data();
  float* delta_next = delta_next_.data();

  // Backward: delta holds dL/dz_i for z_i = h_i W_i^T + b_i, [n, d_{i+1}].
  for (int64_t i = layers - 1; i >= 0; --i) {
    LayerBackward(i, n, params[2 * i], delta, delta_next, grads[2 * i], grads[2 * i + 1]);
    std::swap(delta, delta_next);
  }
  return sum / denom;
}

absl::StatusOr<double> Mlp::ForwardBackwardByUnit(int64_t /*step*/, UnitAccess& units,
                                                  absl::Span<const int64_t> samples) {
  return RunMlpPasses(dims_, num_samples_, *this, units, samples);
}

absl::Status Mlp::Gather(absl::Span<const int64_t> samples) {
  const int64_t n = static_cast<int64_t>(samples.size());
  const int64_t d_in = dims_.front();
  Reserve(n);
  float* const x = acts_[0].data();
  for (int64_t r = 0; r < n; ++r) {
    std::copy_n(x_.data() + samples[r] * d_in, d_in, x + r * d_in);
  }
  for (size_t i = 0; i < acts_.size(); ++i) act_ptrs_[i] = acts_[i].data();
  return absl::OkStatus();
}

// The same LinearForward calls as Forward, one layer at a time.
absl::Status Mlp::ForwardLayer(int64_t i, int64_t n, const float* weight, const float* bias) {
  LinearForward(n, dims_[i], dims_[i + 1], act_ptrs_[i], weight, bias,
                /*activate=*/i + 1 < NumLayers(dims_), act_ptrs_[i + 1]);
  return absl::OkStatus();
}

absl::StatusOr<double> Mlp::OutputLoss(absl::Span<const int64_t> samples) {
  const double sum = LossAndOutputDelta(samples);
  pass_delta_ = delta_.data();
  pass_delta_next_ = delta_next_.data();
  return sum;
}

absl::Status Mlp::BackwardLayer(int64_t i, int64_t n, const float* weight, float* dw, float* db) {
  LayerBackward(i, n, weight, pass_delta_, pass_delta_next_, dw, db);
  std::swap(pass_delta_, pass_delta_next_);
  return absl::OkStatus();
}

}  // namespace muonmesh::worker
