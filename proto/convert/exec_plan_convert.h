#pragma once

// plan::Plan <-> v1::ExecutionPlan, the plan a coordinator sends with each
// assignment. Lossless both ways: PlanFromExec(PlanToExec(p)) == p field by
// field, so a worker executes exactly the coordinator's plan.
//
// Free functions; any thread may call them.

#include <string>

#include "absl/status/statusor.h"
#include "muonmesh/v1/execution_plan.pb.h"
#include "core/plan/types.h"

namespace muonmesh::convert {

v1::ExecutionPlan PlanToExec(const plan::Plan& plan);

// InvalidArgument naming the field for a message no PlanToExec made: arrays
// of different lengths, indices out of range, enum values out of range.
absl::StatusOr<plan::Plan> PlanFromExec(const v1::ExecutionPlan& exec);

// A digest of the plan (of its deterministic serialization), that workers
// compare with the assignment's plan_fingerprint.
std::string PlanFingerprint(const v1::ExecutionPlan& exec);

}  // namespace muonmesh::convert
