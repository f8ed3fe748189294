#pragma once

// muonmeshctl's job commands on the client library: submit, status, list,
// watch, metrics, cancel, workers. Each prints to the given streams and
// returns the process exit code (see ExitCode). Flag parsing stays in
// muonmeshctl_main.cc.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/coordinator_client.h"

namespace muonmesh::client {

// Exit codes of muonmeshctl, which scripts rely on.
inline constexpr int kExitOk = 0;
inline constexpr int kExitInvalid = 1;      // the config or job is invalid
inline constexpr int kExitUsage = 2;        // usage error, or a file that does not load
inline constexpr int kExitUnreachable = 3;  // the coordinator cannot be reached
inline constexpr int kExitDeadline = 4;     // no answer before the deadline
inline constexpr int kExitRefused = 5;      // the coordinator refused or failed the call
inline constexpr int kExitJobFailed = 6;    // watch: the job ended FAILED or CANCELLED

// The exit code for a failed call: INVALID_ARGUMENT kExitInvalid,
// UNAVAILABLE kExitUnreachable, DEADLINE_EXCEEDED kExitDeadline, anything
// else (NOT_FOUND, RESOURCE_EXHAUSTED, ...) kExitRefused.
int ExitCode(const absl::Status& status);

struct Streams {
  std::ostream& out;
  std::ostream& err;
  // Live progress bars instead of one line per event.
  bool terminal = false;
};

int Submit(CoordinatorClient& client, const std::string& file, const std::string& request_id,
           Streams io);
int Status(CoordinatorClient& client, const std::string& job_id, bool json, Streams io);
int List(CoordinatorClient& client, const std::string& states, const std::string& name,
         bool json, Streams io);
// Follows the job to its end; exits kExitJobFailed when it ends FAILED or
// CANCELLED.
// Follows the job from event `from_index` until it ends, or for `timeout`
// (infinite: to the end); every line is written as its event comes. On a
// timeout (or Ctrl-C, muonmeshctl_main.cc) it says how to go on: the
// `--from` of the next event (WatchResumeHint). With `json`, each event is
// one line of JSON (the JobEvent, its coordinator timestamp `unix_ms`
// included): for scripts that follow a job.
int Watch(CoordinatorClient& client, const std::string& job_id, int64_t from_index,
          absl::Duration timeout, bool json, Streams io);

// The line `watch` adds for a step whose Muon did not do its job (fewer
// elements updated than planned, or an orthogonality error above 1;
// docs/architecture.md, "Muon health"), without a newline; empty for a
// healthy step.
std::string HealthWarning(const v1::StepRecord& r);

// "muonmeshctl watch JOB --from N" for the event after the last one a watch
// printed; what a stopped watch tells its user.
std::string WatchResumeHint(const std::string& job_id, int64_t next_index);

// The event index a running Watch would go on from (for a SIGINT handler:
// lock-free).
int64_t WatchNextIndex();
// format: "table" (default), "json" or "csv"; `summary` adds medians and
// totals after the table.
int Metrics(CoordinatorClient& client, const std::string& job_id, const std::string& format,
            bool summary, bool all_ranks, Streams io);
// Takes a worker out of service; prints it (its job, if it runs a rank,
// checkpoints and moves to other workers).
// A finished job removed; every job finished more than `older_than` ago.
int Delete(CoordinatorClient& client, const std::string& job_id, Streams io);
int Prune(CoordinatorClient& client, absl::Duration older_than, Streams io);
int Drain(CoordinatorClient& client, const std::string& worker_id, const std::string& reason,
          Streams io);
// A new job continuing `job_id` from the newest checkpoint in its output
// folder (ResumeSpecOf), at `world_size` ranks when > 0; prints its id.
int Resume(CoordinatorClient& client, const std::string& job_id, int64_t world_size,
           const std::string& request_id, Streams io);
// `checkpoint`: the ranks checkpoint their current step before they stop.
int Cancel(CoordinatorClient& client, const std::string& job_id, const std::string& reason,
           bool checkpoint, Streams io);
int Workers(CoordinatorClient& client, bool json, Streams io);
// Forgets a LOST worker; every worker listed LOST.
int RemoveWorker(CoordinatorClient& client, const std::string& worker_id, Streams io);
int RemoveLostWorkers(CoordinatorClient& client, Streams io);

}  // namespace muonmesh::client
