#pragma once

// muonmeshctl's planner commands: `validate` (does a parallelism config fit
// a model?) and `plan` (the meshes, shard layout and Muon owners, from a
// spec and flags or from a job file). Each parses its arguments, prints to
// stdout/stderr and returns the process exit code (client/cli_flags.h).

#include <string>
#include <vector>

namespace muonmesh::client {

int RunValidate(const std::vector<std::string>& args);
int RunPlan(const std::vector<std::string>& args);

}  // namespace muonmesh::client
