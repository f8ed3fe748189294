#pragma once

// What the coordinator keeps of an elastic job (training.elastic,
// docs/architecture.md §7) between and across its attempts, and the two decisions made
// from it: the smaller size a RESTARTING job starts at once its wait has run
// out, and the larger size a shrunk running attempt grows to when idle
// workers come. Plain data and rules; JobManager holds it under its mutex.

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "muonmesh/v1/jobs.pb.h"
#include "server/control/attempt.h"

namespace muonmesh::coordinator {

// A RESTARTING job waiting for workers: since when, how long it waits
// before it shrinks, and what it needs then.
struct ElasticWaiting {
  absl::Time since;
  absl::Duration wait;
  int64_t smallest = 0;  // 0: no size it may shrink to
  std::string device;
  std::vector<int64_t> sizes;  // job::ElasticWorldSizes, largest first
  // Whether its wait is over at `now` and `idle` workers cover its
  // smallest size (a scheduling pass may start it).
  bool Ready(absl::Time now, int64_t idle) const;
};

struct ElasticState {
  std::optional<ElasticWaiting> waiting;
  // Sizes the planner refused for this job's model: not tried again.
  std::set<int64_t> refused;
  // Stopped to grow to this size (below its world_size), which its restart
  // takes at once; 0: none.
  int64_t grow = 0;

  bool empty() const { return !waiting.has_value() && refused.empty() && grow == 0; }

  // The smaller world size `job` (RESTARTING, training.elastic) may start
  // at now with `idle` workers of its device: the one it stopped to grow
  // to, or once its wait (from `fault_at`, else from the first call) is
  // over, the largest allowed size the idle workers cover. 0: none.
  int64_t ShrunkWorld(const v1::Job& job, absl::Time now, std::optional<absl::Time> fault_at,
                      int64_t idle);
  // The size running attempt `a` (shrunk) grows to when its own and the
  // idle workers number `can`: its world_size when they cover it, else the
  // largest allowed size above its own they cover; 0: none.
  int64_t GrowTarget(const Attempt& a, int64_t can) const;
};

}  // namespace muonmesh::coordinator
