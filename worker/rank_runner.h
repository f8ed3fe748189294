#pragma once

// Runs one rank of one job attempt to its end with a given plan: the part of
// a worker's life that the standalone launcher and the daemon (which gets
// its plan and rendezvous from the coordinator) share.
//
// In order: the memory check (worker/job/memory_estimate.h) before anything
// sized by the job is allocated; the device, the workload and its data; the
// Trainer (process groups through `store`); a fresh start (older
// checkpoints removed by rank 0) or a resume from the newest complete
// checkpoint; the steps, each handed to the hooks; checkpoints every
// training.checkpoint_every steps; and the final weights, which rank 0
// streams into output.export.
//
// Driven by one thread; the hooks run on it.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/plan/types.h"
#include "worker/comm/abort.h"
#include "worker/comm/store.h"
#include "proto/job/job.h"
#include "worker/model/workload.h"
#include "worker/runtime/trainer.h"

namespace muonmesh::worker {

struct RankOptions {
  int32_t rank = 0;
  int attempt = 0;
  // Prefix of every process group's name: unique per job attempt.
  std::string group_prefix;
  std::string hostname = "127.0.0.1";  // this rank's address for Gloo
  // The network interface Gloo binds (--gloo-interface); empty: `hostname`.
  std::string gloo_interface;
  absl::Duration timeout = absl::Seconds(60);  // rendezvous and every collective
  bool resume = false;
  // Tests of restarts: in attempt 0, fail just before this 0-based step.
  int64_t fail_at_step = -1;
  int cuda_device = -1;  // -1: rank modulo the GPUs here
  // Host memory this rank may plan to use; 0: DefaultMemoryBudgetBytes
  // shared by `ranks_on_this_host`.
  int64_t memory_budget_bytes = 0;
  int64_t ranks_on_this_host = 1;
  // Ends the rank's collectives when it fires (a stop from the coordinator);
  // null: none. Must outlive the run.
  comm::AbortSignal* abort = nullptr;
};

// One line per event for people.
using LineSink = std::function<void(const std::string&)>;

struct RankHooks {
  // Human-readable progress (rank 0 prints per-step loss and phases). May be
  // empty.
  LineSink out;
  // After every step with its report and wall time; a non-OK status stops
  // the run with that status (a cancel, a lost coordinator). May be empty.
  std::function<absl::Status(const StepReport&, absl::Duration)> on_step;
  // Asked after on_step returns OK: true stops the run after writing this
  // step's checkpoint (a drain; every rank is told at the same step), with
  // a Cancelled status. May be empty.
  std::function<bool()> stop_after_checkpoint;
};

// Runs the rank (it makes the job's workload). Errors: ResourceExhausted from the memory check,
// InvalidArgument for bad data or a plan that does not fit the workload, Unavailable /
// DeadlineExceeded for lost or late peers, the hooks' own statuses.
absl::Status RunRank(const job::ResolvedJob& job, const plan::Plan& plan, comm::Store& store,
                     const RankOptions& options, const RankHooks& hooks);

namespace internal {
// The median of `values` after the first (all of them when there is one:
// the first step touches every page of the state), the middle two
// averaged for an even count; 0 for none. The summary line's
// optimizer_ms_median.
double MedianAfterFirst(const std::vector<double>& values);
}  // namespace internal

}  // namespace muonmesh::worker
