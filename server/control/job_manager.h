#pragma once

// The coordinator's scheduler and the life of every job (docs/architecture.md §2, §7):
// it validates a submitted job (the job file's rules, then the planner's
// against the model) and stores it before answering; starts jobs on gangs of
// idle workers, planning each attempt once and sending every rank the plan;
// folds the ranks' step reports into one step event per step; ends attempts
// (success, failure, cancel, lost workers) and restarts failed ones from
// their newest checkpoint while training.max_restarts allows.
//
// Scheduling: in submission order, every PENDING or RESTARTING job that
// finds world_size idle workers of its device kind starts on the idle
// workers registered first; a job that does not fit waits without blocking
// later, smaller jobs (so a job larger than the fleet waits until workers
// join, and a busy fleet can keep a large job waiting).
//
// Elastic jobs (training.elastic): a RESTARTING job that finds no
// world_size idle workers within its wait starts on the largest allowed
// smaller size the idle workers cover (job::ElasticWorldSizes; the workers
// reshard the newest checkpoint); a running shrunk attempt is stopped at its
// next step with a checkpoint once idle workers allow a larger size
// (CheckElastic), and goes on at it. Neither spends a restart.
//
// Cancel: every rank stops after the same step. The first step whose report
// any rank gets an answer to decides: once cancelled, ranks are told to stop
// after the first step that no rank has yet been told to continue past.
//
// Its parts, each with its own tests: job_admission.h (whether a job is
// taken), attempt.h (an attempt's ranks, step counting and stop rules),
// elastic.h (shrinking and growing), recovery.h (what a restart does with
// running jobs), job_events.h (the event log, watchers, failed writes). The
// manager keeps one record per job and does the I/O their decisions need.
//
// Thread-safe: gRPC handlers call it concurrently; one mutex guards the
// records, the job store has its own. Planning runs outside the mutex (a
// large job's plan takes seconds; every other call needs the mutex).

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/plan/types.h"
#include "muonmesh/v1/fleet.pb.h"
#include "muonmesh/v1/jobs.pb.h"
#include "server/control/attempt.h"
#include "server/control/elastic.h"
#include "server/control/fleet.h"
#include "server/control/job_events.h"
#include "server/control/rendezvous.h"
#include "server/state/job_store.h"

namespace muonmesh::coordinator {

struct JobManagerOptions {
  // Every collective's timeout in the workers (StartRank.collective_timeout_ms).
  absl::Duration collective_timeout = absl::Seconds(60);
  // Called with the slowest rank's seconds whenever every rank finished a
  // step of the job (metrics). May be empty.
  std::function<void(const std::string& job_id, double seconds)> on_step_done;
  // Called once per attempt that fails because its ranks refused a step (a
  // reduced gradient was not finite: ReportAttemptRequest.refused_step).
  // May be empty.
  std::function<void(const std::string& job_id)> on_refused_step;
  // Called when an attempt of a job starts, with its plan's critical path
  // (the busiest rank's Newton-Schulz FLOPs per step: the largest
  // plan.ranks[r].ns_flops), and when that attempt ends (metrics). May be
  // empty.
  std::function<void(const std::string& job_id, double critical_path_flops)> on_attempt_planned;
  std::function<void(const std::string& job_id)> on_attempt_done;
  // Called when every rank of a restarted job finished the first step after
  // a fault, with the seconds since the recovery's first fault (a rank's
  // failure as detected, a lost worker's last heartbeat, or the
  // coordinator's own restart). May be empty.
  std::function<void(const std::string& job_id, double seconds)> on_recovered;
  // After a restart, how long the coordinator waits for the workers of an
  // attempt that was running to come back (register again naming it)
  // before it fails the attempt as if they were lost.
  absl::Duration adopt_grace = absl::Seconds(10);
  // A worker whose lease runs out while its rank runs is waited for this
  // long (its attempt kept, its peers training on) before it counts as lost:
  // a partition from the coordinator costs nothing if it heals within it.
  // Zero: lost at the lease, the attempt failed at once.
  absl::Duration partition_grace = absl::Seconds(30);
  // Resolved folders (job::ResolveAllowedDirs) that every path a job file
  // names must lie in, checked at Submit (PermissionDenied naming the
  // fields; the workers check again, defaults included, with their own
  // --allowed-dirs). Empty: no restriction.
  std::vector<std::string> allowed_dirs;
  // Steps of one job whose step events and records are kept: a job of more
  // steps keeps every k-th (k = ceil(steps / max_recorded_steps)), its last
  // step and every step that carries a validation loss, so its event log and
  // step records stay bounded however long it trains. 0: every step.
  int64_t max_recorded_steps = 1'000'000;
  // How an attempt is planned; empty: plan::ComputePlan (tests replace it).
  std::function<absl::StatusOr<plan::Plan>(const plan::PlanInput&)> plan;
  // A line for the operator's log at every change of a job's state (with
  // its reason: a failed attempt, a restart, a drain) and every lost worker.
  // May be empty.
  std::function<void(const std::string& line)> log;
};

// Most peer checks a heartbeat asks for or reports (the rest are ignored).
inline constexpr int kMaxPeerChecks = 64;

class JobManager {
 public:
  // None of the pointers is owned; all must outlive the manager.
  JobManager(JobStore* store, Fleet* fleet, Rendezvous* rendezvous, Clock* clock,
             JobManagerOptions options);

  // The job, stored, or InvalidArgument with every violation in
  // `violations` (field paths as in the job file). `client` (the caller's
  // address) becomes Job.submitted_by, the key of the store's per-client
  // bound (ResourceExhausted past it).
  absl::StatusOr<JobStore::Submitted> Submit(const std::string& request_id, const v1::JobSpec& spec,
                                             std::vector<plan::FieldViolation>* violations,
                                             const std::string& client = "");

  // Whether the step events and records of `step` are kept for a job of
  // `total_steps` (JobManagerOptions::max_recorded_steps; a step with a
  // validation loss is kept besides).
  static bool RecordsStep(int64_t step, int64_t total_steps, int64_t max_recorded_steps);
  // Every how many steps RecordsStep keeps one (1: every step).
  static int64_t RecordInterval(int64_t total_steps, int64_t max_recorded_steps);

  // See Jobs.CancelJob. `checkpoint`: the running ranks stop after their
  // next step with its checkpoint (as a drain's), instead of at once.
  absl::StatusOr<v1::Job> Cancel(const std::string& job_id, const std::string& reason,
                                 bool checkpoint = false);

  // Whether `attempt` of the job runs now (adopted ones included): the
  // rendezvous scopes the Store serves.
  bool AttemptRuns(const std::string& job_id, int32_t attempt);

  // See Jobs.DeleteJob: a finished job, its events and step records.
  absl::Status Delete(const std::string& job_id);
  // See Jobs.PruneJobs: every job that finished before `unix_ms`; the ids
  // removed, oldest first (the first failing write ends the pass).
  absl::StatusOr<std::vector<std::string>> Prune(int64_t unix_ms);

  // A rank's step record; `*stop` tells the rank to stop now (cancel).
  // Aborted when the worker does not run that rank of the job's current
  // attempt (the rank should stop). A record sent again (a worker re-sends
  // what it buffered while the coordinator was away) is stored once and
  // counted once.
  absl::Status OnStep(const std::string& worker_id, const std::string& job_id,
                      const v1::StepRecord& record, bool* stop, bool* checkpoint = nullptr);

  // Takes a worker out of service (Fleet::Drain): if it runs a rank, every
  // rank of that attempt stops after the same step with a checkpoint of it
  // (`*checkpoint` in OnStep), and the job goes on from it on other workers
  // (RESTARTING, not counted against training.max_restarts). `reason` goes
  // into the job's event log.
  absl::StatusOr<v1::Worker> Drain(const std::string& worker_id, const std::string& reason);

  // The end of a rank's attempt.
  absl::Status OnAttemptEnd(const std::string& worker_id, const v1::ReportAttemptRequest& end);

  // Workers whose lease expired: their ranks failed.
  void OnWorkersLost(const std::vector<Fleet::Lost>& lost);

  // The silent workers (Attempt::Silent) that `worker_id` runs an attempt
  // with, for it to check (HeartbeatResponse.check_peers): a dead host and
  // a coordinator-only partition look alike from here, not from its peers.
  std::vector<v1::PeerCheck> PeerChecksFor(const std::string& worker_id);
  // What `worker_id` found: a silent worker of its attempt that a running
  // peer cannot reach is lost now, not at the end of partition_grace (its
  // fault from when it went silent); one still heard from that most of its
  // peers (two at least) cannot reach while their steps stall is cut off
  // from them: the attempt fails now, not at the collective timeout, and
  // the worker is blamed (OnCutOff).
  void OnPeerChecks(const std::string& worker_id,
                    const google::protobuf::RepeatedPtrField<v1::PeerCheckResult>& results);

  // Starts what can start. Called after every change of jobs or workers.
  void Schedule();

  // Jobs a previous life of the coordinator left running: each attempt is
  // kept (adopted) and waits adopt_grace for its workers to come back
  // (Rejoin); the steps its ranks had reported are taken up from the store.
  // A job stored without its plan's fingerprint (an older coordinator's)
  // restarts from its checkpoint (RESTARTING) when restarts remain, else
  // FAILED.
  void Recover();

  // A worker registering again names the rank it runs: OK when that is a
  // running rank of the job's current attempt with the same plan (the
  // attempt goes on; once every rank of an adopted attempt is back it is
  // running as before); FailedPrecondition saying why otherwise (the worker
  // stops that rank).
  absl::Status Rejoin(const std::string& worker_id, const v1::RunningRank& running);

  // A worker registered naming no rank: an adopted attempt that waits for
  // it loses that rank now (the worker process restarted) rather than at
  // the end of adopt_grace.
  void OnRegisteredWithoutRank(const std::string& worker_id);

  // Adopted attempts whose workers did not all come back within
  // adopt_grace: the missing ranks fail as lost workers do.
  void CheckAdoptions();

  // Elastic jobs, called every tick: grows a shrunk running attempt when
  // idle workers allow a larger size (its ranks stop at the next step with
  // a checkpoint), and schedules when an elastic job's wait has run out.
  void CheckElastic();

  // Events of the job from `from_index` on, waiting up to `wait` for the
  // first one; empty on timeout. NotFound for an unknown job; Cancelled
  // when `cancelled` says so.
  absl::StatusOr<std::vector<v1::JobEvent>> WaitEvents(const std::string& job_id,
                                                       int64_t from_index, absl::Duration wait,
                                                       const std::function<bool()>& cancelled);

  // Wakes every waiter (shutdown).
  void Shutdown();

  // The first state write that failed (a full or read-only disk), if any:
  // from then on the coordinator takes no new job and starts no attempt
  // (Submit answers Unavailable saying why) until it is restarted, rather
  // than run on a state it could not keep. OK while every write succeeded.
  absl::Status state_error() const;

  // /healthz: OK when the manager's lock can be taken within `within`
  // (every call takes it); Unavailable when it is held that long (stuck).
  absl::Status Responsive(absl::Duration within);

 private:
  // Everything the manager keeps of one job between calls (the store holds
  // the rest). A record with nothing in it is dropped.
  struct JobRecord {
    std::optional<Attempt> attempt;  // the running one (adopted ones included)
    bool planning = false;           // its gang taken, its plan being computed (outside mu_)
    // A restarted job whose new attempt has not finished a step yet: when the
    // first fault of this recovery happened (KeepEarliestFault), however many
    // attempts failed since; the first step after it ends the recovery.
    std::optional<absl::Time> fault_at;
    ElasticState elastic;  // training.elastic's bookkeeping
    bool empty() const {
      return !attempt.has_value() && !planning && !fault_at.has_value() && elastic.empty();
    }
  };
  // Sets `record.fault_at` to `at` unless an earlier fault of the same
  // recovery is already there: muonmesh_job_recovery_seconds measures from the
  // first failure to the first step after it, across every attempt between.
  void Log(const std::string& line) const {
    if (options_.log) options_.log(line);
  }
  static void KeepEarliestFault(JobRecord& record, absl::Time at) {
    if (!record.fault_at.has_value() || at < *record.fault_at) record.fault_at = at;
  }
  // A waiting job read whole and the workers taken for its next attempt.
  struct Taken {
    v1::Job job;
    std::vector<std::string> gang;
  };

  // The job's record, made when missing.
  JobRecord& Record(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job's running attempt, or nullptr.
  Attempt* Running(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the job's record if nothing is left in it.
  void Tidy(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets everything but the running attempt (an ended or cancelled job).
  void ForgetBetweenAttempts(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Starts the attempt of `job` on `gang` with `plan`.
  // `spec` is the job's, with world_size the gang's (an elastic job may run
  // shrunk).
  void StartAttempt(const v1::Job& job, const v1::JobSpec& spec,
                    const std::vector<std::string>& gang, const plan::Plan& plan)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The workers for waiting job `j`'s next attempt, taken from the `idle`
  // ones of `device` (all its ranks, or with training.elastic fewer), with
  // the job read whole; nullopt when it cannot start now.
  std::optional<Taken> TakeGang(const JobStore::Summary& j, const std::string& device, int64_t idle)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails `rank`; the first failure tells every other running rank to stop.
  void FailRank(const std::string& job_id, Attempt& a, int32_t rank, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts a drain of the attempt: every rank stops after the step after the
  // newest one any rank was told to go on from, with a checkpoint. Stored
  // first; false (and nothing changed) when that write fails.
  bool BeginDrain(const std::string& job_id, Attempt& a, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes up a RUNNING job's attempt after a restart (Recover).
  void Adopt(const v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the attempt once no rank runs.
  void MaybeFinish(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `reporter` (a rank of `a`) cannot reach `cut`'s worker, which is not
  // silent: counts toward its blame, and fails the attempt once most of
  // its peers report it. True when the attempt failed now.
  bool OnCutOff(const std::string& job_id, Attempt& a, int32_t reporter, int32_t cut,
                const std::string& detail) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A failed attempt's blame (Attempt::unreachable_from): the worker most of
  // its ranks could not reach, blamed in the fleet (twice: quarantined) and
  // logged; "; worker W blamed: ..." for the job's reason, or "" for none.
  std::string BlameFor(const std::string& job_id, const Attempt& done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells every running rank of the attempt to stop now.
  void PushStops(const std::string& job_id, const Attempt& a, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every rank finished `step`: its event, the job's progress, metrics.
  void StepDone(const std::string& job_id, Attempt& a, int64_t step, const StepAggregate& agg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  JobStore& store_;
  Fleet& fleet_;
  Rendezvous& rendezvous_;
  Clock& clock_;
  const JobManagerOptions options_;
  // The event log and the state-write record; its mutexes are leaves.
  JobEvents events_;

  // Lock order (docs/architecture.md §7): mu_ is taken first. With it held,
  // the manager calls into JobStore, Fleet, Rendezvous and JobEvents, whose
  // own mutexes are leaves (they call nothing that locks). Nothing takes
  // mu_ while holding any of them.
  absl::Mutex mu_;
  std::map<std::string, JobRecord> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muonmesh::coordinator
