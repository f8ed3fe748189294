#include "server/control/attempt.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/job/job.h"

namespace muonmesh::coordinator {
namespace {

constexpr size_t kRecentSteps = 16;

}  // namespace

Attempt Attempt::Begin(int32_t attempt, const v1::Job& job, std::vector<std::string> workers,
                       std::string fingerprint) {
  Attempt a;
  a.attempt = attempt;
  a.workers = std::move(workers);
  a.outcome.assign(a.workers.size(), kRunning);
  a.total_steps = job.spec().training().steps();
  a.plan_fingerprint = std::move(fingerprint);
  a.target_world = job.spec().world_size();
  a.device = job::DeviceOf(job.spec());
  a.elastic_sizes = job::ElasticWorldSizes(job.spec());
  return a;
}

bool Attempt::Runs(int32_t rank, const std::string& worker) const {
  return rank >= 0 && rank < static_cast<int32_t>(workers.size()) && workers[rank] == worker;
}

int64_t Attempt::Running() const { return std::count(outcome.begin(), outcome.end(), kRunning); }

int32_t Attempt::RunningRankOf(const std::string& worker) const {
  for (size_t r = 0; r < workers.size(); ++r) {
    if (workers[r] == worker && outcome[r] == kRunning) return static_cast<int32_t>(r);
  }
  return -1;
}

Attempt::Answer Attempt::AnswerStep(int64_t step) {
  const bool draining = !drained.empty() && !cancelled;
  Answer answer;
  answer.stop = (cancelled || draining) && step >= stop_at_step;
  answer.checkpoint = answer.stop && (draining || cancel_checkpoint);
  if (!answer.stop) max_continued_step = std::max(max_continued_step, step);
  return answer;
}

std::optional<StepAggregate> Attempt::Count(const v1::StepRecord& record) {
  if (record.step() < steps_done) return std::nullopt;
  StepAggregate& agg = steps[record.step()];
  if (!agg.ranks.insert(record.rank()).second) return std::nullopt;
  agg.slowest = std::max(agg.slowest, record.step_seconds());
  if (record.rank() == 0) agg.rank0 = record;
  if (static_cast<int64_t>(agg.ranks.size()) != world()) return std::nullopt;
  StepAggregate done = std::move(agg);
  steps.erase(steps.begin(), steps.upper_bound(record.step()));
  return done;
}

void Attempt::Recount(const v1::StepRecord& record) {
  if (record.attempt() != attempt || record.rank() < 0 || record.rank() >= world()) return;
  StepAggregate& agg = steps[record.step()];
  agg.ranks.insert(record.rank());
  agg.slowest = std::max(agg.slowest, record.step_seconds());
  if (record.rank() == 0) agg.rank0 = record;
  max_continued_step = std::max(max_continued_step, record.step());
}

std::optional<std::pair<int64_t, StepAggregate>> Attempt::PopFinished() {
  auto next = steps.find(steps_done);
  if (next == steps.end() || static_cast<int64_t>(next->second.ranks.size()) != world()) {
    return std::nullopt;
  }
  std::pair<int64_t, StepAggregate> done{next->first, std::move(next->second)};
  steps.erase(next);
  return done;
}

double Attempt::Finish(int64_t step, double slowest) {
  recent_seconds.push_back(slowest);
  if (recent_seconds.size() > kRecentSteps) recent_seconds.pop_front();
  std::vector<double> sorted(recent_seconds.begin(), recent_seconds.end());
  std::sort(sorted.begin(), sorted.end());
  steps_done = std::max(steps_done, step + 1);
  return sorted[sorted.size() / 2];
}

namespace {
constexpr const char* kLost = "the worker was lost (no heartbeat)";
}  // namespace

bool Attempt::Fail(int32_t rank, const std::string& why, absl::Time now) {
  outcome[rank] = kFailed;
  if (!failure.empty()) return false;
  // A worker's message is kept as a reason, not as a payload: it is copied
  // into every other rank's stop and into the job's state.
  constexpr size_t kMaxReasonBytes = 4096;
  size_t cut = std::min(why.size(), kMaxReasonBytes);
  // Back to the start of a UTF-8 sequence: proto strings must stay valid.
  while (cut > 0 && cut < why.size() && (static_cast<unsigned char>(why[cut]) & 0xC0) == 0x80) {
    --cut;
  }
  failure = absl::StrCat("rank ", rank, " (worker ", workers[rank], "): ", why.substr(0, cut),
                         cut < why.size() ? " [cut]" : "");
  failure_names_lost = why == kLost;
  failed_at = now;
  StopAll();
  return true;
}

bool Attempt::FailLost(int32_t rank, absl::Time last_heard) {
  if (failure.empty()) return Fail(rank, kLost, last_heard);
  outcome[rank] = kFailed;
  // Its peers' broken collectives were reported first, but the fault came
  // when it went silent.
  failed_at = std::min(failed_at, last_heard);
  if (!failure_names_lost) {
    failure = absl::StrCat("rank ", rank, " (worker ", workers[rank], "): ", kLost,
                           "; first reported by ", failure);
    failure_names_lost = true;
  }
  return false;
}

bool Attempt::FailCutOff(int32_t rank, const std::string& why, absl::Time now) {
  const Outcome was = outcome[rank];
  const bool first = Fail(rank, why, now);
  outcome[rank] = was;
  return first;
}

void Attempt::StopAll() {
  cancelled = true;
  stop_at_step = std::min(stop_at_step, max_continued_step + 1);
}

int64_t Attempt::DrainStopStep() const { return std::min(stop_at_step, max_continued_step + 1); }

bool Attempt::Rejoin(int32_t rank) {
  if (!adopting) return false;
  rejoined[rank] = true;
  if (!silent_since.empty()) silent_since[rank] = absl::InfinitePast();
  if (std::count(rejoined.begin(), rejoined.end(), false) > 0) return false;
  adopting = false;
  return true;
}

void Attempt::Silent(int32_t rank, absl::Time last_heard, absl::Time until) {
  if (silent_since.empty()) silent_since.assign(workers.size(), absl::InfinitePast());
  silent_since[rank] = last_heard;
  if (!adopting) {
    adopting = true;
    rejoined.assign(workers.size(), true);
    adopt_by = until;
  }
  rejoined[rank] = false;
  adopt_by = std::max(adopt_by, until);
}

bool Attempt::IsSilent(int32_t rank) const {
  return adopting && !silent_since.empty() && silent_since[rank] != absl::InfinitePast() &&
         !rejoined[rank];
}

std::optional<std::vector<int32_t>> Attempt::EndAdoption(absl::Time now) {
  if (!adopting || now <= adopt_by) return std::nullopt;
  adopting = false;
  std::vector<int32_t> late;
  for (size_t r = 0; r < workers.size(); ++r) {
    if (!rejoined[r] && outcome[r] == kRunning) late.push_back(static_cast<int32_t>(r));
  }
  return late;
}

Attempt::Verdict Attempt::Ended() const {
  if (!failure.empty()) return Verdict::kFailed;
  const bool all_finished =
      std::all_of(outcome.begin(), outcome.end(), [](Outcome o) { return o == kSucceeded; });
  return all_finished ? Verdict::kSucceeded : Verdict::kDrained;
}

bool MayRestart(const v1::Job& job, int32_t attempt) {
  return attempt - job.drained_attempts() < job.spec().training().max_restarts();
}

}  // namespace muonmesh::coordinator
