#include "proto/job/model_specs.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/plan/buckets.h"
#include "core/plan/waves.h"
#include "proto/convert/plan_convert.h"
#include "proto/job/job.h"
#include "proto/job/model_kind.h"
#include "proto/job/optimizer_rules.h"

namespace muonmesh::job {
namespace {

absl::StatusOr<plan::ModelSpec> SpecOf(const ModelKind& kind, const ModelForm& form,
                                       int64_t expert_parallel_size) {
  return kind.spec(form, std::max<int64_t>(1, expert_parallel_size));
}

absl::StatusOr<plan::PlanInput> PlanInputWith(const v1::JobSpec& job, const ModelKind& kind,
                                              const ModelForm& form) {
  MUONMESH_ASSIGN_OR_RETURN(
      plan::ModelSpec model,
      SpecOf(kind, form, job.parallelism().expert_model_parallel_size()));
  const v1::MuonConfig& muon = job.optimizer().muon();
  if ((muon.split_qkv() || muon.per_head()) && kind.attention_blocks != nullptr) {
    kind.attention_blocks(form, muon.split_qkv(), muon.per_head(), &model);
  }
  plan::PlanInput input;
  MUONMESH_ASSIGN_OR_RETURN(input.model,
                            ApplyOptimizerRules(std::move(model), OptimizerRulesOf(job)));
  input.world_size = job.world_size();
  input.parallelism = convert::ParallelismFromProto(job.parallelism());
  input.options = PlanOptionsOf(job);
  input.options.reshard_after_forward = ReshardsAfterForward(job, input.model);
  return input;
}

absl::StatusOr<const ModelKind*> KindOf(const v1::ModelConfig& model) {
  const ModelKind* kind = FindModelKind(model.kind_case());
  if (kind == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("model: required (", AllKindNames(), ")"));
  }
  return kind;
}

}  // namespace

absl::StatusOr<plan::ModelSpec> ModelSpecOf(const v1::ModelConfig& model,
                                            int64_t expert_parallel_size,
                                            const std::string& job_dir) {
  MUONMESH_ASSIGN_OR_RETURN(const ModelKind* kind, KindOf(model));
  return SpecOf(*kind, kind->resolve(model, job_dir), expert_parallel_size);
}

absl::StatusOr<plan::ModelSpec> ModelSpecOf(const ResolvedJob& job) {
  MUONMESH_ASSIGN_OR_RETURN(const ModelKind* kind, KindOf(job.model));
  return SpecOf(*kind, job.model_form, job.parallelism.expert_model_parallel_size);
}

plan::PlanOptions PlanOptionsOf(const v1::JobSpec& job) {
  plan::PlanOptions o;
  o.owner_assignment = job.optimizer().owner_assignment();
  o.muon_replica_split = job.optimizer().muon_replica_split();
  o.ns_steps = job.optimizer().muon().ns_steps();
  o.ns_algorithm = job.optimizer().muon().ns_algorithm();
  o.ns_coefficients = job.optimizer().muon().coefficients();
  o.device = DeviceOf(job);
  o.threads_per_rank = job.training().threads_per_rank();
  // The waves the workers will cut (they overlap two on the CPU).
  o.muon_wave_budget_bytes =
      plan::JobWaveBudget(job.optimizer().muon_buffer_bytes(), o.device);
  o.reshard_after_forward = !job.communication().has_reshard_after_forward() ||
                            job.communication().reshard_after_forward();
  return o;
}

bool ReshardsAfterForward(const v1::JobSpec& job, const plan::ModelSpec& model) {
  const v1::CommunicationConfig& c = job.communication();
  if (c.has_reshard_after_forward()) return c.reshard_after_forward();
  return !plan::ModelFitsOneBucket(
      model, c.has_bucket_bytes() ? c.bucket_bytes() : plan::kDefaultBucketBytes);
}

absl::StatusOr<plan::PlanInput> PlanInputOf(const v1::JobSpec& job, const std::string& job_dir) {
  MUONMESH_ASSIGN_OR_RETURN(const ModelKind* kind, KindOf(job.model()));
  return PlanInputWith(job, *kind, kind->resolve(job.model(), job_dir));
}

absl::StatusOr<plan::PlanInput> PlanInputOf(const ResolvedJob& job) {
  MUONMESH_ASSIGN_OR_RETURN(const ModelKind* kind, KindOf(job.model));
  return PlanInputWith(job.spec, *kind, job.model_form);
}

}  // namespace muonmesh::job
