#include "server/control/job_events.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"

namespace muonmesh::coordinator {
namespace {

// A watcher looks at its job at least this often (a missed wake-up costs
// no more than this).
constexpr auto kEventPoll = std::chrono::milliseconds(50);

}  // namespace

absl::Status JobEvents::NoteWrite(absl::Status s) {
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

absl::Status JobEvents::state_error() const {
  absl::MutexLock lock(&state_mu_);
  return state_error_;
}

void JobEvents::Notify() {
  {
    absl::MutexLock lock(&events_mu_);
  }
  events_cv_.SignalAll();
}

absl::StatusOr<v1::JobEvent> JobEvents::Append(const std::string& job_id, v1::JobEvent event,
                                               const std::function<void(v1::Job&)>& update) {
  absl::StatusOr<v1::JobEvent> e = store_.Append(job_id, std::move(event), NowMs(), update);
  (void)NoteWrite(e.status());
  Notify();
  return e;
}

absl::StatusOr<v1::JobEvent> JobEvents::ChangeState(const std::string& job_id, v1::JobState state,
                                                    const std::string& reason, int32_t attempt,
                                                    const std::function<void(v1::Job&)>& more) {
  v1::JobEvent event;
  v1::StateChange* change = event.mutable_state_change();
  change->set_state(state);
  change->set_reason(reason);
  change->set_attempt(attempt);
  const int64_t now = NowMs();
  absl::StatusOr<v1::JobEvent> e = Append(job_id, std::move(event), [&](v1::Job& job) {
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
  if (e.ok() && on_change_) {
    std::string name = v1::JobState_Name(state);
    if (name.rfind("JOB_STATE_", 0) == 0) name = name.substr(10);
    on_change_(absl::StrCat("job ", job_id, " ", name, " (attempt ", attempt, ")",
                            reason.empty() ? "" : ": ", reason));
  }
  return e;
}

absl::StatusOr<std::vector<v1::JobEvent>> JobEvents::Wait(const std::string& job_id,
                                                          int64_t from_index, absl::Duration wait,
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

void JobEvents::Shutdown() {
  {
    absl::MutexLock lock(&events_mu_);
    shutdown_ = true;
  }
  events_cv_.SignalAll();
}

}  // namespace muonmesh::coordinator
