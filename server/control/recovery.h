#pragma once

// What a restarted coordinator does with the jobs its previous life left
// RUNNING (docs/architecture.md §7): an attempt whose workers and plan are stored is
// adopted (kept, waiting for its workers to register again naming it), one
// stored without them (an older coordinator's) restarts from its
// checkpoint while restarts remain, and fails otherwise.

#include <cstdint>

#include "absl/time/time.h"
#include "muonmesh/v1/jobs.pb.h"
#include "server/control/attempt.h"
#include "server/state/job_store.h"

namespace muonmesh::coordinator {

enum class Recovery { kAdopt, kRestart, kFail };

// What becomes of RUNNING `job` after a restart.
Recovery RecoveryOf(const v1::Job& job);

// The attempt of RUNNING `job` as a restarted coordinator takes it up: its
// workers, the steps every rank had finished, a drain decided before the
// restart (the ranks that report after it stop at the same step), the ranks
// whose end was reported, and what its ranks had reported of unfinished
// steps (read from `store`: those reports are not sent again). It waits for
// its workers until `adopt_by`. `record_interval`: every how many steps the
// store keeps a record (JobManager::RecordInterval); a rank may have been
// told to go on from any step before the next recorded one.
Attempt AdoptAttempt(const v1::Job& job, JobStore& store, absl::Time adopt_by,
                     int64_t record_interval);

}  // namespace muonmesh::coordinator
