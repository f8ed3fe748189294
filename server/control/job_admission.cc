#include "server/control/job_admission.h"

#include <filesystem>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/plan/plan_size.h"
#include "core/plan/validate.h"
#include "proto/job/allowed_dirs.h"
#include "proto/job/job.h"
#include "proto/job/model_kind.h"
#include "proto/job/model_specs.h"

namespace muonmesh::coordinator {
namespace {

// Paths in a submitted job are read and written by workers, on their own
// machines: a path relative to the client's folder would mean nothing there.
void CheckAbsolute(const std::string& field, const std::string& path,
                   std::vector<plan::FieldViolation>* v) {
  if (!path.empty() && !std::filesystem::path(path).is_absolute()) {
    v->push_back({field, absl::StrCat("'", path.substr(0, 200),
                                      "' is relative; a job submitted to a coordinator names "
                                      "absolute paths (muonmeshctl submit makes them so)")});
  }
}

void CheckPaths(const v1::JobSpec& spec, std::vector<plan::FieldViolation>* v) {
  if (spec.init().source_case() == v1::InitConfig::kSafetensors) {
    CheckAbsolute("init.safetensors", spec.init().safetensors(), v);
  }
  if (spec.init().source_case() == v1::InitConfig::kCheckpoint) {
    CheckAbsolute("init.checkpoint", spec.init().checkpoint(), v);
  }
  if (spec.data().source_case() == v1::DataConfig::kSafetensors) {
    CheckAbsolute("data.safetensors", spec.data().safetensors(), v);
  }
  if (spec.data().source_case() == v1::DataConfig::kText) {
    CheckAbsolute("data.text.train", spec.data().text().train(), v);
    CheckAbsolute("data.text.val", spec.data().text().val(), v);
  }
  if (spec.data().source_case() == v1::DataConfig::kTokens) {
    CheckAbsolute("data.tokens.train", spec.data().tokens().train(), v);
    CheckAbsolute("data.tokens.val", spec.data().tokens().val(), v);
  }
  if (spec.output().dir().empty()) {
    v->push_back({"output.dir", "required for a job submitted to a coordinator (an absolute "
                                "folder the workers can write; muonmeshctl submit fills it)"});
  }
  CheckAbsolute("output.dir", spec.output().dir(), v);
  CheckAbsolute("output.export", spec.output().export_(), v);
  // The coordinator plans without the workers' files: a file the model
  // section names travels inline.
  if (const std::optional<job::ModelFile> file = job::ModelFileOf(spec.model());
      file.has_value() && !file->given_inline) {
    v->push_back({file->field, "required inline for a job submitted to a coordinator "
                               "(muonmeshctl submit reads the file into the job)"});
  }
}

// The planner's checks, once the job file's pass.
absl::Status CheckPlan(const v1::JobSpec& spec, std::vector<plan::FieldViolation>* violations) {
  absl::StatusOr<plan::PlanInput> input = job::PlanInputOf(spec);
  if (!input.ok()) {
    violations->push_back({"model", std::string(input.status().message())});
    return absl::OkStatus();
  }
  for (plan::FieldViolation& v : plan::Validate(*input)) violations->push_back(std::move(v));
  if (!violations->empty()) return absl::OkStatus();
  MUONMESH_ASSIGN_OR_RETURN(plan::PlanSize size, plan::EstimatePlanSize(*input));
  for (plan::FieldViolation& v : plan::PlanSizeViolations(size)) {
    violations->push_back(std::move(v));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AdmitJob(const v1::JobSpec& spec, const std::vector<std::string>& allowed_dirs,
                      std::vector<plan::FieldViolation>* violations) {
  *violations = job::ValidateJob(spec);
  CheckPaths(spec, violations);
  if (violations->empty()) MUONMESH_RETURN_IF_ERROR(CheckPlan(spec, violations));
  if (!violations->empty()) {
    return absl::InvalidArgumentError(absl::StrCat("invalid job (", violations->size(),
                                                   " violation(s))"));
  }
  return job::CheckJobPathsAllowed(spec, allowed_dirs);
}

}  // namespace muonmesh::coordinator
