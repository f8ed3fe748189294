#pragma once

// The built-in `mlp` workload (design §6): teacher-student regression with a
// fully connected tanh network. Exact definition, so that anyone can
// reproduce it:
//
// Shape. dims = {d_0, ..., d_L} (L >= 1 layers). Layer i (0 <= i < L) maps
// d_i -> d_{i+1} with parameters
//   layers.{i}.weight  [d_{i+1}, d_i]   optimizer "muon"
//   layers.{i}.bias    [d_{i+1}]        optimizer "adamw"
// and is one unit named `layers.{i}` holding its weight then its bias (flat
// parameter index 2i is W_i, 2i+1 is b_i).
//
// Model. h_0 = x; h_{i+1} = tanh(h_i W_i^T + b_i) for i < L-1; the output is
// y = h_{L-1} W_{L-1}^T + b_{L-1} (no activation after the last layer).
//
// Loss of a call on samples S (|S| = n, repeats allowed):
//   loss = 1/(n d_L) * sum_{s in S} sum_o (y_{s,o} - t_{s,o})^2,
// the mean over every element of the call's samples, so that the average of
// equal-size slices' losses (and gradients) is the whole batch's.
//
// Initialisation from seed `seed` (see worker/model/rng.h for UniformAt):
//   W_i[r, c] = float(double(UniformAt(seed, 2i,   r * d_i + c)) / sqrt(double(d_i)))
//   b_i[r]    = float(double(UniformAt(seed, 2i+1, r))         / sqrt(double(d_i)))
// (a uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)), as torch.nn.Linear).
//
// Teacher data (FromTeacher(dims, teacher_seed, N)):
//   x[n, j] = UniformAt(teacher_seed, 1'000'000, n * d_0 + j)   (in [-1, 1))
//   y       = MlpForward(dims, teacher, x, N)
// where `teacher` is the initialisation above with seed teacher_seed + 1
// (modulo 2^64). So a student initialised with seed teacher_seed + 1 IS the
// teacher (loss 0, gradients 0): jobs and tests should use another seed.
// x is exact from the formula. y is computed in fp32 by the same code as the
// student's forward pass (OpenBLAS sgemm, then + b, then tanhf), so a student
// holding the teacher's weights has loss exactly 0 on the teacher's data;
// other BLAS builds reproduce y to fp32 rounding, not bit for bit (export it
// as safetensors where bits matter).
//
// Arithmetic. Row-major fp32 throughout, matrix products through
// cblas_sgemm; the loss and the bias gradients are summed in double and
// rounded once. dL/dy = float(2 (y - t) / (n d_L)) computed in double.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/plan/types.h"
#include "core/model/mlp_spec.h"
#include "worker/model/mlp_passes.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

using model::kMlpMaxDataElements;
using model::kMlpMaxDim;
using model::kMlpMaxLayers;
using model::MlpSpec;
using model::ValidateMlpDims;

// The documented initialisation with `seed`, one vector per parameter in
// flat order. InvalidArgument for bad dims.
absl::StatusOr<std::vector<std::vector<float>>> MlpInitialParams(absl::Span<const int64_t> dims,
                                                                 uint64_t seed);

// y [n, d_L] = the mlp with `params` (flat order, params[i] holding
// parameter i's elements) applied to x [n, d_0]. The same arithmetic as
// Mlp::ForwardBackward's forward pass on samples 0..n-1 in order.
// InvalidArgument for bad dims, n < 1, or wrongly sized x or params (the
// pointer form cannot check sizes: each must hold its parameter's elements).
absl::StatusOr<std::vector<float>> MlpForward(absl::Span<const int64_t> dims,
                                              absl::Span<const float* const> params,
                                              absl::Span<const float> x, int64_t n);
absl::StatusOr<std::vector<float>> MlpForward(absl::Span<const int64_t> dims,
                                              absl::Span<const std::vector<float>> params,
                                              absl::Span<const float> x, int64_t n);

// The mlp workload over an in-memory dataset x [N, d_0], y [N, d_L].
//
// One instance per rank, owned by the rank's runtime. Thread-compatible:
// ForwardBackward reuses scratch buffers sized for the largest batch seen,
// so after the first call with that batch it allocates nothing; const
// methods may be called concurrently.
class Mlp final : public Workload, private MlpPasses {
 public:
  // Takes the dataset: x holds N * d_0 floats, y N * d_L (row-major, N >= 1,
  // N * max(d_0, d_L) <= kMlpMaxDataElements, every value finite).
  // InvalidArgument naming what is wrong otherwise.
  static absl::StatusOr<Mlp> Create(std::vector<int64_t> dims, std::vector<float> x,
                                    std::vector<float> y);

  // The teacher dataset documented above, with `samples` (N) samples.
  // InvalidArgument for bad dims, samples < 1 or a dataset beyond
  // kMlpMaxDataElements.
  static absl::StatusOr<Mlp> FromTeacher(std::vector<int64_t> dims, uint64_t teacher_seed,
                                         int64_t samples);

  const plan::ModelSpec& spec() const override { return spec_; }
  int64_t num_samples() const override { return num_samples_; }

  // The documented initialisation. InvalidArgument if params does not hold
  // one non-null pointer per parameter.
  absl::Status Initialize(uint64_t seed, absl::Span<float* const> params) const override;

  // Loss and gradients on `samples` (any order, repeats allowed; `step` is
  // ignored). InvalidArgument, with grads untouched, for empty samples, a
  // sample outside [0, N), more than INT32_MAX samples, or params/grads that
  // do not hold one non-null pointer per parameter.
  absl::StatusOr<double> ForwardBackward(int64_t step, absl::Span<const float* const> params,
                                         absl::Span<const int64_t> samples,
                                         absl::Span<float* const> grads) override;

  // The same loss and gradients as ForwardBackward, bit for bit (the same
  // sgemm calls in the same order), streamed unit by unit (unit i is layer
  // i). Guarantees, for L layers: at most one unit is acquired at any time
  // and at most one unit's gradient buffers are outstanding; the calls are,
  // in order,
  //   forward:  Acquire(i), Release(i) for i = 0 .. L-2, then Acquire(L-1)
  //             (held into the backward pass: each unit is acquired twice,
  //             except the last, acquired once);
  //   backward: for i = L-1 down to 0: [Acquire(i) unless i == L-1],
  //             GradientBuffers(i), Commit(i), Release(i).
  // On an error (its own, as ForwardBackward's, or one from `units`) it
  // releases what it holds and returns; units already committed stay so.
  absl::StatusOr<double> ForwardBackwardByUnit(int64_t step, UnitAccess& units,
                                               absl::Span<const int64_t> samples) override;

  // Layer `unit`'s documented initialisation (weight, bias).
  absl::Status InitializeUnit(uint64_t seed, int unit,
                              absl::Span<float* const> params) const override;

  const std::vector<int64_t>& dims() const { return dims_; }
  // The dataset, row-major: x [N, d_0], y [N, d_L].
  const std::vector<float>& x() const { return x_; }
  const std::vector<float>& y() const { return y_; }

 private:
  Mlp(std::vector<int64_t> dims, std::vector<float> x, std::vector<float> y, plan::ModelSpec spec);

  absl::Status CheckSamples(absl::Span<const int64_t> samples) const;

  // Grows the scratch buffers to hold `n` samples (never shrinks them).
  void Reserve(int64_t n);

  // The host's passes (mlp_passes.h), which RunMlpPasses drives; the same
  // LinearForward, LossAndOutputDelta and LayerBackward calls as
  // ForwardBackward.
  absl::Status Gather(absl::Span<const int64_t> samples) override;
  absl::Status ForwardLayer(int64_t i, int64_t n, const float* weight, const float* bias) override;
  absl::StatusOr<double> OutputLoss(absl::Span<const int64_t> samples) override;
  absl::Status BackwardLayer(int64_t i, int64_t n, const float* weight, float* dw,
                             float* db) override;

  // The two halves both ForwardBackward variants share, so they stay bit
  // for bit the same. LossAndOutputDelta: the summed squared error of the
  // forward pass in acts_, with dL/dy written to delta_. LayerBackward:
  // layer i's gradients from `delta` (dW_i, db_i); unless i == 0, dL/dh_i
  // through tanh into `delta_next`.
  double LossAndOutputDelta(absl::Span<const int64_t> samples);
  void LayerBackward(int64_t i, int64_t n, const float* weight, const float* delta,
                     float* delta_next, float* dw, float* db) const;

  std::vector<int64_t> dims_;
  std::vector<float> x_;
  std::vector<float> y_;
  int64_t num_samples_ = 0;
  plan::ModelSpec spec_;

  // Scratch: acts_[i] holds h_i for the current call (acts_[0] the gathered
  // inputs, acts_[L] the outputs), delta_/delta_next_ the back-propagated
  // gradient with respect to a layer's pre-activation output.
  int64_t capacity_ = 0;
  std::vector<std::vector<float>> acts_;
  std::vector<float*> act_ptrs_;  // acts_[i].data()
  std::vector<float> delta_;
  std::vector<float> delta_next_;
  // The passes' dL/dz of the layer being walked and its successor's
  // (pointing into delta_ and delta_next_, swapped each layer).
  float* pass_delta_ = nullptr;
  float* pass_delta_next_ = nullptr;
};

}  // namespace muonmesh::worker
