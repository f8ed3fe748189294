#include "server/control/job_manager.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/plan/planner.h"
#include "core/plan/waves.h"
#include "proto/convert/exec_plan_convert.h"
#include "proto/convert/plan_convert.h"
#include "proto/job/job.h"
#include "proto/job/model_specs.h"
#include "server/control/job_admission.h"
#include "server/control/recovery.h"

namespace muonmesh::coordinator {

JobManager::JobManager(JobStore* store, Fleet* fleet, Rendezvous* rendezvous, Clock* clock,
                       JobManagerOptions options)
    : store_(*store), fleet_(*fleet), rendezvous_(*rendezvous), clock_(*clock),
      options_(std::move(options)), events_(store, clock, options_.log) {}

absl::Status JobManager::state_error() const { return events_.state_error(); }

JobManager::JobRecord& JobManager::Record(const std::string& job_id) { return jobs_[job_id]; }

Attempt* JobManager::Running(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() || !it->second.attempt.has_value() ? nullptr : &*it->second.attempt;
}

void JobManager::Tidy(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  if (it != jobs_.end() && it->second.empty()) jobs_.erase(it);
}

void JobManager::ForgetBetweenAttempts(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  it->second.fault_at.reset();
  it->second.elastic = ElasticState();
  Tidy(job_id);
}

absl::Status JobManager::Responsive(absl::Duration within) {
  const absl::Time until = absl::Now() + within;
  while (true) {
    if (mu_.TryLock()) {
      mu_.Unlock();
      return absl::OkStatus();
    }
    if (absl::Now() >= until) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::UnavailableError(absl::StrCat("the job manager has been busy for ",
                                             absl::FormatDuration(within),
                                             " (a call or a pass stuck?)"));
}

int64_t JobManager::RecordInterval(int64_t total_steps, int64_t max_recorded_steps) {
  if (max_recorded_steps <= 0 || total_steps <= max_recorded_steps) return 1;
  return (total_steps + max_recorded_steps - 1) / max_recorded_steps;
}

bool JobManager::RecordsStep(int64_t step, int64_t total_steps, int64_t max_recorded_steps) {
  const int64_t every = RecordInterval(total_steps, max_recorded_steps);
  return every == 1 || step % every == 0 || step == total_steps - 1;
}

absl::StatusOr<JobStore::Submitted> JobManager::Submit(
    const std::string& request_id, const v1::JobSpec& spec,
    std::vector<plan::FieldViolation>* violations, const std::string& client) {
  MUONMESH_RETURN_IF_ERROR(state_error());
  // A client at its bound is refused before its job is validated (a flood
  // costs a lookup a call); the store decides again as it stores the job.
  MUONMESH_RETURN_IF_ERROR(store_.Admits(request_id, client));
  MUONMESH_RETURN_IF_ERROR(AdmitJob(spec, options_.allowed_dirs, violations));
  absl::StatusOr<JobStore::Submitted> submitted = store_.Submit(
      request_id, spec,
      absl::StrCat("waiting for ", spec.world_size(), " idle ", job::DeviceOf(spec), " workers"),
      events_.NowMs(), client);
  (void)events_.NoteWrite(submitted.status());
  if (submitted.ok() && submitted->created) {
    events_.Notify();
    Schedule();
  }
  return submitted;
}

void JobManager::StartAttempt(const v1::Job& job, const v1::JobSpec& spec,
                              const std::vector<std::string>& gang, const plan::Plan& plan) {
  const int32_t attempt = job.state() == v1::JOB_STATE_RESTARTING ? job.attempt() + 1 : 0;
  if (options_.on_attempt_planned) {
    // What the workers will run: per wave (one unless the job sets
    // optimizer.muon_buffer_bytes), the busiest rank's Newton-Schulz FLOPs.
    options_.on_attempt_planned(
        job.id(), plan::WaveCriticalPathNsFlops(
                      plan, plan::PlanMuonWaves(plan, plan.config.muon_wave_budget_bytes)));
  }
  v1::ExecutionPlan exec = convert::PlanToExec(plan);
  const std::string fingerprint = convert::PlanFingerprint(exec);
  JobRecord& record = Record(job.id());
  const Attempt& a = record.attempt.emplace(Attempt::Begin(attempt, job, gang, fingerprint));
  record.elastic.waiting.reset();
  record.elastic.grow = 0;
  // The spec and the plan once for every rank (a fake worker that never
  // reads its assignments holds a pointer, not a copy of the plan).
  auto shared = std::make_shared<v1::StartRank>();
  *shared->mutable_spec() = spec;
  *shared->mutable_plan() = std::move(exec);
  for (const std::string& w : gang) {
    // Where each rank's worker answers checks (for blame after a failure).
    v1::PeerCheck* peer = shared->add_peers();
    peer->set_worker_id(w);
    if (std::optional<v1::WorkerInfo> info = fleet_.InfoOf(w)) {
      peer->set_address(info->address());
      peer->set_port(info->peer_port());
    }
  }
  for (size_t r = 0; r < gang.size(); ++r) {
    v1::Assignment assignment;
    assignment.set_job_id(job.id());
    assignment.set_attempt(attempt);
    v1::StartRank* start = assignment.mutable_start();
    start->set_rank(static_cast<int32_t>(r));
    start->set_plan_fingerprint(fingerprint);
    start->set_store_prefix(absl::StrCat(job.id(), "/attempt-", attempt));
    start->set_resume(attempt > 0);
    start->set_collective_timeout_ms(absl::ToInt64Milliseconds(options_.collective_timeout));
    fleet_.Push(gang[r], std::move(assignment), shared);
  }
  const int64_t n = a.world();
  const bool grown = job.world_size() > 0 && job.world_size() < n;
  std::string reason = absl::StrCat("running on ", n, " workers");
  if (n < a.target_world) {
    reason = absl::StrCat("running on ", n, " of ", a.target_world, " ranks (training.elastic: ",
                          grown ? absl::StrCat("grown from ", job.world_size(), " ranks")
                                : absl::StrCat("too few idle workers after ",
                                               absl::FormatDuration(job::ElasticWait(job.spec()))),
                          "; the newest checkpoint resharded)");
  } else if (grown) {
    absl::StrAppend(&reason, " (grown back from ", job.world_size(), " ranks)");
  }
  (void)events_.ChangeState(job.id(), v1::JOB_STATE_RUNNING, reason, attempt, [&](v1::Job& j) {
    j.set_world_size(n);
    j.clear_worker_ids();
    for (const std::string& w : gang) j.add_worker_ids(w);
    j.set_plan_fingerprint(fingerprint);
    j.set_attempt_steps_done(0);
    j.clear_finished_ranks();
    j.clear_stopped_ranks();
    j.clear_drain_reason();
    j.set_drain_stop_at_step(0);
  });
}

bool JobManager::BeginDrain(const std::string& job_id, Attempt& a, const std::string& why) {
  const int64_t stop_at = a.DrainStopStep();
  // Kept before any rank is told to stop: a coordinator restarted after
  // some ranks stopped tells the others to stop at the same step.
  if (!events_.NoteWrite(store_.Update(job_id, [&](v1::Job& j) {
         j.set_drain_reason(why);
         j.set_drain_stop_at_step(stop_at);
       })).ok()) {
    return false;
  }
  a.drained = why;
  a.stop_at_step = stop_at;
  return true;
}

void JobManager::Schedule() {
  // One job at a time: its gang is taken under the lock (so no other pass
  // takes those workers), its plan computed without it (planning a large
  // job takes a while, and every other call needs the lock), and the
  // attempt started under it again if the job still waits for it.
  while (state_error().ok()) {  // no new attempt on a state we cannot keep
    std::optional<v1::Job> job;
    std::vector<std::string> gang;
    {
      absl::MutexLock lock(&mu_);
      // Idle workers per device, counted once a pass: a job that needs more
      // is passed by without a look at the fleet (a pass visits every
      // waiting job, and runs at every registration).
      std::map<std::string, int64_t> idle;
      for (const JobStore::Summary& j : store_.UnfinishedSummaries()) {
        if (auto r = jobs_.find(j.id);
            r != jobs_.end() && (r->second.attempt.has_value() || r->second.planning)) {
          continue;
        }
        if (j.state != v1::JOB_STATE_PENDING && j.state != v1::JOB_STATE_RESTARTING) continue;
        const std::string device = j.device.empty() ? "cpu" : j.device;
        auto [count, fresh] = idle.try_emplace(device, 0);
        if (fresh) count->second = fleet_.IdleCount(device);
        std::optional<Taken> taken = TakeGang(j, device, count->second);
        if (!taken.has_value()) continue;
        Record(j.id).planning = true;
        job = std::move(taken->job);
        gang = std::move(taken->gang);
        break;
      }
    }
    if (!job.has_value()) return;
    // What the ranks run: this attempt's world size; training.elastic is
    // the coordinator's (a worker would check it against the smaller size).
    v1::JobSpec spec = job->spec();
    spec.set_world_size(static_cast<int64_t>(gang.size()));
    spec.mutable_training()->clear_elastic();
    absl::StatusOr<plan::PlanInput> input = job::PlanInputOf(spec);
    absl::StatusOr<plan::Plan> plan = !input.ok()     ? absl::StatusOr<plan::Plan>(input.status())
                                      : options_.plan ? options_.plan(*input)
                                                      : plan::ComputePlan(*input);
    absl::MutexLock lock(&mu_);
    Record(job->id()).planning = false;
    const auto give_back = [&] {
      for (const std::string& w : gang) fleet_.Release(w, job->id());
    };
    // Cancelled (or otherwise moved on) while it was planned: the gang goes
    // back.
    absl::StatusOr<v1::Job> now = store_.Get(job->id());
    if (!now.ok() || now->state() != job->state() || now->attempt() != job->attempt()) {
      give_back();
      Tidy(job->id());
      continue;
    }
    if (!plan.ok() && spec.world_size() < job->spec().world_size()) {
      // A size the planner refuses for this model: not tried again.
      give_back();
      Record(job->id()).elastic.refused.insert(spec.world_size());
      continue;
    }
    if (!plan.ok()) {
      give_back();
      ForgetBetweenAttempts(job->id());
      (void)events_.ChangeState(
          job->id(), v1::JOB_STATE_FAILED,
          absl::StrCat("the planner refuses the job: ", plan.status().message()),
          job->state() == v1::JOB_STATE_RESTARTING ? job->attempt() + 1 : 0);
      continue;
    }
    StartAttempt(*now, spec, gang, *plan);
  }
}

std::optional<JobManager::Taken> JobManager::TakeGang(const JobStore::Summary& j,
                                                      const std::string& device, int64_t idle) {
  const bool shrinks = j.elastic && j.state == v1::JOB_STATE_RESTARTING;
  if (idle < j.world_size && !shrinks) return std::nullopt;
  absl::StatusOr<v1::Job> job = store_.Get(j.id);
  if (!job.ok()) return std::nullopt;
  std::optional<std::vector<std::string>> gang;
  if (idle >= j.world_size) gang = fleet_.Take(device, j.world_size, j.id);
  if (!gang.has_value() && shrinks) {
    JobRecord& record = Record(j.id);
    const int64_t w =
        record.elastic.ShrunkWorld(*job, clock_.Now(), record.fault_at, fleet_.IdleCount(device));
    if (w > 0) gang = fleet_.Take(device, w, j.id);
  }
  if (!gang.has_value()) return std::nullopt;
  return Taken{*std::move(job), *std::move(gang)};
}

void JobManager::CheckElastic() {
  bool schedule = false;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_.Now();
    for (auto& [id, record] : jobs_) {
      if (const ElasticWaiting* w = record.elastic.waiting ? &*record.elastic.waiting
                                                                  : nullptr;
          w != nullptr && w->Ready(now, fleet_.IdleCount(w->device))) {
        schedule = true;
      }
      if (!record.attempt.has_value()) continue;
      Attempt& a = *record.attempt;
      const int64_t n = a.world();
      if (n >= a.target_world || a.adopting || a.cancelled || !a.drained.empty()) continue;
      // Not for the last steps: the stop and its checkpoint would cost more.
      if (a.max_continued_step + 2 >= a.total_steps) continue;
      // The largest size the idle workers (with this attempt's) cover.
      const int64_t to = record.elastic.GrowTarget(a, n + fleet_.IdleCount(a.device));
      if (to == 0) continue;
      if (!BeginDrain(id, a,
                      absl::StrCat("training.elastic: growing from ", n, " to ", to,
                                   " ranks (idle workers came)"))) {
        continue;
      }
      if (to < a.target_world) record.elastic.grow = to;
    }
  }
  if (schedule) Schedule();
}

void JobManager::Recover() {
  for (const v1::Job& job : store_.Unfinished()) {
    if (job.state() != v1::JOB_STATE_RUNNING) continue;
    switch (RecoveryOf(job)) {
      case Recovery::kAdopt: {
        absl::MutexLock lock(&mu_);
        Adopt(job);
        break;
      }
      case Recovery::kRestart: {
        {
          absl::MutexLock lock(&mu_);
          Record(job.id()).fault_at = clock_.Now();
        }
        (void)events_.ChangeState(job.id(), v1::JOB_STATE_RESTARTING,
                                  "the coordinator restarted; resuming from the newest checkpoint",
                                  job.attempt());
        break;
      }
      case Recovery::kFail:
        (void)events_.ChangeState(
            job.id(), v1::JOB_STATE_FAILED,
            "the coordinator restarted while the job ran, and no restarts remain", job.attempt());
        break;
    }
  }
  Schedule();
}

void JobManager::Adopt(const v1::Job& job) {
  JobRecord& record = Record(job.id());
  Attempt& a = record.attempt.emplace(
      AdoptAttempt(job, store_, clock_.Now() + options_.adopt_grace,
                   RecordInterval(job.spec().training().steps(), options_.max_recorded_steps)));
  // Steps every rank had reported whose event the restart cut off.
  while (std::optional<std::pair<int64_t, StepAggregate>> done = a.PopFinished()) {
    StepDone(job.id(), a, done->first, done->second);
  }
  // (After the steps the restart cut off: recovery runs to the next one.)
  record.fault_at = clock_.Now();
  (void)events_.ChangeState(
      job.id(), v1::JOB_STATE_RUNNING,
      absl::StrCat("the coordinator restarted; keeping attempt ", a.attempt, " while its ",
                   a.workers.size(), " workers come back (up to ",
                   absl::FormatDuration(options_.adopt_grace), ")"),
      a.attempt);
  // Every rank had ended before the restart: nothing to wait for.
  if (a.Running() == 0) {
    a.adopting = false;
    MaybeFinish(job.id());
  }
}

absl::Status JobManager::Rejoin(const std::string& worker_id, const v1::RunningRank& running) {
  absl::MutexLock lock(&mu_);
  Attempt* a = Running(running.job_id());
  if (a == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", running.job_id().substr(0, 64), " has no running attempt"));
  }
  const int32_t rank = running.rank();
  if (running.attempt() != a->attempt || !a->Runs(rank, worker_id)) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", worker_id, " does not run rank ", rank, " of attempt ", a->attempt,
                     " of job ", running.job_id(), " (it names attempt ", running.attempt(), ")"));
  }
  if (running.plan_fingerprint() != a->plan_fingerprint) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank, " of job ", running.job_id(),
                                                      " runs another plan than attempt ",
                                                      a->attempt, "'s"));
  }
  if (a->outcome[rank] != Attempt::kRunning) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " of job ", running.job_id(), " has already ended"));
  }
  if (a->Rejoin(rank)) {
    (void)events_.ChangeState(running.job_id(), v1::JOB_STATE_RUNNING,
                              absl::StrCat("every worker of attempt ", a->attempt,
                                           " came back; it goes on from where it was"),
                              a->attempt);
  }
  return absl::OkStatus();
}

void JobManager::OnRegisteredWithoutRank(const std::string& worker_id) {
  bool changed = false;
  {
    absl::MutexLock lock(&mu_);
    std::vector<std::string> hit;
    for (auto& [id, record] : jobs_) {
      if (!record.attempt.has_value() || !record.attempt->adopting) continue;
      Attempt& a = *record.attempt;
      for (size_t r = 0; r < a.workers.size(); ++r) {
        if (a.workers[r] == worker_id && !a.rejoined[r] && a.outcome[r] == Attempt::kRunning) {
          FailRank(id, a, static_cast<int32_t>(r),
                   "the worker came back without its rank (its process restarted)");
          hit.push_back(id);
        }
      }
    }
    for (const std::string& id : hit) MaybeFinish(id);
    changed = !hit.empty();
  }
  if (changed) Schedule();
}

void JobManager::CheckAdoptions() {
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_.Now();
    std::vector<std::string> late;
    for (auto& [id, record] : jobs_) {
      if (!record.attempt.has_value()) continue;
      Attempt& a = *record.attempt;
      std::optional<std::vector<int32_t>> missing = a.EndAdoption(now);
      if (!missing.has_value()) continue;
      for (const int32_t r : *missing) {
        if (!a.silent_since.empty() && a.silent_since[r] != absl::InfinitePast()) {
          // A silent worker that did not come back: lost, since it went silent.
          Log(absl::StrCat("job ", id, " attempt ", a.attempt, ": worker ", a.workers[r],
                           " (rank ", r, ") did not come back within ",
                           absl::FormatDuration(options_.partition_grace), "; lost"));
          if (a.FailLost(r, a.silent_since[r])) PushStops(id, a, a.failure);
          continue;
        }
        FailRank(id, a, r,
                 absl::StrCat("the worker did not come back within ",
                              absl::FormatDuration(options_.adopt_grace),
                              " of the coordinator's restart"));
      }
      late.push_back(id);
    }
    if (late.empty()) return;
    for (const std::string& id : late) MaybeFinish(id);
  }
  Schedule();
}

void JobManager::StepDone(const std::string& job_id, Attempt& a, int64_t step,
                          const StepAggregate& agg) {
  if (options_.on_step_done) options_.on_step_done(job_id, agg.slowest);
  JobRecord& record = Record(job_id);
  if (record.fault_at.has_value()) {
    if (options_.on_recovered) {
      options_.on_recovered(job_id, absl::ToDoubleSeconds(clock_.Now() - *record.fault_at));
    }
    record.fault_at.reset();
  }
  // A cancelled job's ranks finish the steps they had begun (the records are
  // kept), but its event log ends with CANCELLED: a watcher has seen the
  // last event, and the job's progress stays as it was when cancelled.
  if (a.cancelled) {
    absl::StatusOr<v1::Job> job = store_.Get(job_id);
    if (job.ok() && IsFinal(job->state())) return;
  }
  v1::JobEvent event;
  *event.mutable_step() = agg.rank0;
  event.mutable_step()->set_step_seconds(agg.slowest);
  const double median = a.Finish(step, agg.slowest);
  const auto progress = [&](v1::Job& job) {
    job.set_steps_done(std::max(job.steps_done(), step + 1));
    job.set_attempt_steps_done(a.steps_done);
    job.set_last_loss(agg.rank0.loss());
    if (agg.rank0.has_val_loss()) {
      job.set_last_val_loss(agg.rank0.val_loss());
      job.set_last_val_step(step);
    }
    job.set_step_seconds(median);
    job.set_eta_seconds(median * static_cast<double>(job.steps_total() - job.steps_done()));
  };
  if (agg.rank0.has_val_loss() || RecordsStep(step, a.total_steps, options_.max_recorded_steps)) {
    (void)events_.Append(job_id, std::move(event), progress);
  } else {
    // A step left out of the event log: the job's progress still moves.
    (void)events_.NoteWrite(store_.Update(job_id, progress));
  }
}

absl::Status JobManager::OnStep(const std::string& worker_id, const std::string& job_id,
                                const v1::StepRecord& record, bool* stop, bool* checkpoint) {
  if (checkpoint != nullptr) *checkpoint = false;
  absl::MutexLock lock(&mu_);
  Attempt* a = Running(job_id);
  if (a == nullptr) {
    *stop = true;
    return absl::AbortedError(absl::StrCat("job ", job_id, " is not running"));
  }
  const int32_t rank = record.rank();
  if (!a->Runs(rank, worker_id) || record.attempt() != a->attempt) {
    return absl::AbortedError(absl::StrCat("worker ", worker_id, " does not run rank ", rank,
                                           " of attempt ", record.attempt(), " of job ", job_id));
  }
  // What a worker reports is kept (the steps table, events, aggregates):
  // only steps of the job, with as many traffic entries as it has
  // collective kinds, not whatever a caller sends.
  constexpr int kMaxTrafficEntries = 64;
  constexpr size_t kMaxTrafficName = 128;
  if (record.step() < 0 || record.step() >= a->total_steps) {
    return absl::InvalidArgumentError(absl::StrCat("record.step: ", record.step(),
                                                   " is not a step of job ", job_id, " [0, ",
                                                   a->total_steps, ")"));
  }
  if (record.bytes_sent_size() > kMaxTrafficEntries) {
    return absl::InvalidArgumentError(absl::StrCat("record.bytes_sent: ", record.bytes_sent_size(),
                                                   " entries, at most ", kMaxTrafficEntries));
  }
  for (const auto& [name, bytes] : record.bytes_sent()) {
    if (name.size() > kMaxTrafficName || bytes < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "record.bytes_sent: names of at most ", kMaxTrafficName, " bytes, counts >= 0"));
    }
  }
  if (record.collective_calls() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("record.collective_calls: ", record.collective_calls(), " is negative"));
  }
  if (record.has_val_loss() ||
      RecordsStep(record.step(), a->total_steps, options_.max_recorded_steps)) {
    MUONMESH_RETURN_IF_ERROR(events_.NoteWrite(store_.PutStep(job_id, record)));
  }
  const Attempt::Answer answer = a->AnswerStep(record.step());
  *stop = answer.stop;
  if (checkpoint != nullptr) *checkpoint = answer.checkpoint;
  // A step already finished, or a rank's record sent again: stored, not
  // counted twice.
  if (std::optional<StepAggregate> done = a->Count(record)) {
    StepDone(job_id, *a, record.step(), *done);
  }
  return absl::OkStatus();
}

void JobManager::FailRank(const std::string& job_id, Attempt& a, int32_t rank,
                          const std::string& why) {
  // The others cannot go on without it: tell them to stop (they end at their
  // next step report, or when a collective with the lost rank times out).
  if (a.Fail(rank, why, clock_.Now())) PushStops(job_id, a, a.failure);
  // A failure beside a silent worker: its peers' collectives broke on it,
  // so it is lost (and named the cause), not waited for.
  for (size_t r = 0; r < a.workers.size(); ++r) {
    const auto silent = static_cast<int32_t>(r);
    if (!a.IsSilent(silent) || a.outcome[r] != Attempt::kRunning) continue;
    Log(absl::StrCat("job ", job_id, " attempt ", a.attempt, ": worker ", a.workers[r], " (rank ",
                     silent, ") silent and its peers failed; lost"));
    a.rejoined[r] = true;
    a.FailLost(silent, a.silent_since[r]);
  }
}

std::string JobManager::BlameFor(const std::string& job_id, const Attempt& done) {
  // The worker the most ranks could not reach; none when two or more tie
  // (two ranks that cannot reach each other: either may be the cut one).
  size_t most = 0;
  std::vector<const std::string*> top;
  for (const auto& [worker, reporters] : done.unreachable_from) {
    if (reporters.size() > most) {
      most = reporters.size();
      top.clear();
    }
    if (reporters.size() == most) top.push_back(&worker);
  }
  if (most == 0) return "";
  if (top.size() > 1) {
    Log(absl::StrCat("job ", job_id, " attempt ", done.attempt, ": ", top.size(),
                     " workers are each unreachable from ", most,
                     " rank(s); none blamed (cannot tell which is cut off)"));
    return "";
  }
  const std::string& worker = *top.front();
  const std::string why =
      absl::StrCat("unreachable from ", most, " of its peers in job ", job_id, " attempt ",
                   done.attempt);
  Log(absl::StrCat("job ", job_id, " attempt ", done.attempt, ": worker ", worker, " blamed (",
                   why, ")"));
  if (fleet_.Blame(worker, why)) {
    Log(absl::StrCat("worker ", worker, " quarantined (no new rank for --quarantine): blamed for "
                     "two failed attempts within an hour (", why, ")"));
  }
  return absl::StrCat("; worker ", worker, " blamed: ", why);
}

void JobManager::MaybeFinish(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end() || !it->second.attempt.has_value()) return;
  JobRecord& record = it->second;
  if (record.attempt->Running() > 0) return;
  const Attempt done = *std::move(record.attempt);
  record.attempt.reset();
  rendezvous_.DropJob(job_id);
  if (options_.on_attempt_done) options_.on_attempt_done(job_id);
  absl::StatusOr<v1::Job> job = store_.Get(job_id);
  if (!job.ok() || IsFinal(job->state())) {  // cancelled: already final
    Tidy(job_id);
    return;
  }
  switch (done.Ended()) {
    case Attempt::Verdict::kSucceeded:
      ForgetBetweenAttempts(job_id);
      (void)events_.ChangeState(job_id, v1::JOB_STATE_SUCCEEDED, "every rank finished",
                                done.attempt);
      return;
    case Attempt::Verdict::kDrained:
      // Every rank stopped at a checkpoint without a failure or a cancel: a
      // drain (its reason kept in the job across a coordinator restart).
      // From that checkpoint on other workers; no restart spent.
      KeepEarliestFault(record, clock_.Now());
      (void)events_.ChangeState(
          job_id, v1::JOB_STATE_RESTARTING,
          absl::StrCat(done.drained.empty() ? std::string("every rank stopped at a checkpoint "
                                                          "(a drain)")
                                            : done.drained,
                       "; going on from its newest checkpoint"),
          done.attempt, [](v1::Job& j) { j.set_drained_attempts(j.drained_attempts() + 1); });
      return;
    case Attempt::Verdict::kFailed:
      break;
  }
  const std::string blame = BlameFor(job_id, done);
  if (!done.job_error && MayRestart(*job, done.attempt)) {
    KeepEarliestFault(record, done.failed_at);
    (void)events_.ChangeState(job_id, v1::JOB_STATE_RESTARTING,
                              absl::StrCat("attempt ", done.attempt, " failed: ", done.failure,
                                           blame, "; restarting from the newest checkpoint"),
                              done.attempt);
    return;
  }
  ForgetBetweenAttempts(job_id);
  (void)events_.ChangeState(
      job_id, v1::JOB_STATE_FAILED,
      done.job_error ? absl::StrCat(done.failure, " (not restarted: no restart can change this)")
                     : done.failure,
      done.attempt);
}

absl::Status JobManager::OnAttemptEnd(const std::string& worker_id,
                                      const v1::ReportAttemptRequest& end) {
  {
    absl::MutexLock lock(&mu_);
    Attempt* a = Running(end.job_id());
    if (a == nullptr || a->attempt != end.attempt()) {
      fleet_.Release(worker_id, end.job_id());
      return absl::OkStatus();  // a late report of a finished attempt
    }
    const int32_t rank = end.rank();
    if (!a->Runs(rank, worker_id)) {
      return absl::FailedPreconditionError(absl::StrCat("worker ", worker_id, " does not run rank ",
                                                        rank, " of job ", end.job_id()));
    }
    fleet_.Release(worker_id, end.job_id());
    switch (end.outcome()) {
      case v1::ATTEMPT_OUTCOME_SUCCEEDED:
        a->outcome[rank] = Attempt::kSucceeded;
        (void)events_.NoteWrite(
            store_.Update(end.job_id(), [&](v1::Job& j) { j.add_finished_ranks(rank); }));
        break;
      case v1::ATTEMPT_OUTCOME_STOPPED:
        a->outcome[rank] = Attempt::kStopped;
        (void)events_.NoteWrite(
            store_.Update(end.job_id(), [&](v1::Job& j) { j.add_stopped_ranks(rank); }));
        break;
      default:
        if (a->cancelled && a->failure.empty()) {
          a->outcome[rank] = Attempt::kStopped;  // failing while cancelled is stopping
        } else {
          for (int i = 0; i < end.peer_checks_size() && i < kMaxPeerChecks; ++i) {
            const v1::PeerCheckResult& c = end.peer_checks(i);
            // A refused connection is a crashed process, not a cut link;
            // only the attempt's other workers count.
            if (!c.reachable() && !c.refused() && c.worker_id() != worker_id &&
                std::find(a->workers.begin(), a->workers.end(), c.worker_id()) !=
                    a->workers.end()) {
              a->unreachable_from[c.worker_id()].insert(rank);
            }
          }
          const bool first = a->failure.empty();
          if (first && end.job_error()) a->job_error = true;
          FailRank(end.job_id(), *a, rank, end.message());
          if (first && end.refused_step() && options_.on_refused_step) {
            options_.on_refused_step(end.job_id());
          }
        }
        break;
    }
    MaybeFinish(end.job_id());
  }
  Schedule();
  return absl::OkStatus();
}

void JobManager::OnWorkersLost(const std::vector<Fleet::Lost>& lost) {
  if (options_.log) {
    for (const Fleet::Lost& l : lost) {
      options_.log(absl::StrCat("worker ", l.worker_id, " lost (no heartbeat within its lease)",
                                l.job_id.empty() ? "" : absl::StrCat("; it ran job ", l.job_id)));
    }
  }
  {
    absl::MutexLock lock(&mu_);
    for (const Fleet::Lost& l : lost) {
      Attempt* a = Running(l.job_id);
      if (a == nullptr) continue;
      for (size_t r = 0; r < a->workers.size(); ++r) {
        if (a->workers[r] != l.worker_id || a->outcome[r] != Attempt::kRunning) continue;
        const auto rank = static_cast<int32_t>(r);
        if (options_.partition_grace > absl::ZeroDuration() && a->failure.empty()) {
          // Silent is not dead: a partition from the coordinator looks the
          // same, and its peers may train on. Wait for it to come back.
          a->Silent(rank, l.last_heard, clock_.Now() + options_.partition_grace);
          Log(absl::StrCat("job ", l.job_id, " attempt ", a->attempt, ": worker ", l.worker_id,
                           " (rank ", rank, ") silent; keeping the attempt up to ",
                           absl::FormatDuration(options_.partition_grace),
                           " for it to come back"));
        } else if (a->FailLost(rank, l.last_heard)) {
          PushStops(l.job_id, *a, a->failure);
        }
      }
      MaybeFinish(l.job_id);
    }
  }
  Schedule();
}

std::vector<v1::PeerCheck> JobManager::PeerChecksFor(const std::string& worker_id) {
  std::vector<v1::PeerCheck> out;
  // Every heartbeat asks: look at the worker's own job only.
  const std::string job_id = fleet_.JobOf(worker_id);
  if (job_id.empty()) return out;
  absl::MutexLock lock(&mu_);
  const Attempt* a = Running(job_id);
  if (a == nullptr || !a->adopting) return out;  // no silent rank without adopting
  const int32_t mine = a->RunningRankOf(worker_id);
  if (mine < 0 || a->IsSilent(mine)) return out;
  for (size_t r = 0; r < a->workers.size(); ++r) {
    if (!a->IsSilent(static_cast<int32_t>(r))) continue;
    std::optional<v1::WorkerInfo> info = fleet_.InfoOf(a->workers[r]);
    if (!info.has_value() || info->peer_port() == 0) continue;
    v1::PeerCheck& c = out.emplace_back();
    c.set_worker_id(a->workers[r]);
    c.set_address(info->address());
    c.set_port(info->peer_port());
  }
  return out;
}

void JobManager::OnPeerChecks(
    const std::string& worker_id,
    const google::protobuf::RepeatedPtrField<v1::PeerCheckResult>& results) {
  std::vector<std::string> hit;
  {
    absl::MutexLock lock(&mu_);
    for (int i = 0; i < results.size() && i < kMaxPeerChecks; ++i) {
      const v1::PeerCheckResult& c = results[i];
      if (c.reachable()) continue;
      for (auto& [id, record] : jobs_) {
        if (!record.attempt.has_value()) continue;
        Attempt& a = *record.attempt;
        const int32_t mine = a.RunningRankOf(worker_id);
        const int32_t theirs = a.RunningRankOf(c.worker_id());
        if (mine < 0 || theirs < 0 || mine == theirs || a.IsSilent(mine)) continue;
        if (a.IsSilent(theirs)) {
          // Silent to the coordinator and unreachable from a peer that is
          // not: its host is gone or cut off, not the coordinator's link.
          Log(absl::StrCat("job ", id, " attempt ", a.attempt, ": worker ", c.worker_id(),
                           " (rank ", theirs, ") silent and unreachable from worker ", worker_id,
                           " (", c.detail().substr(0, 256), "); lost"));
          if (a.FailLost(theirs, a.silent_since[theirs])) PushStops(id, a, a.failure);
          hit.push_back(id);
        } else if (!c.refused() && OnCutOff(id, a, mine, theirs, c.detail())) {
          hit.push_back(id);
        }
      }
    }
    for (const std::string& id : hit) MaybeFinish(id);
  }
  if (!hit.empty()) Schedule();
}

bool JobManager::OnCutOff(const std::string& job_id, Attempt& a, int32_t reporter,
                          int32_t cut, const std::string& detail) {
  // Heard from, yet unreachable from a peer whose steps stalled: counted
  // toward its blame. Most of its peers (two at least: one alone cannot
  // tell which side is cut) is a worker cut off from the others, whose
  // collectives would otherwise wait out their timeout.
  std::set<int32_t>& from = a.unreachable_from[a.workers[cut]];
  if (!from.insert(reporter).second || !a.failure.empty()) return false;
  const auto others = static_cast<size_t>(a.world() - 1);
  if (from.size() < 2 || 2 * from.size() <= others) return false;
  const std::string why = absl::StrCat("cut off from its peers: unreachable from ", from.size(),
                                       " of its ", others, " peers while their steps stalled (",
                                       detail.substr(0, 256), ")");
  Log(absl::StrCat("job ", job_id, " attempt ", a.attempt, ": worker ", a.workers[cut],
                   " (rank ", cut, ") ", why, "; the attempt fails"));
  if (a.FailCutOff(cut, why, clock_.Now())) PushStops(job_id, a, a.failure);
  return true;
}

absl::StatusOr<v1::Worker> JobManager::Drain(const std::string& worker_id,
                                             const std::string& reason) {
  MUONMESH_ASSIGN_OR_RETURN(v1::Worker w, fleet_.Drain(worker_id));
  absl::MutexLock lock(&mu_);
  for (auto& [id, record] : jobs_) {
    if (!record.attempt.has_value() || record.attempt->RunningRankOf(worker_id) < 0) continue;
    Attempt& a = *record.attempt;
    if (a.cancelled || !a.drained.empty()) break;
    if (!BeginDrain(id, a,
                    absl::StrCat("worker ", worker_id, " drained",
                                 reason.empty() ? std::string() : absl::StrCat(": ", reason)))) {
      return state_error();
    }
    break;
  }
  return w;
}

absl::StatusOr<v1::Job> JobManager::Cancel(const std::string& job_id, const std::string& reason,
                                           bool checkpoint) {
  const std::string why = reason.empty() ? "cancelled" : absl::StrCat("cancelled: ", reason);
  {
    absl::MutexLock lock(&mu_);
    MUONMESH_ASSIGN_OR_RETURN(v1::Job job, store_.Get(job_id));
    ForgetBetweenAttempts(job_id);
    Attempt* a = Running(job_id);
    if (job.state() == v1::JOB_STATE_CANCELLED) {
      // Cancelled with a checkpoint whose step has not come: now at once.
      if (a != nullptr && a->cancel_checkpoint && !checkpoint) {
        a->cancel_checkpoint = false;
        PushStops(job_id, *a, why);
      }
      return job;
    }
    if (IsFinal(job.state())) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " has already finished (",
                                                        v1::JobState_Name(job.state()), ")"));
    }
    if (a != nullptr) {
      a->StopAll();
      // With a checkpoint, OnStep tells each rank at its next step.
      a->cancel_checkpoint = checkpoint;
      if (!checkpoint) PushStops(job_id, *a, why);
    }
    MUONMESH_ASSIGN_OR_RETURN(
        v1::JobEvent e,
        events_.ChangeState(job_id, v1::JOB_STATE_CANCELLED,
                            a != nullptr && checkpoint
                                ? absl::StrCat(why, " (the ranks checkpoint step ",
                                               a->stop_at_step + 1, " before they stop)")
                                : why,
                            job.attempt()));
  }
  return store_.Get(job_id);
}

void JobManager::PushStops(const std::string& job_id, const Attempt& a, const std::string& why) {
  for (size_t r = 0; r < a.workers.size(); ++r) {
    if (a.outcome[r] != Attempt::kRunning) continue;
    v1::Assignment stop;
    stop.set_job_id(job_id);
    stop.set_attempt(a.attempt);
    stop.mutable_stop()->set_reason(why);
    fleet_.Push(a.workers[r], std::move(stop));
  }
}

bool JobManager::AttemptRuns(const std::string& job_id, int32_t attempt) {
  absl::MutexLock lock(&mu_);
  const Attempt* a = Running(job_id);
  return a != nullptr && a->attempt == attempt;
}

absl::Status JobManager::Delete(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  MUONMESH_ASSIGN_OR_RETURN(v1::Job job, store_.Get(job_id));
  // A cancelled job's ranks may still be stopping: its attempt goes first.
  if (!IsFinal(job.state()) || Running(job_id) != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " has not finished (",
                                                      v1::JobState_Name(job.state()),
                                                      "); cancel it first"));
  }
  MUONMESH_RETURN_IF_ERROR(events_.NoteWrite(store_.Delete(job_id)));
  ForgetBetweenAttempts(job_id);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> JobManager::Prune(int64_t unix_ms) {
  std::vector<std::string> removed;
  for (const std::string& id : store_.FinishedBefore(unix_ms)) {
    const absl::Status st = Delete(id);
    if (st.code() == absl::StatusCode::kNotFound ||
        st.code() == absl::StatusCode::kFailedPrecondition) {
      continue;  // gone meanwhile, or its attempt still ending
    }
    MUONMESH_RETURN_IF_ERROR(st);
    removed.push_back(id);
  }
  return removed;
}

absl::StatusOr<std::vector<v1::JobEvent>> JobManager::WaitEvents(
    const std::string& job_id, int64_t from_index, absl::Duration wait,
    const std::function<bool()>& cancelled) {
  return events_.Wait(job_id, from_index, wait, cancelled);
}

void JobManager::Shutdown() { events_.Shutdown(); }

}  // namespace muonmesh::coordinator
