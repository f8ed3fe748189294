#pragma once

// The `mlp` model's parameters (worker/model/mlp.h defines the model): one
// unit `layers.{i}` per layer, its weight [d_{i+1}, d_i] (Muon) then its bias
// [d_{i+1}] (AdamW). Pure: the coordinator plans from it without the model.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/plan/types.h"

namespace muonmesh::model {

// Limits that keep every size representable (and cblas's int arguments in
// range): each dim, the number of layers, and the number of floats in x or y.
inline constexpr int64_t kMlpMaxDim = int64_t{1} << 20;
inline constexpr int64_t kMlpMaxLayers = 1024;
inline constexpr int64_t kMlpMaxDataElements = int64_t{1} << 30;

// OK, or InvalidArgument naming the offending entry: at least two dims, each
// in [1, kMlpMaxDim], at most kMlpMaxLayers layers.
absl::Status ValidateMlpDims(absl::Span<const int64_t> dims);

// The mlp's model spec (named "mlp"): the units above; every unit but the
// last is gathered twice a step (forward, then again for the backward pass).
absl::StatusOr<plan::ModelSpec> MlpSpec(absl::Span<const int64_t> dims);

}  // namespace muonmesh::model
