#include "server/control/recovery.h"

#include <algorithm>
#include <string>
#include <utility>

namespace muonmesh::coordinator {

Recovery RecoveryOf(const v1::Job& job) {
  const int64_t world = job.world_size() > 0 ? job.world_size() : job.spec().world_size();
  if (!job.plan_fingerprint().empty() && job.worker_ids_size() == world) return Recovery::kAdopt;
  return MayRestart(job, job.attempt()) ? Recovery::kRestart : Recovery::kFail;
}

Attempt AdoptAttempt(const v1::Job& job, JobStore& store, absl::Time adopt_by,
                     int64_t record_interval) {
  Attempt a = Attempt::Begin(job.attempt(), job,
                             std::vector<std::string>(job.worker_ids().begin(),
                                                      job.worker_ids().end()),
                             job.plan_fingerprint());
  a.steps_done = job.attempt_steps_done();
  a.max_continued_step = a.steps_done - 1;
  if (!job.drain_reason().empty()) {
    a.drained = job.drain_reason();
    a.stop_at_step = job.drain_stop_at_step();
  }
  a.adopting = true;
  a.adopt_by = adopt_by;
  a.rejoined.assign(a.workers.size(), false);
  // Ranks whose end was reported before the restart: not waited for.
  for (const auto& [ranks, outcome] : {std::pair{&job.finished_ranks(), Attempt::kSucceeded},
                                       std::pair{&job.stopped_ranks(), Attempt::kStopped}}) {
    for (const int32_t r : *ranks) {
      if (r < 0 || r >= a.world()) continue;
      a.outcome[r] = outcome;
      a.rejoined[r] = true;
    }
  }
  std::string token;
  do {
    absl::StatusOr<JobStore::StepPage> page =
        store.Steps(job.id(), a.steps_done, -1, -1, 1000, token);
    if (!page.ok()) break;
    for (const v1::StepRecord& r : page->records) a.Recount(r);
    token = page->next_page_token;
  } while (!token.empty());
  // Reports of steps left out of the records were answered too.
  a.max_continued_step =
      std::min(a.total_steps - 1, a.max_continued_step + record_interval - 1);
  return a;
}

}  // namespace muonmesh::coordinator
