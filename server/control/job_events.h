#pragma once

// A job's event log as the coordinator writes and serves it
// (docs/architecture.md §7): every state change and step event goes through Append,
// which stores it and wakes the watchers (WaitEvents); a failed write is
// remembered (state_error) and stops new work until a restart. Thread-safe;
// its two mutexes are leaves (they call nothing that locks), so a caller may
// hold its own while it calls in.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "muonmesh/v1/jobs.pb.h"
#include "server/control/fleet.h"
#include "server/state/job_store.h"

namespace muonmesh::coordinator {

class JobEvents {
 public:
  // Neither pointer is owned; both must outlive this.
  // `on_change`, when given, is called with a line for every state change
  // written ("job j-1 RESTARTING (attempt 2): reason").
  JobEvents(JobStore* store, Clock* clock,
            std::function<void(const std::string& line)> on_change = nullptr)
      : store_(*store), clock_(*clock), on_change_(std::move(on_change)) {}

  // Stores `event` for the job, `update` applied to its row in the same
  // write, and wakes every watcher.
  absl::StatusOr<v1::JobEvent> Append(const std::string& job_id, v1::JobEvent event,
                                      const std::function<void(v1::Job&)>& update);
  // A state change event: the job's state, reason and attempt set with it
  // (its start and finish times as the state says), `more` besides.
  absl::StatusOr<v1::JobEvent> ChangeState(const std::string& job_id, v1::JobState state,
                                           const std::string& reason, int32_t attempt,
                                           const std::function<void(v1::Job&)>& more = nullptr);
  // Wakes every watcher (a job was stored outside Append).
  void Notify();

  // Events of the job from `from_index` on, waiting up to `wait` for the
  // first one; empty on timeout. NotFound for an unknown job; Cancelled
  // when `cancelled` says so or after Shutdown.
  absl::StatusOr<std::vector<v1::JobEvent>> Wait(const std::string& job_id, int64_t from_index,
                                                 absl::Duration wait,
                                                 const std::function<bool()>& cancelled);
  // Wakes every watcher for good.
  void Shutdown();

  // Records `s` when it is a failed state write (a full or read-only disk),
  // not an answer (no such job, bad input, a bound, a folder in use).
  // Returns `s`.
  absl::Status NoteWrite(absl::Status s);
  // The first failed write noted, as Unavailable saying what to do; OK
  // while every write succeeded.
  absl::Status state_error() const;

  int64_t NowMs() { return absl::ToUnixMillis(clock_.Now()); }

 private:
  JobStore& store_;
  Clock& clock_;
  std::function<void(const std::string& line)> on_change_;

  mutable absl::Mutex state_mu_;
  absl::Status state_error_ ABSL_GUARDED_BY(state_mu_);

  // Signalled when a job gains an event.
  absl::Mutex events_mu_;
  absl::CondVar events_cv_;
  bool shutdown_ ABSL_GUARDED_BY(events_mu_) = false;
};

}  // namespace muonmesh::coordinator
