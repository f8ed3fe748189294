#pragma once

// The planner: for a model and a parallelism config, the meshes and their
// placements, each unit's row-aligned shard layout, each Muon matrix's owner,
// per-rank loads and the bytes each collective moves per step.
//
// Pure and deterministic: the same input gives the same plan on every rank
// and every run. Thread-compatible (no shared state).

#include "absl/status/statusor.h"
#include "core/plan/cancel.h"
#include "core/plan/types.h"

namespace muonmesh::plan {

// InvalidArgument (listing every violation) when Validate() finds any. Its
// time is bounded by the input's size (Validate's limits; the owner
// refinement's work budget, owners.h).
absl::StatusOr<Plan> ComputePlan(const PlanInput& input);

// The same, ticking `cancel` as it works: CancelToken::Status() (Cancelled)
// soon after the token says stop. A token that never says stop gives the
// same plan as the overload above.
absl::StatusOr<Plan> ComputePlan(const PlanInput& input, CancelToken* cancel);

// Padding of Megatron-FSDP's LCM rule on the same units and domains, for
// comparison; the config's errors when it does not resolve.
absl::StatusOr<int64_t> MegatronPaddingElements(const PlanInput& input);

}  // namespace muonmesh::plan
