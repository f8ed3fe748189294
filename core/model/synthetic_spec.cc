#include "core/model/synthetic_spec.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace muonmesh::model {

int64_t ScaleDim(int64_t d, double scale) {
  return std::max<int64_t>(1, std::llround(static_cast<double>(d) * scale));
}

absl::StatusOr<plan::ModelSpec> ScaleModelSpec(const plan::ModelSpec& spec, double scale,
                                               int64_t expert_divisor) {
  if (!std::isfinite(scale) || scale <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic scale: ", scale, " is not a finite number > 0"));
  }
  if (expert_divisor < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic expert_divisor: ", expert_divisor, " is < 1"));
  }
  // Every scaled dim stays below this, so products of two never overflow
  // before the element check below.
  const double max_dim = static_cast<double>(kSyntheticMaxTensorElements);
  plan::ModelSpec out = spec;
  int64_t params = 0;
  for (size_t u = 0; u < out.units.size(); ++u) {
    out.units[u].gathers_per_step = 1;  // ForwardBackwardByUnit gathers each unit once
    for (size_t i = 0; i < out.units[u].params.size(); ++i) {
      plan::ParamSpec& p = out.units[u].params[i];
      const std::string field = absl::StrCat("units[", u, "].params[", i, "]");
      if (p.shape.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".shape: ", p.name, " has no dims"));
      }
      if (p.expert && p.shape.size() < 2) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".shape: expert stack ", p.name,
                                                       " needs [E, rows, ...], got one dim"));
      }
      int64_t elements = 1;
      for (size_t k = 0; k < p.shape.size(); ++k) {
        const int64_t d = p.shape[k];
        if (d < 1) {
          return absl::InvalidArgumentError(
              absl::StrCat(field, ".shape[", k, "]: ", d, " is not positive"));
        }
        if (static_cast<double>(d) * scale > max_dim) {
          return absl::InvalidArgumentError(absl::StrCat(field, ".shape[", k, "]: ", d, " * ",
                                                         scale, " exceeds ",
                                                         kSyntheticMaxTensorElements));
        }
        int64_t scaled = ScaleDim(d, scale);
        if (p.expert && k == 0) {
          scaled = (scaled + expert_divisor - 1) / expert_divisor * expert_divisor;
        }
        p.shape[k] = scaled;
        if (scaled > kSyntheticMaxTensorElements / elements) {
          return absl::InvalidArgumentError(absl::StrCat(field, ".shape: ", p.name, " scaled by ",
                                                         scale, " exceeds ",
                                                         kSyntheticMaxTensorElements, " elements"));
        }
        elements *= scaled;
      }
      ++params;
    }
  }
  if (params == 0) return absl::InvalidArgumentError("units: the spec has no parameters");
  return out;
}

}  // namespace muonmesh::model
