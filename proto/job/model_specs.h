#pragma once

// From a job to the planner, written once: the model's parameter list (its
// kind's spec builder, proto/job/model_kind.h) and the planner's whole input
// (that list with the optimizer rules applied, the world size, the
// parallelism config and the planner options with the job file's defaults).
// The coordinator plans with PlanInputOf; every worker checks the plan it
// receives against the same function's result (worker/rank_runner.cc), so
// the two cannot disagree.
//
// Free functions with no shared state: any thread may call them.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "core/plan/types.h"
#include "muonmesh/v1/config.pb.h"
#include "proto/job/job.h"

namespace muonmesh::job {

// The spec of `model`, from its dimensions alone (no weights, no data), with
// expert stacks split `expert_parallel_size` ways (values < 1 mean 1). A
// file the section names (synthetic's spec, unless given inline) is read
// from its path joined to `job_dir` ("": as written). InvalidArgument
// naming the field or the file for a model it cannot build.
absl::StatusOr<plan::ModelSpec> ModelSpecOf(const v1::ModelConfig& model,
                                            int64_t expert_parallel_size,
                                            const std::string& job_dir);

// The same for a resolved job (its kind, resolved form and EP).
absl::StatusOr<plan::ModelSpec> ModelSpecOf(const ResolvedJob& job);

// The planner options of a job (PlanInput::options): the job file's
// defaults applied (device cpu), the Newton-Schulz settings as the planner
// names them, and the wave budget the workers will cut the Muon phase by.
// Without the model, an unset reshard_after_forward is true here
// (PlanInputOf resolves it over the model: ReshardsAfterForward).
plan::PlanOptions PlanOptionsOf(const v1::JobSpec& job);

// communication.reshard_after_forward of `job` over its model's spec: as
// given; unset, false exactly when the model fits one bucket of the job's
// communication.bucket_bytes (plan::ModelFitsOneBucket: holding it then
// costs no peak memory and saves the backward pass's gather), else true.
bool ReshardsAfterForward(const v1::JobSpec& job, const plan::ModelSpec& model);

// The planner's whole input for `job` (valid), the section's file read from
// `job_dir` as ModelSpecOf does (the coordinator passes "": a submitted job
// carries its files inline).
absl::StatusOr<plan::PlanInput> PlanInputOf(const v1::JobSpec& job,
                                            const std::string& job_dir = "");

// The same for a resolved job, with its files read from their resolved
// paths (the workers' and the standalone launcher's form).
absl::StatusOr<plan::PlanInput> PlanInputOf(const ResolvedJob& job);

}  // namespace muonmesh::job
