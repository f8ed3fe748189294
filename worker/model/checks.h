#pragma once

// Small argument checks the built-in workloads share (header-only).

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"

namespace muonmesh::worker::internal {

// Whether any pointer is null.
template <typename T>
bool AnyNull(absl::Span<T* const> ptrs) {
  return std::any_of(ptrs.begin(), ptrs.end(), [](T* p) { return p == nullptr; });
}

// InvalidArgument "WORKLOAD: unit U WHAT: N tensors, expected WANT non-null"
// unless `tensors` holds `want` non-null pointers.
template <typename T>
absl::Status CheckUnitTensors(const char* workload, absl::Span<T* const> tensors, size_t want,
                              const char* what, int unit) {
  if (tensors.size() != want || AnyNull(tensors)) {
    return absl::InvalidArgumentError(absl::StrCat(workload, ": unit ", unit, " ", what, ": ",
                                                   tensors.size(), " tensors, expected ", want,
                                                   " non-null"));
  }
  return absl::OkStatus();
}

// InvalidArgument "WHAT[k] is not finite (v)" for the first NaN or infinity.
inline absl::Status CheckFinite(absl::Span<const float> values, const char* what) {
  for (size_t k = 0; k < values.size(); ++k) {
    if (!std::isfinite(values[k])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "[", k, "] is not finite (", values[k], ")"));
    }
  }
  return absl::OkStatus();
}

// The sample list a workload's ForwardBackward* takes: not empty, at most
// `max_per_call` indices, each in [0, num_samples). InvalidArgument errors
// that start with `workload` ("mlp: samples[3] = 9 is outside [0, 8)").
inline absl::Status CheckSampleList(const char* workload, absl::Span<const int64_t> samples,
                                    int64_t num_samples, int64_t max_per_call) {
  if (samples.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(workload, ": empty sample list"));
  }
  if (static_cast<int64_t>(samples.size()) > max_per_call) {
    return absl::InvalidArgumentError(absl::StrCat(workload, ": ", samples.size(),
                                                   " samples in one call exceed ", max_per_call));
  }
  for (size_t j = 0; j < samples.size(); ++j) {
    if (samples[j] < 0 || samples[j] >= num_samples) {
      return absl::InvalidArgumentError(absl::StrCat(workload, ": samples[", j, "] = ", samples[j],
                                                     " is outside [0, ", num_samples, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace muonmesh::worker::internal
