#pragma once

// Whether the coordinator takes a submitted job (docs/architecture.md §7): the job
// file's rules (job::ValidateJob), the rules of a job run by workers on
// other machines (absolute paths, an output folder, model files inline),
// the planner's checks against the model (plan::Validate) and its size
// limits (a job that validates may still need more memory to plan than the
// coordinator allows), and the allowed folders. Stateless; the store's own
// checks (duplicates, bounds, output folders in use) come after it.

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/plan/types.h"
#include "muonmesh/v1/jobs.pb.h"

namespace muonmesh::coordinator {

// OK when `spec` may be stored; InvalidArgument with every violation in
// `violations` (field paths as in the job file), or PermissionDenied naming
// the fields whose paths lie outside `allowed_dirs` (resolved folders;
// empty: no restriction).
absl::Status AdmitJob(const v1::JobSpec& spec, const std::vector<std::string>& allowed_dirs,
                      std::vector<plan::FieldViolation>* violations);

}  // namespace muonmesh::coordinator
