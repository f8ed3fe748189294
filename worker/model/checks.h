#pragma once

// Small argument checks the built-in workloads share (header-only).

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"

namespace muonmesh::worker::internal {

// Whether any pointer is null.
template <typename T>
bool AnyNull(absl::Span<T* const> ptrs) {
  return std::any_of(ptrs.begin(), ptrs.end(), [](T* p) { return p == nullptr; });
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

}  // namespace muonmesh::worker::internal
