#pragma once

// The planner: for a model and a parallelism config, the meshes and their
// placements, each unit's row-aligned shard layout, each Muon matrix's owner,
// per-rank loads and the bytes each collective moves per step.
//
// Pure and deterministic: the same input gives the same plan on every rank
// and every run. Thread-compatible (no shared state).

#include "absl/status/statusor.h"
#include "server/plan/types.h"

namespace muonmesh::plan {

// InvalidArgument (listing every violation) when Validate() finds any.
absl::StatusOr<Plan> ComputePlan(const PlanInput& input);

// Padding of Megatron-FSDP's LCM rule on the same units and domains, for
// comparison.
int64_t MegatronPaddingElements(const PlanInput& input);

}  // namespace muonmesh::plan
