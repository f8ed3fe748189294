#include "worker/standalone.h"

#include <filesystem>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/plan/planner.h"
#include "core/base/status_macros.h"
#include "worker/comm/file_store.h"
#include "proto/job/job.h"
#include "proto/job/model_specs.h"
#include "proto/job/optimizer_rules.h"
#include "worker/workload_factory.h"

namespace muonmesh::worker {
absl::Status DescribeJob(const std::string& job_path, const LineSink& out) {
  MUONMESH_ASSIGN_OR_RETURN(job::ResolvedJob job, job::LoadResolvedJob(job_path));
  out(absl::StrCat("name=", job.name));
  out(absl::StrCat("device=", job.device));
  out(absl::StrCat("world_size=", job.world_size));
  out(absl::StrCat("steps=", job.steps));
  out(absl::StrCat("checkpoint_every=", job.checkpoint_every));
  out(absl::StrCat("max_restarts=", job.max_restarts));
  out(absl::StrCat("output_dir=", job.output_dir));
  out(absl::StrCat("export=", job.export_path));
  return absl::OkStatus();
}

absl::StatusOr<plan::Plan> PlanJob(const job::ResolvedJob& job) {
  MUONMESH_ASSIGN_OR_RETURN(plan::PlanInput input, job::PlanInputOf(job));
  MUONMESH_ASSIGN_OR_RETURN(plan::Plan plan, plan::ComputePlan(input),
                            "the planner rejects the job");
  return plan;
}

namespace {

absl::Status CheckRankOptions(const StandaloneOptions& options, const job::ResolvedJob& job) {
  if (options.world_size != job.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("--world-size ", options.world_size,
                                                   " differs from the job's world_size ",
                                                   job.world_size));
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank ", options.rank, " is outside [0, ", options.world_size, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<comm::FileStore>> OpenStore(const StandaloneOptions& options) {
  std::error_code ec;
  if (options.create_store) {
    // One level only: a mistyped parent is an error, not a new tree.
    std::filesystem::create_directory(options.store_dir, ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrCat("--store ", options.store_dir, ": cannot create: ", ec.message()));
    }
  } else if (!std::filesystem::is_directory(options.store_dir, ec)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--store ", options.store_dir,
                     ": no such folder (create it, or give --create-store)"));
  }
  return comm::FileStore::Open(options.store_dir);
}

bool IsLoopback(const std::string& host) {
  return absl::StartsWith(host, "127.") || host == "localhost" || host == "::1";
}

}  // namespace

absl::Status RunStandalone(const StandaloneOptions& options, const LineSink& out) {
  MUONMESH_ASSIGN_OR_RETURN(job::ResolvedJob job, job::LoadResolvedJob(options.job_path));
  MUONMESH_RETURN_IF_ERROR(CheckRankOptions(options, job));
  MUONMESH_ASSIGN_OR_RETURN(plan::Plan plan, PlanJob(job));
  MUONMESH_ASSIGN_OR_RETURN(std::unique_ptr<comm::FileStore> store, OpenStore(options));

  RankOptions rank;
  rank.rank = options.rank;
  rank.attempt = options.attempt;
  rank.group_prefix = absl::StrCat(job.name, "/attempt-", options.attempt);
  rank.hostname = options.hostname;
  rank.gloo_interface = options.gloo_interface;
  rank.timeout = options.timeout;
  rank.resume = options.resume;
  rank.fail_at_step = options.fail_at_step;
  rank.cuda_device = options.cuda_device;
  rank.memory_budget_bytes = options.memory_budget_bytes;
  // Ranks on loopback share this machine; elsewhere each has its own.
  rank.ranks_on_this_host = IsLoopback(options.hostname) ? job.world_size : 1;
  RankHooks hooks;
  hooks.out = out;
  return RunRank(job, plan, *store, rank, hooks);
}

}  // namespace muonmesh::worker
