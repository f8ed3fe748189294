#pragma once

// The `moe_mlp` model's parameters (worker/model/moe_mlp.h defines the
// model): units `input`, `moe` (router and the expert stacks
// experts.w1 [E, d_e, d], experts.w2 [E, d, d_e]) and `output`. Pure.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/plan/types.h"

namespace muonmesh::model {

struct MoeMlpDims {
  int64_t d_in = 0;
  int64_t d_model = 0;
  int64_t d_expert = 0;
  int64_t num_experts = 0;
  int64_t d_out = 0;
};

// Limits that keep sizes and cblas's int arguments in range: each dim, the
// expert count, and the number of floats in x, y or one tensor.
inline constexpr int64_t kMoeMaxDim = int64_t{1} << 16;
inline constexpr int64_t kMoeMaxExperts = 4096;
inline constexpr int64_t kMoeMaxElements = int64_t{1} << 30;
// Token counts travel as floats in the exchange: at most 2^24 samples per
// call.
inline constexpr int64_t kMoeMaxSamplesPerCall = int64_t{1} << 24;

// OK, or InvalidArgument naming the field (d_in, d_model, ...).
absl::Status ValidateMoeMlpDims(const MoeMlpDims& dims);

// The spec (named "moe_mlp"): the three units above; `moe` is gathered twice
// a step.
absl::StatusOr<plan::ModelSpec> MoeMlpSpec(const MoeMlpDims& dims);

// The seven parameter shapes in flat order.
std::vector<std::vector<int64_t>> MoeMlpShapes(const MoeMlpDims& dims);

}  // namespace muonmesh::model
