#include "worker/model/workload.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"

namespace muonmesh::worker {

absl::StatusOr<double>
Workload::ForwardBackwardByUnit(int64_t step, UnitAccess &units,
                                absl::Span<const int64_t> samples) {
  const plan::ModelSpec &s = spec();
  const int n = static_cast<int>(s.units.size());
  if (units.expert_parallel_size() > 1) {
    for (const plan::UnitSpec &u : s.units) {
      for (const plan::ParamSpec &p : u.params) {
        if (p.expert) {
          return absl::UnimplementedError(absl::StrCat(
              "workload ", s.name, " does not split expert stacks over ",
              units.expert_parallel_size(), " expert-parallel groups (",
              p.name, ")"));
        }
      }
    }
  }
  std::vector<const float *> params;
  std::vector<float *> grads;
  int acquired = 0;
  auto release_all = [&] {
    for (int u = 0; u < acquired; ++u)
      units.Release(u);
  };
  for (int u = 0; u < n; ++u) {
    absl::StatusOr<absl::Span<const float *const>> p = units.Acquire(u);
    if (!p.ok()) {
      release_all();
      return p.status();
    }
    ++acquired;
    params.insert(params.end(), p->begin(), p->end());
    absl::StatusOr<absl::Span<float *const>> g = units.GradientBuffers(u);
    if (!g.ok()) {
      release_all();
      return g.status();
    }
    grads.insert(grads.end(), g->begin(), g->end());
  }
  absl::StatusOr<double> loss =
      ForwardBackward(step, params, samples, absl::MakeSpan(grads));
  if (!loss.ok()) {
    release_all();
    return loss.status();
  }
  for (int u = 0; u < n; ++u) {
    if (absl::Status st = units.Commit(u); !st.ok()) {
      release_all();
      return st;
    }
  }
  release_all();
  return loss;
}

absl::Status UnitAccess::ExchangeTokens(const float *send,
                                        absl::Span<const int64_t> send_counts,
                                        float *recv,
                                        absl::Span<const int64_t> recv_counts) {
  if (send_counts.size() != 1 || recv_counts.size() != 1 ||
      send_counts[0] != recv_counts[0] || send_counts[0] < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ExchangeTokens: with one expert-parallel group the counts must be "
        "one equal entry each (got ",
        send_counts.size(), " and ", recv_counts.size(), ")"));
  }
  std::copy(send, send + send_counts[0], recv);
  return absl::OkStatus();
}

absl::Status Workload::InitializeUnit(uint64_t seed, int unit,
                                      absl::Span<float *const> params) const {
  const plan::ModelSpec &s = spec();
  if (unit < 0 || unit >= static_cast<int>(s.units.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit ", unit, " is outside [0, ", s.units.size(), ")"));
  }
  if (params.size() != s.units[unit].params.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit ", unit, ": got ", params.size(),
                     " tensors, the unit has ", s.units[unit].params.size()));
  }
  std::vector<std::vector<float>> all;
  std::vector<float *> ptrs;
  size_t first = 0;
  for (size_t u = 0; u < s.units.size(); ++u) {
    if (static_cast<int>(u) == unit)
      first = all.size();
    for (const plan::ParamSpec &p : s.units[u].params) {
      int64_t elements = 1;
      for (int64_t d : p.shape)
        elements *= d;
      all.emplace_back(static_cast<size_t>(elements), 0.0f);
      ptrs.push_back(all.back().data());
    }
  }
  MUONMESH_RETURN_IF_ERROR(Initialize(seed, absl::MakeSpan(ptrs)));
  for (size_t j = 0; j < params.size(); ++j) {
    std::copy(all[first + j].begin(), all[first + j].end(), params[j]);
  }
  return absl::OkStatus();
}

absl::StatusOr<double> Workload::ValidationLossByUnit(UnitAccess&, absl::Span<const int64_t>) {
  return absl::UnimplementedError(
      absl::StrCat(spec().name, ": this workload has no validation data"));
}

WholeModelAccess::WholeModelAccess(const plan::ModelSpec& spec,
                                   absl::Span<const float* const> params,
                                   absl::Span<float* const> grads)
    : model_(spec.name), params_(params), grads_(grads) {
  size_t first = 0;
  for (const plan::UnitSpec& unit : spec.units) {
    first_.push_back(first);
    count_.push_back(unit.params.size());
    first += unit.params.size();
  }
}

absl::StatusOr<absl::Span<const float* const>> WholeModelAccess::Acquire(int unit) {
  if (unit < 0 || static_cast<size_t>(unit) >= first_.size()) {
    return absl::InternalError(absl::StrCat(model_, ": no unit ", unit));
  }
  return params_.subspan(first_[unit], count_[unit]);
}

absl::StatusOr<absl::Span<float* const>> WholeModelAccess::GradientBuffers(int unit) {
  if (grads_.empty()) return absl::InternalError(absl::StrCat(model_, ": no gradient buffers"));
  if (unit < 0 || static_cast<size_t>(unit) >= first_.size()) {
    return absl::InternalError(absl::StrCat(model_, ": no unit ", unit));
  }
  return grads_.subspan(first_[unit], count_[unit]);
}

absl::Status Workload::SetBuffers(absl::Span<const std::vector<float>> values) {
  if (!values.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(spec().name, " has no buffers, got ",
                                                   values.size()));
  }
  return absl::OkStatus();
}

}  // namespace muonmesh::worker
