#include "core/model/mlp_spec.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"

namespace muonmesh::model {
namespace {

int64_t NumLayers(absl::Span<const int64_t> dims) { return static_cast<int64_t>(dims.size()) - 1; }

}  // namespace

absl::Status ValidateMlpDims(absl::Span<const int64_t> dims) {
  if (dims.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("mlp dims: need at least 2 (input and output), got ", dims.size()));
  }
  if (NumLayers(dims) > kMlpMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("mlp dims: ", NumLayers(dims), " layers exceed the limit of ", kMlpMaxLayers));
  }
  for (size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] < 1 || dims[i] > kMlpMaxDim) {
      return absl::InvalidArgumentError(
          absl::StrCat("mlp dims[", i, "]: ", dims[i], " is not in [1, ", kMlpMaxDim, "]"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<plan::ModelSpec> MlpSpec(absl::Span<const int64_t> dims) {
  MUONMESH_RETURN_IF_ERROR(ValidateMlpDims(dims));
  plan::ModelSpec spec;
  spec.name = "mlp";
  for (int64_t i = 0; i < NumLayers(dims); ++i) {
    plan::UnitSpec unit;
    unit.name = absl::StrCat("layers.", i);
    unit.params.push_back(
        plan::ParamSpec{absl::StrCat(unit.name, ".weight"), {dims[i + 1], dims[i]}, "muon", false});
    unit.params.push_back(
        plan::ParamSpec{absl::StrCat(unit.name, ".bias"), {dims[i + 1]}, "adamw", false});
    // ForwardBackwardByUnit gathers every layer but the last again for the
    // backward pass.
    unit.gathers_per_step = i + 1 < NumLayers(dims) ? 2 : 1;
    spec.units.push_back(std::move(unit));
  }
  return spec;
}

}  // namespace muonmesh::model
