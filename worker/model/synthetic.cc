#include "worker/model/synthetic.h"

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

constexpr double kInitScale = kSyntheticInitScale;
constexpr double kGradientScale = kSyntheticGradientScale;

}  // namespace

Synthetic::Synthetic(plan::ModelSpec spec, uint64_t gradient_seed)
    : spec_(std::move(spec)), gradient_seed_(gradient_seed) {
  for (const plan::UnitSpec& unit : spec_.units) {
    for (const plan::ParamSpec& p : unit.params) {
      int64_t n = 1;
      for (int64_t d : p.shape) n *= d;
      elements_.push_back(n);
      total_elements_ += n;
    }
  }
}

absl::StatusOr<Synthetic> Synthetic::Create(const plan::ModelSpec& spec, double scale,
                                            int64_t expert_divisor, uint64_t gradient_seed) {
  MUONMESH_ASSIGN_OR_RETURN(plan::ModelSpec scaled, ScaleModelSpec(spec, scale, expert_divisor));
  return Synthetic(std::move(scaled), gradient_seed);
}

absl::Status Synthetic::CheckTensors(size_t count, bool any_null, const char* what) const {
  if (count != elements_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": got ", count, " tensors, the spec has ",
                                                   elements_.size(), " parameters"));
  }
  if (any_null) return absl::InvalidArgumentError(absl::StrCat(what, ": null tensor"));
  return absl::OkStatus();
}

absl::Status Synthetic::Initialize(uint64_t seed, absl::Span<float* const> params) const {
  MUONMESH_RETURN_IF_ERROR(CheckTensors(params.size(), AnyNull(params), "synthetic init"));
  for (size_t p = 0; p < elements_.size(); ++p) {
    UniformStream(seed, kSyntheticInitStream + p).Fill(0, elements_[p], kInitScale, params[p]);
  }
  return absl::OkStatus();
}

absl::StatusOr<double> Synthetic::ForwardBackward(int64_t step,
                                                  absl::Span<const float* const> params,
                                                  absl::Span<const int64_t> samples,
                                                  absl::Span<float* const> grads) {
  if (step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("synthetic: step ", step, " is negative"));
  }
  MUONMESH_RETURN_IF_ERROR(CheckTensors(params.size(), AnyNull(params), "synthetic params"));
  MUONMESH_RETURN_IF_ERROR(CheckTensors(grads.size(), AnyNull(grads), "synthetic grads"));
  MUONMESH_RETURN_IF_ERROR(internal::CheckSampleList("synthetic", samples, 1, INT_MAX));
  const uint64_t seed = gradient_seed_ ^ (static_cast<uint64_t>(step) * kSplitMix64Gamma);
  double sum = 0.0;
  for (size_t p = 0; p < elements_.size(); ++p) {
    float* g = grads[p];
    UniformStream(seed, p).Fill(0, elements_[p], kGradientScale, g);
    for (int64_t k = 0; k < elements_[p]; ++k) sum += static_cast<double>(g[k]) * g[k];
  }
  return 0.5 * sum / static_cast<double>(total_elements_);
}

absl::StatusOr<double> Synthetic::ForwardBackwardByUnit(int64_t step, UnitAccess& units,
                                                        absl::Span<const int64_t> samples) {
  const int64_t ep = units.expert_parallel_size();
  MUONMESH_RETURN_IF_ERROR(CheckByUnitCall(step, samples, ep));
  const uint64_t seed = gradient_seed_ ^ (static_cast<uint64_t>(step) * kSplitMix64Gamma);
  double sum = 0.0;
  size_t p = 0;  // flat index of the unit's first parameter
  for (size_t u = 0; u < spec_.units.size(); ++u) {
    const size_t count = spec_.units[u].params.size();
    // The parameters are never read, but a real model gathers each unit for
    // its forward pass: acquire it (the traffic the plan counts) and let it
    // go before the gradients are written, so that the two never coexist.
    MUONMESH_RETURN_IF_ERROR(units.Acquire(static_cast<int>(u)).status());
    units.Release(static_cast<int>(u));
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> grads,
                              units.GradientBuffers(static_cast<int>(u)));
    if (grads.size() != count || AnyNull(grads)) {
      return absl::InvalidArgumentError(absl::StrCat("synthetic: unit ", u, " has ", grads.size(),
                                                     " gradient buffers, expected ", count,
                                                     " non-null"));
    }
    for (size_t j = 0; j < count; ++j, ++p) {
      float* g = grads[j];
      const UniformStream stream(seed, p);
      if (!spec_.units[u].params[j].expert || ep == 1) {
        stream.Fill(0, elements_[p], kGradientScale, g);
        for (int64_t k = 0; k < elements_[p]; ++k) sum += static_cast<double>(g[k]) * g[k];
        continue;
      }
      // My EP group's experts only; the loss still covers the whole stack,
      // in the same order (chunk by chunk, so memory stays the local part's).
      const int64_t local = elements_[p] / ep;
      const int64_t first = local * units.expert_parallel_index();
      stream.Fill(first, local, kGradientScale, g);
      std::vector<float> chunk(static_cast<size_t>(std::min<int64_t>(local, 1 << 16)));
      for (int64_t k = 0; k < elements_[p]; k += static_cast<int64_t>(chunk.size())) {
        const int64_t n = std::min<int64_t>(static_cast<int64_t>(chunk.size()), elements_[p] - k);
        stream.Fill(k, n, kGradientScale, chunk.data());
        for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(chunk[i]) * chunk[i];
      }
    }
    MUONMESH_RETURN_IF_ERROR(units.Commit(static_cast<int>(u)));
  }
  return 0.5 * sum / static_cast<double>(total_elements_);
}

absl::Status Synthetic::CheckByUnitCall(int64_t step, absl::Span<const int64_t> samples,
                                        int64_t ep) const {
  if (step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("synthetic: step ", step, " is negative"));
  }
  if (samples.empty()) return absl::InvalidArgumentError("synthetic: empty sample list");
  for (size_t j = 0; j < samples.size(); ++j) {
    if (samples[j] != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("synthetic: samples[", j, "] = ", samples[j], " is outside [0, 1)"));
    }
  }
  for (const plan::UnitSpec& unit : spec_.units) {
    for (const plan::ParamSpec& param : unit.params) {
      if (param.expert && (ep < 1 || param.shape[0] % ep != 0)) {
        return absl::InvalidArgumentError(absl::StrCat("synthetic: ", param.name, " has ",
                                                       param.shape[0], " experts, not a multiple of ",
                                                       ep, " expert-parallel groups"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Synthetic::InitializeUnit(uint64_t seed, int unit,
                                       absl::Span<float* const> params) const {
  if (unit < 0 || unit >= static_cast<int>(spec_.units.size())) {
    return absl::InvalidArgumentError(absl::StrCat("synthetic init: unit ", unit,
                                                   " is outside [0, ", spec_.units.size(), ")"));
  }
  const size_t count = spec_.units[unit].params.size();
  if (params.size() != count || AnyNull(params)) {
    return absl::InvalidArgumentError(absl::StrCat("synthetic init: unit ", unit, " needs ", count,
                                                   " non-null tensors, got ", params.size()));
  }
  size_t p = 0;
  for (int u = 0; u < unit; ++u) p += spec_.units[u].params.size();
  for (size_t j = 0; j < count; ++j, ++p) {
    UniformStream(seed, kSyntheticInitStream + p).Fill(0, elements_[p], kInitScale, params[j]);
  }
  return absl::OkStatus();
}

}  // namespace muonmesh::worker
