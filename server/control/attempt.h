#pragma once

// One attempt of a job as the coordinator follows it (docs/architecture.md §7): its
// ranks' workers and outcomes, the step reports it counts into one step per
// step, the step every rank stops after (a cancel, a drain, a failure) and,
// after a coordinator restart, which ranks came back. Plain data with the
// rules that change it; no locks and no I/O (JobManager holds it under its
// mutex and writes what it decides).

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "muonmesh/v1/jobs.pb.h"

namespace muonmesh::coordinator {

// The reports of one step so far.
struct StepAggregate {
  std::set<int32_t> ranks;  // that reported the step
  double slowest = 0;       // the slowest rank's seconds
  v1::StepRecord rank0;     // rank 0's record (what the step event carries)
};

struct Attempt {
  enum Outcome { kRunning, kSucceeded, kFailed, kStopped };
  // How an attempt whose ranks have all ended ended.
  enum class Verdict {
    kSucceeded,  // every rank finished
    kDrained,    // every rank stopped at a checkpoint, no failure: goes on elsewhere
    kFailed,     // a rank failed (`failure` says which first)
  };

  int32_t attempt = 0;
  std::vector<std::string> workers;  // by rank
  std::vector<Outcome> outcome;      // by rank
  int64_t total_steps = 0;           // the job's training.steps
  std::map<int64_t, StepAggregate> steps;  // begun, not finished by every rank
  // The newest step some rank was told to go on from.
  int64_t max_continued_step = -1;
  bool cancelled = false;
  int64_t stop_at_step = INT64_MAX;
  std::string failure;  // the first failure (a lost worker's, once one is lost)
  bool failure_names_lost = false;
  // A rank reported the failure as the job's own (job_error): no restart.
  bool job_error = false;
  // Cancelled with a checkpoint: the ranks are told at their next step to
  // write it and stop (Answer), not pushed a stop.
  bool cancel_checkpoint = false;
  absl::Time failed_at;  // when the first failure happened (FailLost) or was detected
  // Per worker, the ranks that reported it unreachable after their
  // collectives failed (ReportAttemptRequest.peer_checks) or while their
  // steps stalled (HeartbeatRequest.peer_checks): whom to blame.
  std::map<std::string, std::set<int32_t>> unreachable_from;
  std::deque<double> recent_seconds;  // the newest steps' slowest seconds
  std::string plan_fingerprint;
  int64_t steps_done = 0;  // one past the newest step every rank finished
  // Adopted after a coordinator restart, or waiting for workers that went
  // silent (a partition: Silent): which ranks' workers came back, and until
  // when the others may.
  bool adopting = false;
  std::vector<bool> rejoined;
  absl::Time adopt_by;
  // Per rank: when its worker was last heard before it went silent;
  // InfinitePast for a rank that did not (or came back).
  std::vector<absl::Time> silent_since;
  // A worker of the attempt is being drained (or the job grows): the ranks
  // stop at stop_at_step with a checkpoint. Why; empty: not draining.
  std::string drained;
  // The job's world size, its device, and with training.elastic the sizes
  // it may run at below it (largest first).
  int64_t target_world = 0;
  std::string device;
  std::vector<int64_t> elastic_sizes;

  // A new attempt of `job` (its spec as submitted) on `workers`, training
  // `total_steps` steps under the plan of `fingerprint`.
  static Attempt Begin(int32_t attempt, const v1::Job& job, std::vector<std::string> workers,
                       std::string fingerprint);

  int64_t world() const { return static_cast<int64_t>(workers.size()); }
  // Whether `worker` runs `rank` of this attempt.
  bool Runs(int32_t rank, const std::string& worker) const;
  // Ranks that have not ended.
  int64_t Running() const;
  // Whether `worker` runs a rank that has not ended; that rank, or -1.
  int32_t RunningRankOf(const std::string& worker) const;

  // What a rank that reported `step` is told: stop after it, and whether
  // with a checkpoint. Remembers a step a rank goes on from.
  struct Answer {
    bool stop = false;
    bool checkpoint = false;
  };
  Answer AnswerStep(int64_t step);

  // Counts `record` (of its rank): the step's aggregate once every rank has
  // reported it (steps below it that a dropped record left open are
  // forgotten with it); nullopt before, and for a step already finished or
  // a record sent again.
  std::optional<StepAggregate> Count(const v1::StepRecord& record);
  // Takes in a stored record of an unfinished step (adoption), as Count
  // would, without finishing anything.
  void Recount(const v1::StepRecord& record);
  // The step at steps_done when every rank has reported it, taken out of
  // `steps`; nullopt otherwise.
  std::optional<std::pair<int64_t, StepAggregate>> PopFinished();
  // Every rank finished `step` in `slowest` seconds: moves steps_done past it
  // and returns the median of the newest steps' seconds.
  double Finish(int64_t step, double slowest);

  // `rank` failed because of `why`, detected at `now`. True when it is the
  // attempt's first failure: `failure` names it, and every other rank is to
  // stop after the first step none has been told to go on past.
  bool Fail(int32_t rank, const std::string& why, absl::Time now);
  // `rank`'s worker was lost (its lease ran out). As Fail, except that a
  // lost worker is the cause whoever reported first: the survivors' broken
  // collectives usually reach the coordinator before the lease runs out, and
  // the failure then names the lost worker, with the first report after it.
  // The fault dates from `last_heard` (the worker's last heartbeat), not from
  // when the lease ran out; failed_at moves back to it.
  bool FailLost(int32_t rank, absl::Time last_heard);
  // `rank`'s worker is cut off from its peers (most of them report it
  // unreachable while it still reaches the coordinator). As Fail, except
  // that its rank is not ended: it is told to stop like every other.
  bool FailCutOff(int32_t rank, const std::string& why, absl::Time now);
  // Every rank stops after the first step none has been told to go on past.
  void StopAll();
  // The step a drain begun now stops after.
  int64_t DrainStopStep() const;

  // A rank of an adopted attempt came back. True when it was the last one
  // missing (the attempt runs as before).
  bool Rejoin(int32_t rank);
  // `rank`'s worker lost its lease (last heard at `last_heard`) while the
  // rank ran: instead of failing, the attempt waits until `until` for it to
  // register again naming the rank (Rejoin), as after a coordinator restart.
  // Its peers train on; a failure they report still fails the attempt.
  void Silent(int32_t rank, absl::Time last_heard, absl::Time until);
  // Whether `rank` is waited for as a silent worker (not yet back).
  bool IsSilent(int32_t rank) const;
  // An adopted attempt past adopt_by at `now` stops waiting: the running
  // ranks whose workers did not come back (to be failed). nullopt while it
  // may still wait, or when it does not.
  std::optional<std::vector<int32_t>> EndAdoption(absl::Time now);

  // How it ended; only when Running() is 0.
  Verdict Ended() const;
};

// Whether a job whose `attempt` failed may be restarted: drains do not spend
// training.max_restarts.
bool MayRestart(const v1::Job& job, int32_t attempt);

}  // namespace muonmesh::coordinator
