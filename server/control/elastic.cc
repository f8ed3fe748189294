#include "server/control/elastic.h"

#include "proto/job/job.h"

namespace muonmesh::coordinator {

bool ElasticWaiting::Ready(absl::Time now, int64_t idle) const {
  return smallest > 0 && now >= since + wait && idle >= smallest;
}

int64_t ElasticState::ShrunkWorld(const v1::Job& job, absl::Time now,
                                  std::optional<absl::Time> fault_at, int64_t idle) {
  if (job.state() != v1::JOB_STATE_RESTARTING || !job.spec().training().has_elastic()) return 0;
  if (!waiting.has_value()) {
    // The wait runs from the fault (or the drain) that ended the last
    // attempt; the sizes are worked out once a wait (a check of the
    // parallelism config per size below the job's).
    waiting.emplace();
    waiting->since = fault_at.value_or(now);
    waiting->wait = job::ElasticWait(job.spec());
    waiting->device = job::DeviceOf(job.spec());
    waiting->sizes = job::ElasticWorldSizes(job.spec());
  }
  waiting->smallest = 0;
  for (int64_t w : waiting->sizes) {
    if (refused.count(w) == 0) waiting->smallest = w;
  }
  if (waiting->smallest == 0) return 0;
  // Stopped to grow: the size it grows to, at once (its workers are idle).
  if (grow > 0) return idle >= grow ? grow : 0;
  if (now < waiting->since + waiting->wait) return 0;
  for (int64_t w : waiting->sizes) {
    if (w <= idle && refused.count(w) == 0) return w;
  }
  return 0;
}

int64_t ElasticState::GrowTarget(const Attempt& a, int64_t can) const {
  if (can >= a.target_world) return a.target_world;
  for (int64_t w : a.elastic_sizes) {  // largest first
    if (refused.count(w) == 0 && w > a.world() && w <= can) return w;
  }
  return 0;
}

}  // namespace muonmesh::coordinator
