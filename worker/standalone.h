#pragma once

// Runs one rank of a job file to completion without a coordinator:
// `muonmesh-worker --standalone`. Ranks meet through a file store in a
// shared folder and talk over Gloo (TCP). The worker daemon runs the same
// rank under the coordinator; this stays for debugging and scripts.

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/plan/types.h"
#include "proto/job/job.h"
#include "worker/rank_runner.h"

namespace muonmesh::worker {

struct StandaloneOptions {
  std::string job_path;
  int32_t rank = 0;
  int64_t world_size = 0;  // must equal the job's world_size
  std::string store_dir;   // shared by all ranks; one per job attempt
  // Create store_dir (its parent must exist) instead of requiring it.
  bool create_store = false;
  // Host memory this rank may plan to use (worker/job/memory_budget.h); 0:
  // the default, DefaultMemoryBudgetBytes shared by the job's ranks when
  // they run on loopback (one machine), the whole default otherwise.
  int64_t memory_budget_bytes = 0;
  std::string hostname = "127.0.0.1";  // this rank's address for Gloo
  std::string gloo_interface;          // --gloo-interface (RankOptions)
  absl::Duration timeout = absl::Seconds(60);  // rendezvous and every collective
  int attempt = 0;  // part of every group name
  // Continue from the newest complete checkpoint under the job's output
  // folder (from step 0 when there is none).
  bool resume = false;
  // For tests of restarts: in the first attempt (attempt 0) only, fail
  // (exit non-zero) just before running this 0-based step; -1 never.
  int64_t fail_at_step = -1;
  // device: cuda jobs: the GPU to use; -1 means rank modulo the GPUs here.
  int cuda_device = -1;
};

// InvalidArgument for a bad job file, data or config (message names the
// field or file); ResourceExhausted when the job would not fit this rank's
// memory budget (checked before the job's data and shards are allocated);
// FailedPrecondition for a missing --store folder or an output path that
// must not be replaced; Unavailable / DeadlineExceeded when a peer is lost
// or late.
absl::Status RunStandalone(const StandaloneOptions& options, const LineSink& out);

// The plan the launcher runs `job` with: the planner on the job's input
// (job::PlanInputOf, as the coordinator plans a submitted job).
// InvalidArgument naming the rule, the file or the field the planner
// rejects.
absl::StatusOr<plan::Plan> PlanJob(const job::ResolvedJob& job);

// What launch scripts need from a job file, one `key=value` line each:
// name, world_size, steps, checkpoint_every, max_restarts, output_dir,
// export. Errors as loading and resolving the job.
absl::Status DescribeJob(const std::string& job_path, const LineSink& out);

}  // namespace muonmesh::worker
