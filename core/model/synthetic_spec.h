#pragma once

// The `synthetic` model's parameters: any model spec scaled (the shapes rule
// of worker/model/synthetic.h). Pure.

#include <cstdint>

#include "absl/status/statusor.h"
#include "core/plan/types.h"

namespace muonmesh::model {

// Largest scaled tensor accepted, in elements: keeps every size and index
// representable (memory is the runtime's concern).
inline constexpr int64_t kSyntheticMaxTensorElements = int64_t{1} << 40;

// max(1, llround(d * scale)). The caller validates scale (finite, > 0) and
// keeps d * scale below 2^62.
int64_t ScaleDim(int64_t d, double scale);

// The scaled spec (the shapes rule of worker/model/synthetic.h). InvalidArgument naming the field
// (`units[3].params[2].shape[1]`) for a spec without parameters, a
// parameter with no shape, a non-positive dim, an expert stack with fewer
// than two dims, a scale that is not finite and > 0, expert_divisor < 1, or
// a scaled tensor beyond kSyntheticMaxTensorElements.
absl::StatusOr<plan::ModelSpec> ScaleModelSpec(const plan::ModelSpec& spec, double scale,
                                               int64_t expert_divisor);

}  // namespace muonmesh::model
