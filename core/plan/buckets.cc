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

// Counts with its own overflow checks rather than NumElements (validate.h):
// a job is resolved before the planner has checked its spec's sizes.
bool ModelFitsOneBucket(const ModelSpec& model, int64_t bucket_bytes) {
  if (bucket_bytes <= 0) return false;
  const int64_t limit = bucket_bytes / 4;
  int64_t elements = 0;
  for (const UnitSpec& unit : model.units) {
    for (const ParamSpec& param : unit.params) {
      int64_t n = 1;
      for (int64_t d : param.shape) {
        if (d <= 0) {  // an empty tensor (the planner refuses negative sizes)
          n = 0;
          break;
        }
        if (n > limit / d) return false;
        n *= d;
      }
      if (n > limit - elements) return false;
      elements += n;
    }
  }
  return true;
}

}  // namespace muonmesh::plan
