#pragma once

// The one place that maps a job's model section to its parameter list (the
// planner's input before the optimizer rules): the coordinator plans with it
// and every worker checks the plan it receives against it, so the two cannot
// disagree. A new model kind adds its spec builder in core/model/ and one
// case here; its workloads (CPU and CUDA) go in worker/workload_factory.cc
// (docs/architecture.md, "Adding a model kind").

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "core/plan/types.h"
#include "muonmesh/v1/config.pb.h"
#include "proto/job/job.h"

namespace muonmesh::job {

// The spec of `model`, from its dimensions alone (no weights, no data).
// A synthetic model takes its spec inline (model.synthetic.model) or, when
// that is absent, from the file `synthetic_spec_path` (YAML or JSON),
// scaled by model.synthetic.scale with expert stacks split
// `expert_parallel_size` ways (values < 1 mean 1). InvalidArgument naming
// the field or the file for a model it cannot build.
absl::StatusOr<plan::ModelSpec> ModelSpecOf(const v1::ModelConfig& model,
                                            int64_t expert_parallel_size,
                                            const std::string& synthetic_spec_path);

// The same for a resolved job (its model section, EP and resolved spec path).
absl::StatusOr<plan::ModelSpec> ModelSpecOf(const ResolvedJob& job);

}  // namespace muonmesh::job
