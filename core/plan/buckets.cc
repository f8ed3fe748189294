#include "core/plan/buckets.h"

namespace muonmesh::plan {

std::vector<Bucket> PlanBuckets(const Plan& plan, int64_t bucket_bytes) {
  std::vector<Bucket> out;
  const int64_t limit = bucket_bytes > 0 ? bucket_bytes / 4 : 0;
  for (MeshKind mesh : {MeshKind::kDense, MeshKind::kExpert}) {
    Bucket open;
    open.mesh = mesh;
    for (size_t u = 0; u < plan.units.size(); ++u) {
      const UnitPlan& unit = plan.units[u];
      if (!(mesh == MeshKind::kDense ? unit.has_dense : unit.has_expert)) continue;
      const int64_t n = PaddedElements(mesh == MeshKind::kDense ? unit.dense : unit.expert);
      if (!open.units.empty() && open.elements + n > limit) {
        out.push_back(open);
        open.units.clear();
        open.elements = 0;
      }
      open.units.push_back(static_cast<int32_t>(u));
      open.elements += n;
    }
    if (!open.units.empty()) out.push_back(std::move(open));
  }
  return out;
}

}  // namespace muonmesh::plan
