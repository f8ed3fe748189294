#pragma once

// The built-in `synthetic` workload (design §6): any model spec, no model.
// It benchmarks the optimizer path at real model shapes, so its "gradients"
// are deterministic pseudo-random numbers and its loss is a number that
// depends on nothing but the step. Exact definition (UniformAt and
// kSplitMix64Gamma = 0x9E3779B97F4A7C15 from worker/model/rng.h):
//
// Shapes. ScaleModelSpec: every dimension d of every parameter becomes
//   ScaleDim(d) = max(1, llround(d * scale))   (d * scale in double; halves
//                                              round away from zero)
// except the expert count E (dimension 0 of an `expert` stack), which
// becomes ScaleDim(E) rounded up to a multiple of `expert_divisor` (pass the
// expert-parallel size, so that experts split evenly over EP groups). Names,
// units, optimizers and expert flags are unchanged; every unit's
// gathers_per_step becomes 1 (the workload gathers each unit once).
//
// Parameters are numbered p = 0, 1, ... in flat order (units in order,
// parameters in order within a unit); k is an element's row-major index.
//
// Initial weights from seed `seed`:
//   param p element k = float(double(UniformAt(seed, p + 2^20, k)) * 0.02)
//
// Gradients at step s (s >= 0), from the workload's `gradient_seed` g:
//   grad p element k  = float(double(UniformAt(g ^ (s * kSplitMix64Gamma), p, k)) * 0.01)
// (s * kSplitMix64Gamma modulo 2^64). Independent of the parameters and of
// the samples, so every data-parallel rank computes the same gradients and
// their average is the same again.
//
// Loss at step s: 0.5 * (sum over every element of every parameter of the
// gradient value squared, the floats above widened to double and summed in
// flat order) / (total number of elements).
//
// The dataset has one sample (num_samples() == 1): the batch formula maps
// every sample index to 0, and samples are otherwise ignored.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/plan/types.h"
#include "core/model/synthetic_spec.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

using model::kSyntheticMaxTensorElements;
using model::ScaleDim;
using model::ScaleModelSpec;

// The factor of the gradients (0.01) and of the initial weights (0.02).
inline constexpr double kSyntheticGradientScale = 0.01;
inline constexpr double kSyntheticInitScale = 0.02;

// First stream of the initial weights (parameter p uses stream p + this).
inline constexpr uint64_t kSyntheticInitStream = uint64_t{1} << 20;

// Holds a scaled spec and generates its gradients. One instance per rank.
// Thread-compatible; it keeps no scratch, so const methods and
// ForwardBackward on distinct instances may run concurrently.
class Synthetic final : public Workload {
 public:
  // `spec` scaled by ScaleModelSpec(spec, scale, expert_divisor); errors are
  // its errors.
  static absl::StatusOr<Synthetic> Create(const plan::ModelSpec& spec, double scale,
                                          int64_t expert_divisor, uint64_t gradient_seed);

  // Create on the ModelSpec file at `path` (JSON or YAML, the format of
  // specs/). NotFound for a missing file, InvalidArgument for one
  // that does not parse or a spec Create rejects.
  static absl::StatusOr<Synthetic> FromSpecFile(const std::string& path, double scale,
                                                int64_t expert_divisor, uint64_t gradient_seed);

  const plan::ModelSpec& spec() const override { return spec_; }
  int64_t num_samples() const override { return 1; }

  // The documented initial weights. InvalidArgument if params does not hold
  // one non-null pointer per parameter.
  absl::Status Initialize(uint64_t seed, absl::Span<float* const> params) const override;

  // Writes the documented gradients of `step` and returns the loss. The
  // parameters are not read. InvalidArgument, with grads untouched, for
  // step < 0, empty samples, a sample other than 0, or params/grads that do
  // not hold one non-null pointer per parameter.
  absl::StatusOr<double> ForwardBackward(int64_t step, absl::Span<const float* const> params,
                                         absl::Span<const int64_t> samples,
                                         absl::Span<float* const> grads) override;

  // The same gradients and loss as ForwardBackward, bit for bit, unit by
  // unit: for each unit in order, Acquire(u), Release(u) (the parameters are
  // not read, but a real model's forward pass gathers each unit once, so the
  // traffic stays the plan's), GradientBuffers(u), fill, Commit(u). At most
  // one unit's parameters or one unit's gradients are held at a time, never
  // both. With EP > 1 groups an expert stack's buffer holds this rank's
  // experts (UnitAccess): it gets their slice of the documented gradient
  // (the same on every rank, so the mean over EP ranks is itself), and the
  // loss still sums the whole stack. Errors as ForwardBackward's (checked
  // before the first unit), an expert count that does not split over the
  // groups, or from `units`.
  absl::StatusOr<double> ForwardBackwardByUnit(int64_t step, UnitAccess& units,
                                               absl::Span<const int64_t> samples) override;

  // The documented initial weights of one unit's parameters.
  absl::Status InitializeUnit(uint64_t seed, int unit,
                              absl::Span<float* const> params) const override;

  // The checks of ForwardBackwardByUnit before it touches a unit: step >= 0,
  // samples all 0 and not empty, every expert stack splitting over `ep`
  // groups (shared with the GPU form, worker/model/synthetic_cuda.h).
  absl::Status CheckByUnitCall(int64_t step, absl::Span<const int64_t> samples,
                               int64_t ep) const;

  // Elements of parameter p (flat order) and of all parameters together.
  const std::vector<int64_t>& param_elements() const { return elements_; }
  int64_t total_elements() const { return total_elements_; }
  uint64_t gradient_seed() const { return gradient_seed_; }

 private:
  Synthetic(plan::ModelSpec spec, uint64_t gradient_seed);

  absl::Status CheckTensors(size_t count, bool any_null, const char* what) const;

  plan::ModelSpec spec_;
  uint64_t gradient_seed_ = 0;
  std::vector<int64_t> elements_;
  int64_t total_elements_ = 0;
};

}  // namespace muonmesh::worker
