#include "server/control/job_manager.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/plan/plan_size.h"
#include "core/plan/planner.h"
#include "core/plan/validate.h"
#include "core/plan/waves.h"
#include "proto/convert/exec_plan_convert.h"
#include "proto/convert/plan_convert.h"
#include "proto/job/allowed_dirs.h"
#include "proto/job/job.h"
#include "proto/job/model_specs.h"
#include "proto/job/optimizer_rules.h"

namespace muonmesh::coordinator {
namespace {

constexpr size_t kRecentSteps = 16;
constexpr auto kEventPoll = std::chrono::milliseconds(50);

bool IsFinal(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED ||
         s == v1::JOB_STATE_CANCELLED;
}

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

}  // namespace

JobManager::JobManager(JobStore* store, Fleet* fleet, Rendezvous* rendezvous, Clock* clock,
                       JobManagerOptions options)
    : store_(*store), fleet_(*fleet), rendezvous_(*rendezvous), clock_(*clock),
      options_(options) {}

int64_t JobManager::NowMs() { return absl::ToUnixMillis(clock_.Now()); }

absl::Status JobManager::NoteWrite(absl::Status s) {
  // NotFound (no such job), bad input and a bound reached are answers, not
  // a failing disk.
  if (s.ok() || s.code() == absl::StatusCode::kNotFound ||
      s.code() == absl::StatusCode::kInvalidArgument ||
      s.code() == absl::StatusCode::kAlreadyExists ||
      s.code() == absl::StatusCode::kFailedPrecondition ||  // an output folder in use
      s.code() == absl::StatusCode::kResourceExhausted) {
    return s;
  }
  absl::MutexLock lock(&state_mu_);
  if (state_error_.ok()) {
    state_error_ = absl::UnavailableError(
        absl::StrCat("the coordinator could not write its state (", s.message(),
                     "); it takes no new work until it is restarted with a working --data-dir"));
    std::fprintf(stderr, "muonmesh-coordinator: %s\n", state_error_.ToString().c_str());
  }
  return s;
}

absl::Status JobManager::state_error() const {
  absl::MutexLock lock(&state_mu_);
  return state_error_;
}

absl::StatusOr<v1::JobEvent> JobManager::Append(const std::string& job_id, v1::JobEvent event,
                                                const std::function<void(v1::Job&)>& update) {
  absl::StatusOr<v1::JobEvent> e = store_.Append(job_id, std::move(event), NowMs(), update);
  (void)NoteWrite(e.status());
  {
    absl::MutexLock lock(&events_mu_);
  }
  events_cv_.SignalAll();
  return e;
}

absl::StatusOr<v1::JobEvent> JobManager::ChangeState(const std::string& job_id,
                                                     v1::JobState state,
                                                     const std::string& reason, int32_t attempt,
                                                     const std::function<void(v1::Job&)>& more) {
  v1::JobEvent event;
  v1::StateChange* change = event.mutable_state_change();
  change->set_state(state);
  change->set_reason(reason);
  change->set_attempt(attempt);
  const int64_t now = NowMs();
  return Append(job_id, std::move(event), [&](v1::Job& job) {
    job.set_state(state);
    job.set_reason(reason);
    job.set_attempt(attempt);
    if (state == v1::JOB_STATE_RUNNING && job.started_unix_ms() == 0) job.set_started_unix_ms(now);
    if (IsFinal(state)) {
      job.set_finished_unix_ms(now);
      job.set_eta_seconds(0);
    }
    if (more) more(job);
  });
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
  *violations = job::ValidateJob(spec);
  CheckPaths(spec, violations);
  if (violations->empty()) {
    absl::StatusOr<plan::PlanInput> input = job::PlanInputOf(spec);
    if (!input.ok()) {
      violations->push_back({"model", std::string(input.status().message())});
    } else {
      for (plan::FieldViolation& v : plan::Validate(*input)) violations->push_back(std::move(v));
    }
    // The planner's own size limits, as PlanLayout applies them: a job that
    // passes Validate may still need more memory to plan than the
    // coordinator allows (it plans each attempt while scheduling).
    if (violations->empty()) {
      MUONMESH_ASSIGN_OR_RETURN(plan::PlanSize size, plan::EstimatePlanSize(*input));
      for (plan::FieldViolation& v : plan::PlanSizeViolations(size)) {
        violations->push_back(std::move(v));
      }
    }
  }
  if (!violations->empty()) {
    return absl::InvalidArgumentError(absl::StrCat("invalid job (", violations->size(),
                                                   " violation(s))"));
  }
  MUONMESH_RETURN_IF_ERROR(job::CheckJobPathsAllowed(spec, options_.allowed_dirs));
  absl::StatusOr<JobStore::Submitted> submitted = store_.Submit(
      request_id, spec,
      absl::StrCat("waiting for ", spec.world_size(), " idle ", job::DeviceOf(spec), " workers"),
      NowMs(), client);
  (void)NoteWrite(submitted.status());
  if (submitted.ok() && submitted->created) {
    events_cv_.SignalAll();
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
  v1::ExecutionPlan exec = PlanToExec(plan);
  const std::string fingerprint = PlanFingerprint(exec);
  Attempt& a = active_[job.id()];
  a = Attempt();
  a.attempt = attempt;
  a.workers = gang;
  a.outcome.assign(gang.size(), kRunning);
  a.total_steps = spec.training().steps();
  a.plan_fingerprint = fingerprint;
  a.target_world = job.spec().world_size();
  a.device = job::DeviceOf(spec);
  a.elastic_sizes = job::ElasticWorldSizes(job.spec());
  elastic_waiting_.erase(job.id());
  // The spec and the plan once for every rank (a fake worker that never
  // reads its assignments holds a pointer, not a copy of the plan).
  auto shared = std::make_shared<v1::StartRank>();
  *shared->mutable_spec() = spec;
  *shared->mutable_plan() = std::move(exec);
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
  const int64_t n = static_cast<int64_t>(gang.size());
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
  elastic_grow_.erase(job.id());
  (void)ChangeState(job.id(), v1::JOB_STATE_RUNNING, reason, attempt, [&](v1::Job& j) {
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
  const int64_t stop_at = std::min(a.stop_at_step, a.max_continued_step + 1);
  // Kept before any rank is told to stop: a coordinator restarted after
  // some ranks stopped tells the others to stop at the same step.
  if (!NoteWrite(store_.Update(job_id, [&](v1::Job& j) {
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
        if (active_.count(j.id) != 0 || planning_.count(j.id) != 0) continue;
        if (j.state != v1::JOB_STATE_PENDING && j.state != v1::JOB_STATE_RESTARTING) continue;
        const std::string device = j.device.empty() ? "cpu" : j.device;
        auto [count, fresh] = idle.try_emplace(device, 0);
        if (fresh) count->second = fleet_.IdleCount(device);
        std::optional<Taken> taken = TakeGang(j, device, count->second);
        if (!taken.has_value()) continue;
        planning_.insert(j.id);
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
    planning_.erase(job->id());
    // Cancelled (or otherwise moved on) while it was planned: the gang goes
    // back.
    absl::StatusOr<v1::Job> now = store_.Get(job->id());
    if (!now.ok() || now->state() != job->state() || now->attempt() != job->attempt()) {
      for (const std::string& w : gang) fleet_.Release(w, job->id());
      continue;
    }
    if (!plan.ok() && spec.world_size() < job->spec().world_size()) {
      // A size the planner refuses for this model: not tried again.
      for (const std::string& w : gang) fleet_.Release(w, job->id());
      elastic_refused_[job->id()].insert(spec.world_size());
      continue;
    }
    if (!plan.ok()) {
      for (const std::string& w : gang) fleet_.Release(w, job->id());
      ForgetElastic(job->id());
      (void)ChangeState(job->id(), v1::JOB_STATE_FAILED,
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
    if (const int64_t w = ShrunkWorld(*job); w > 0) gang = fleet_.Take(device, w, j.id);
  }
  if (!gang.has_value()) return std::nullopt;
  return Taken{*std::move(job), *std::move(gang)};
}

int64_t JobManager::ShrunkWorld(const v1::Job& job) {
  if (job.state() != v1::JOB_STATE_RESTARTING || !job.spec().training().has_elastic()) return 0;
  const absl::Time now = clock_.Now();
  auto [it, fresh] = elastic_waiting_.try_emplace(job.id());
  ElasticWaiting& waiting = it->second;
  if (fresh) {
    // The wait runs from the fault (or the drain) that ended the last
    // attempt; the sizes are worked out once a wait (a check of the
    // parallelism config per size below the job's).
    auto rec = recovering_.find(job.id());
    waiting.since = rec != recovering_.end() ? rec->second : now;
    waiting.wait = job::ElasticWait(job.spec());
    waiting.device = job::DeviceOf(job.spec());
    waiting.sizes = job::ElasticWorldSizes(job.spec());
  }
  static const std::set<int64_t> kNone;
  auto refused_it = elastic_refused_.find(job.id());
  const std::set<int64_t>& refused =
      refused_it == elastic_refused_.end() ? kNone : refused_it->second;
  waiting.smallest = 0;
  for (int64_t w : waiting.sizes) {
    if (refused.count(w) == 0) waiting.smallest = w;
  }
  if (waiting.smallest == 0) return 0;
  const int64_t idle = fleet_.IdleCount(waiting.device);
  // Stopped to grow: the size it grows to, at once (its workers are idle).
  if (auto grow = elastic_grow_.find(job.id()); grow != elastic_grow_.end()) {
    return idle >= grow->second ? grow->second : 0;
  }
  if (now < waiting.since + waiting.wait) return 0;
  for (int64_t w : waiting.sizes) {
    if (w <= idle && refused.count(w) == 0) return w;
  }
  return 0;
}

void JobManager::ForgetElastic(const std::string& job_id) {
  elastic_waiting_.erase(job_id);
  elastic_refused_.erase(job_id);
  elastic_grow_.erase(job_id);
}

void JobManager::CheckElastic() {
  bool schedule = false;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, a] : active_) {
      const int64_t n = static_cast<int64_t>(a.workers.size());
      if (n >= a.target_world || a.adopting || a.cancelled || !a.drained.empty()) continue;
      // Not for the last steps: the stop and its checkpoint would cost more.
      if (a.max_continued_step + 2 >= a.total_steps) continue;
      // The largest size the idle workers (with this attempt's) cover.
      const int64_t can = n + fleet_.IdleCount(a.device);
      auto refused = elastic_refused_.find(id);
      int64_t to = can >= a.target_world ? a.target_world : 0;
      for (int64_t w : a.elastic_sizes) {
        const bool ok = refused == elastic_refused_.end() || refused->second.count(w) == 0;
        if (to == 0 && ok && w > n && w <= can) to = w;
      }
      if (to == 0) continue;
      if (!BeginDrain(id, a,
                      absl::StrCat("training.elastic: growing from ", n, " to ", to,
                                   " ranks (idle workers came)"))) {
        continue;
      }
      if (to < a.target_world) elastic_grow_[id] = to;
    }
    const absl::Time now = clock_.Now();
    for (const auto& [id, w] : elastic_waiting_) {
      schedule = schedule || (w.smallest > 0 && now >= w.since + w.wait &&
                              fleet_.IdleCount(w.device) >= w.smallest);
    }
  }
  if (schedule) Schedule();
}

void JobManager::Recover() {
  for (const v1::Job& job : store_.Unfinished()) {
    if (job.state() != v1::JOB_STATE_RUNNING) continue;
    const int64_t world = job.world_size() > 0 ? job.world_size() : job.spec().world_size();
    if (!job.plan_fingerprint().empty() && job.worker_ids_size() == world) {
      absl::MutexLock lock(&mu_);
      Adopt(job);
      continue;
    }
    if (job.attempt() - job.drained_attempts() < job.spec().training().max_restarts()) {
      {
        absl::MutexLock lock(&mu_);
        recovering_[job.id()] = clock_.Now();
      }
      (void)ChangeState(job.id(), v1::JOB_STATE_RESTARTING,
                        "the coordinator restarted; resuming from the newest checkpoint",
                        job.attempt());
    } else {
      (void)ChangeState(job.id(), v1::JOB_STATE_FAILED,
                        "the coordinator restarted while the job ran, and no restarts remain",
                        job.attempt());
    }
  }
  Schedule();
}

void JobManager::Adopt(const v1::Job& job) {
  Attempt& a = active_[job.id()];
  a = Attempt();
  a.attempt = job.attempt();
  a.workers.assign(job.worker_ids().begin(), job.worker_ids().end());
  a.outcome.assign(a.workers.size(), kRunning);
  a.total_steps = job.spec().training().steps();
  a.plan_fingerprint = job.plan_fingerprint();
  a.target_world = job.spec().world_size();
  a.device = job::DeviceOf(job.spec());
  a.elastic_sizes = job::ElasticWorldSizes(job.spec());
  a.steps_done = job.attempt_steps_done();
  a.max_continued_step = a.steps_done - 1;
  // A drain decided before the restart: the ranks that report after it
  // stop at the same step as those that stopped before it.
  if (!job.drain_reason().empty()) {
    a.drained = job.drain_reason();
    a.stop_at_step = job.drain_stop_at_step();
  }
  a.adopting = true;
  a.rejoined.assign(a.workers.size(), false);
  // Ranks whose end was reported before the restart: not waited for.
  for (const auto& [ranks, outcome] :
       {std::pair{&job.finished_ranks(), kSucceeded}, std::pair{&job.stopped_ranks(), kStopped}}) {
    for (const int32_t r : *ranks) {
      if (r < 0 || r >= static_cast<int32_t>(a.workers.size())) continue;
      a.outcome[r] = outcome;
      a.rejoined[r] = true;
    }
  }
  a.adopt_by = clock_.Now() + options_.adopt_grace;
  // What the ranks reported before the restart of the steps not finished
  // yet: those reports are not sent again.
  std::string token;
  do {
    absl::StatusOr<JobStore::StepPage> page =
        store_.Steps(job.id(), a.steps_done, -1, -1, 1000, token);
    if (!page.ok()) break;
    for (const v1::StepRecord& r : page->records) {
      if (r.attempt() != a.attempt || r.rank() < 0 ||
          r.rank() >= static_cast<int32_t>(a.workers.size())) {
        continue;
      }
      StepAggregate& agg = a.steps[r.step()];
      agg.ranks.insert(r.rank());
      agg.slowest = std::max(agg.slowest, r.step_seconds());
      if (r.rank() == 0) agg.rank0 = r;
      a.max_continued_step = std::max(a.max_continued_step, r.step());
    }
    token = page->next_page_token;
  } while (!token.empty());
  // Reports of steps left out of the records were answered too: a rank may
  // have been told to go on from any step before the next recorded one.
  a.max_continued_step = std::min(
      a.total_steps - 1,
      a.max_continued_step + RecordInterval(a.total_steps, options_.max_recorded_steps) - 1);
  // Steps every rank had reported whose event the restart cut off.
  while (true) {
    auto next = a.steps.find(a.steps_done);
    if (next == a.steps.end() || next->second.ranks.size() != a.workers.size()) break;
    StepDone(job.id(), a, next->first, next->second);
    a.steps.erase(next);
  }
  // (After the steps the restart cut off: recovery runs to the next one.)
  recovering_[job.id()] = clock_.Now();
  (void)ChangeState(job.id(), v1::JOB_STATE_RUNNING,
                    absl::StrCat("the coordinator restarted; keeping attempt ", a.attempt,
                                 " while its ", a.workers.size(), " workers come back (up to ",
                                 absl::FormatDuration(options_.adopt_grace), ")"),
                    a.attempt);
  // Every rank had ended before the restart: nothing to wait for.
  if (std::count(a.outcome.begin(), a.outcome.end(), kRunning) == 0) {
    a.adopting = false;
    MaybeFinish(job.id());
  }
}

absl::Status JobManager::Rejoin(const std::string& worker_id, const v1::RunningRank& running) {
  absl::MutexLock lock(&mu_);
  auto it = active_.find(running.job_id());
  if (it == active_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", running.job_id().substr(0, 64), " has no running attempt"));
  }
  Attempt& a = it->second;
  const int32_t rank = running.rank();
  if (running.attempt() != a.attempt || rank < 0 ||
      rank >= static_cast<int32_t>(a.workers.size()) || a.workers[rank] != worker_id) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", worker_id, " does not run rank ", rank, " of attempt ", a.attempt,
                     " of job ", running.job_id(), " (it names attempt ", running.attempt(), ")"));
  }
  if (running.plan_fingerprint() != a.plan_fingerprint) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank, " of job ", running.job_id(),
                                                      " runs another plan than attempt ", a.attempt,
                                                      "'s"));
  }
  if (a.outcome[rank] != kRunning) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " of job ", running.job_id(), " has already ended"));
  }
  if (a.adopting) {
    a.rejoined[rank] = true;
    if (std::count(a.rejoined.begin(), a.rejoined.end(), false) == 0) {
      a.adopting = false;
      (void)ChangeState(running.job_id(), v1::JOB_STATE_RUNNING,
                        absl::StrCat("every worker of attempt ", a.attempt,
                                     " came back; it goes on from where it was"),
                        a.attempt);
    }
  }
  return absl::OkStatus();
}

void JobManager::OnRegisteredWithoutRank(const std::string& worker_id) {
  bool changed = false;
  {
    absl::MutexLock lock(&mu_);
    std::vector<std::string> hit;
    for (auto& [id, a] : active_) {
      if (!a.adopting) continue;
      for (size_t r = 0; r < a.workers.size(); ++r) {
        if (a.workers[r] == worker_id && !a.rejoined[r] && a.outcome[r] == kRunning) {
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
    for (auto& [id, a] : active_) {
      if (a.adopting && now > a.adopt_by) late.push_back(id);
    }
    if (late.empty()) return;
    for (const std::string& id : late) {
      Attempt& a = active_[id];
      a.adopting = false;
      for (size_t r = 0; r < a.workers.size(); ++r) {
        if (a.rejoined[r] || a.outcome[r] != kRunning) continue;
        FailRank(id, a, static_cast<int32_t>(r),
                 absl::StrCat("the worker did not come back within ",
                              absl::FormatDuration(options_.adopt_grace),
                              " of the coordinator's restart"));
      }
      MaybeFinish(id);
    }
  }
  Schedule();
}

void JobManager::StepDone(const std::string& job_id, Attempt& a, int64_t step,
                          StepAggregate& agg) {
  if (options_.on_step_done) options_.on_step_done(job_id, agg.slowest);
  if (auto r = recovering_.find(job_id); r != recovering_.end()) {
    if (options_.on_recovered) {
      options_.on_recovered(job_id, absl::ToDoubleSeconds(clock_.Now() - r->second));
    }
    recovering_.erase(r);
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
  a.recent_seconds.push_back(agg.slowest);
  if (a.recent_seconds.size() > kRecentSteps) a.recent_seconds.pop_front();
  std::vector<double> sorted(a.recent_seconds.begin(), a.recent_seconds.end());
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  a.steps_done = std::max(a.steps_done, step + 1);
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
    (void)Append(job_id, std::move(event), progress);
  } else {
    // A step left out of the event log: the job's progress still moves.
    (void)NoteWrite(store_.Update(job_id, progress));
  }
}

absl::Status JobManager::OnStep(const std::string& worker_id, const std::string& job_id,
                                const v1::StepRecord& record, bool* stop, bool* checkpoint) {
  if (checkpoint != nullptr) *checkpoint = false;
  absl::MutexLock lock(&mu_);
  auto it = active_.find(job_id);
  if (it == active_.end()) {
    *stop = true;
    return absl::AbortedError(absl::StrCat("job ", job_id, " is not running"));
  }
  Attempt& a = it->second;
  const int32_t rank = record.rank();
  if (rank < 0 || rank >= static_cast<int32_t>(a.workers.size()) || a.workers[rank] != worker_id ||
      record.attempt() != a.attempt) {
    return absl::AbortedError(absl::StrCat("worker ", worker_id, " does not run rank ", rank,
                                           " of attempt ", record.attempt(), " of job ", job_id));
  }
  // What a worker reports is kept (the steps table, events, aggregates):
  // only steps of the job, with as many traffic entries as it has
  // collective kinds, not whatever a caller sends.
  constexpr int kMaxTrafficEntries = 64;
  constexpr size_t kMaxTrafficName = 128;
  if (record.step() < 0 || record.step() >= a.total_steps) {
    return absl::InvalidArgumentError(absl::StrCat("record.step: ", record.step(),
                                                   " is not a step of job ", job_id, " [0, ",
                                                   a.total_steps, ")"));
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
  if (record.has_val_loss() ||
      RecordsStep(record.step(), a.total_steps, options_.max_recorded_steps)) {
    MUONMESH_RETURN_IF_ERROR(NoteWrite(store_.PutStep(job_id, record)));
  }
  const bool draining = !a.drained.empty() && !a.cancelled;
  *stop = (a.cancelled || draining) && record.step() >= a.stop_at_step;
  if (checkpoint != nullptr) *checkpoint = *stop && (draining || a.cancel_checkpoint);
  if (!*stop) a.max_continued_step = std::max(a.max_continued_step, record.step());
  // A step already finished, or a rank's record sent again: stored, not
  // counted twice.
  if (record.step() < a.steps_done) return absl::OkStatus();
  StepAggregate& agg = a.steps[record.step()];
  if (!agg.ranks.insert(rank).second) return absl::OkStatus();
  agg.slowest = std::max(agg.slowest, record.step_seconds());
  if (rank == 0) agg.rank0 = record;
  if (agg.ranks.size() == a.workers.size()) {
    StepDone(job_id, a, record.step(), agg);
    // With it, any step below it that a dropped record left unfinished.
    a.steps.erase(a.steps.begin(), a.steps.upper_bound(record.step()));
  }
  return absl::OkStatus();
}

void JobManager::FailRank(const std::string& job_id, Attempt& a, int32_t rank,
                          const std::string& why) {
  a.outcome[rank] = kFailed;
  if (!a.failure.empty()) return;
  // A worker's message is kept as a reason, not as a payload: it is copied
  // into every other rank's stop and into the job's state.
  constexpr size_t kMaxReasonBytes = 4096;
  size_t cut = std::min(why.size(), kMaxReasonBytes);
  // Back to the start of a UTF-8 sequence: proto strings must stay valid.
  while (cut > 0 && cut < why.size() && (static_cast<unsigned char>(why[cut]) & 0xC0) == 0x80) {
    --cut;
  }
  a.failure = absl::StrCat("rank ", rank, " (worker ", a.workers[rank], "): ", why.substr(0, cut),
                           cut < why.size() ? " [cut]" : "");
  a.failed_at = clock_.Now();
  // The others cannot go on without it: tell them to stop (they end at their
  // next step report, or when a collective with the lost rank times out).
  PushStops(job_id, a, a.failure);
  a.cancelled = true;
  a.stop_at_step = std::min(a.stop_at_step, a.max_continued_step + 1);
}

void JobManager::MaybeFinish(const std::string& job_id) {
  auto it = active_.find(job_id);
  if (it == active_.end()) return;
  Attempt& a = it->second;
  if (std::count(a.outcome.begin(), a.outcome.end(), kRunning) > 0) return;
  const Attempt done = std::move(a);
  active_.erase(it);
  rendezvous_.DropJob(job_id);
  if (options_.on_attempt_done) options_.on_attempt_done(job_id);
  absl::StatusOr<v1::Job> job = store_.Get(job_id);
  if (!job.ok() || IsFinal(job->state())) return;  // cancelled: already final
  const bool all_finished = std::all_of(done.outcome.begin(), done.outcome.end(),
                                        [](Outcome o) { return o == kSucceeded; });
  if (done.failure.empty() && all_finished) {
    ForgetElastic(job_id);
    (void)ChangeState(job_id, v1::JOB_STATE_SUCCEEDED, "every rank finished", done.attempt);
    return;
  }
  if (done.failure.empty()) {
    // Every rank stopped at a checkpoint without a failure or a cancel: a
    // drain (its reason kept in the job across a coordinator restart).
    // From that checkpoint on other workers; no restart spent.
    recovering_[job_id] = clock_.Now();
    (void)ChangeState(job_id, v1::JOB_STATE_RESTARTING,
                      absl::StrCat(done.drained.empty() ? std::string("every rank stopped at a "
                                                                      "checkpoint (a drain)")
                                                        : done.drained,
                                   "; going on from its newest checkpoint"),
                      done.attempt,
                      [](v1::Job& j) { j.set_drained_attempts(j.drained_attempts() + 1); });
    return;
  }
  if (!done.job_error &&
      done.attempt - job->drained_attempts() < job->spec().training().max_restarts()) {
    recovering_[job_id] = done.failed_at;
    (void)ChangeState(job_id, v1::JOB_STATE_RESTARTING,
                      absl::StrCat("attempt ", done.attempt, " failed: ", done.failure,
                                   "; restarting from the newest checkpoint"),
                      done.attempt);
  } else {
    ForgetElastic(job_id);
    (void)ChangeState(job_id, v1::JOB_STATE_FAILED,
                      done.job_error ? absl::StrCat(done.failure, " (not restarted: no restart "
                                                                  "can change this)")
                                     : done.failure,
                      done.attempt);
  }
}

absl::Status JobManager::OnAttemptEnd(const std::string& worker_id,
                                      const v1::ReportAttemptRequest& end) {
  {
    absl::MutexLock lock(&mu_);
    auto it = active_.find(end.job_id());
    if (it == active_.end() || it->second.attempt != end.attempt()) {
      fleet_.Release(worker_id, end.job_id());
      return absl::OkStatus();  // a late report of a finished attempt
    }
    Attempt& a = it->second;
    const int32_t rank = end.rank();
    if (rank < 0 || rank >= static_cast<int32_t>(a.workers.size()) ||
        a.workers[rank] != worker_id) {
      return absl::FailedPreconditionError(absl::StrCat("worker ", worker_id, " does not run rank ",
                                                        rank, " of job ", end.job_id()));
    }
    fleet_.Release(worker_id, end.job_id());
    switch (end.outcome()) {
      case v1::ATTEMPT_OUTCOME_SUCCEEDED:
        a.outcome[rank] = kSucceeded;
        (void)NoteWrite(
            store_.Update(end.job_id(), [&](v1::Job& j) { j.add_finished_ranks(rank); }));
        break;
      case v1::ATTEMPT_OUTCOME_STOPPED:
        a.outcome[rank] = kStopped;
        (void)NoteWrite(
            store_.Update(end.job_id(), [&](v1::Job& j) { j.add_stopped_ranks(rank); }));
        break;
      default:
        if (a.cancelled && a.failure.empty()) {
          a.outcome[rank] = kStopped;  // failing while cancelled is stopping
        } else {
          const bool first = a.failure.empty();
          if (first && end.job_error()) a.job_error = true;
          FailRank(end.job_id(), a, rank, end.message());
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
  {
    absl::MutexLock lock(&mu_);
    for (const Fleet::Lost& l : lost) {
      auto it = active_.find(l.job_id);
      if (it == active_.end()) continue;
      Attempt& a = it->second;
      for (size_t r = 0; r < a.workers.size(); ++r) {
        if (a.workers[r] == l.worker_id && a.outcome[r] == kRunning) {
          FailRank(l.job_id, a, static_cast<int32_t>(r), "the worker was lost (no heartbeat)");
        }
      }
      MaybeFinish(l.job_id);
    }
  }
  Schedule();
}

absl::StatusOr<v1::Worker> JobManager::Drain(const std::string& worker_id,
                                             const std::string& reason) {
  MUONMESH_ASSIGN_OR_RETURN(v1::Worker w, fleet_.Drain(worker_id));
  absl::MutexLock lock(&mu_);
  for (auto& [id, a] : active_) {
    const auto at = std::find(a.workers.begin(), a.workers.end(), worker_id);
    if (at == a.workers.end() || a.outcome[at - a.workers.begin()] != kRunning) continue;
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
    recovering_.erase(job_id);
    ForgetElastic(job_id);
    auto it = active_.find(job_id);
    Attempt* a = it == active_.end() ? nullptr : &it->second;
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
      a->cancelled = true;
      a->stop_at_step = std::min(a->stop_at_step, a->max_continued_step + 1);
      // With a checkpoint, OnStep tells each rank at its next step.
      a->cancel_checkpoint = checkpoint;
      if (!checkpoint) PushStops(job_id, *a, why);
    }
    MUONMESH_ASSIGN_OR_RETURN(
        v1::JobEvent e,
        ChangeState(job_id, v1::JOB_STATE_CANCELLED,
                    a != nullptr && checkpoint
                        ? absl::StrCat(why, " (the ranks checkpoint step ", a->stop_at_step + 1,
                                       " before they stop)")
                        : why,
                    job.attempt()));
  }
  return store_.Get(job_id);
}

void JobManager::PushStops(const std::string& job_id, const Attempt& a, const std::string& why) {
  for (size_t r = 0; r < a.workers.size(); ++r) {
    if (a.outcome[r] != kRunning) continue;
    v1::Assignment stop;
    stop.set_job_id(job_id);
    stop.set_attempt(a.attempt);
    stop.mutable_stop()->set_reason(why);
    fleet_.Push(a.workers[r], std::move(stop));
  }
}

bool JobManager::AttemptRuns(const std::string& job_id, int32_t attempt) {
  absl::MutexLock lock(&mu_);
  auto it = active_.find(job_id);
  return it != active_.end() && it->second.attempt == attempt;
}

absl::Status JobManager::Delete(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  MUONMESH_ASSIGN_OR_RETURN(v1::Job job, store_.Get(job_id));
  // A cancelled job's ranks may still be stopping: its attempt goes first.
  if (!IsFinal(job.state()) || active_.count(job_id) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " has not finished (",
                                                      v1::JobState_Name(job.state()),
                                                      "); cancel it first"));
  }
  MUONMESH_RETURN_IF_ERROR(NoteWrite(store_.Delete(job_id)));
  recovering_.erase(job_id);
  ForgetElastic(job_id);
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
  const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoMilliseconds(wait);
  while (true) {
    // Every event of every job wakes every watcher: the database is read
    // only when this job has news.
    absl::StatusOr<int64_t> last = store_.LastEventIndex(job_id);
    if (!last.ok()) return last.status();
    if (*last >= from_index) {
      absl::StatusOr<std::vector<v1::JobEvent>> events = store_.Events(job_id, from_index, 1000);
      if (!events.ok() || !events->empty()) return events;
    }
    absl::MutexLock lock(&events_mu_);
    if (shutdown_) return absl::CancelledError("the coordinator is shutting down");
    if (cancelled && cancelled()) return absl::CancelledError("the watch was cancelled");
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return std::vector<v1::JobEvent>();
    events_cv_.WaitWithTimeout(
        &events_mu_, absl::FromChrono(std::min<std::chrono::steady_clock::duration>(
                         deadline - now, kEventPoll)));
  }
}

void JobManager::Shutdown() {
  {
    absl::MutexLock lock(&events_mu_);
    shutdown_ = true;
  }
  events_cv_.SignalAll();
}

}  // namespace muonmesh::coordinator
