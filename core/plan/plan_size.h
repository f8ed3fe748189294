#pragma once

// The size of a plan before it is computed: how many layout shards, row runs,
// matrices and holder entries it will hold, what the answer lists, and the
// memory the planner needs for it. Counted exactly, by laying out each
// distinct unit once and keeping only the counts, so that a plan too big to
// build is refused (or a server's memory reserved for it) before any of it
// is built. Pure and deterministic, like the planner.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/plan/cancel.h"
#include "core/plan/types.h"

namespace muonmesh::plan {

// Memory one plan may need in the planner, by PlanSize::planner_bytes
// (2 GiB). 40,000 units of ten [64, 64] Muon matrices on 128 ranks need
// about 1.3 GiB by that estimate (0.85 GiB measured); DeepSeek-V3 on 16384
// ranks about 150 MiB; a thousand units of one [2^20, 2^20] matrix on 16384
// ranks (16M holder entries) about 2.2 GiB, refused.
inline constexpr int64_t kMaxPlannerBytes = int64_t{2} << 30;

// Counts are doubles: the listed ones can pass int64 for absurd inputs,
// which are then refused by comparing them with the limits.
struct PlanSize {
  double layout_shards = 0;  // units times the domain size of each mesh they use
  double segments = 0;       // row runs of all units' layouts (kept per unit)
  double matrices = 0;       // matrices planned (once per class of identical domains)
  double holders = 0;        // their holder entries
  double domains = 0;        // domains in the answer (both meshes)
  double listed_matrices = 0;    // matrices in the answer (once per domain)
  double listed_holders = 0;     // their holder entries
  double listed_name_bytes = 0;  // their names
  // The planner's peak memory, an estimate that errs high (measured 1.3x to
  // 1.7x below it): layouts copied per unit, matrices held up to three times
  // while rotation policies compete, ranks and domains, the input's copy.
  double planner_bytes = 0;
};

// The size of the plan of `input`, which must have passed Validate (the
// counts of an invalid input mean nothing). CancelToken::Status() when
// `cancel` (may be null) says stop. Costs one layout of each distinct unit.
absl::StatusOr<PlanSize> EstimatePlanSize(const PlanInput& input, CancelToken* cancel = nullptr);

// The violations of the planner's own size limits (kMaxPlannerBytes), on
// "world_size" as the other size limits: empty when `size` fits.
std::vector<FieldViolation> PlanSizeViolations(const PlanSize& size);

}  // namespace muonmesh::plan
