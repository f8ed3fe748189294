#include "worker/runtime/groups.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace muonmesh::worker {
namespace {

// Ranks that agree with `rank` on every axis outside `vary` (and on the EP
// group), ordered by (position, coordinates on `vary`).
GroupSpec Members(const plan::MeshGeometry& g, int32_t rank, const std::vector<int>& vary,
                  const std::string& prefix, const std::string& kind) {
  const std::vector<int64_t> mine = g.Coords(rank);
  std::vector<int32_t> members;
  for (int32_t r = 0; r < g.world_size(); ++r) {
    if (g.GroupOf(r) != g.GroupOf(rank)) continue;
    const std::vector<int64_t> c = g.Coords(r);
    bool same = true;
    for (size_t a = 0; a < c.size(); ++a) {
      if (std::find(vary.begin(), vary.end(), static_cast<int>(a)) == vary.end() && c[a] != mine[a]) {
        same = false;
      }
    }
    if (same) members.push_back(r);
  }
  std::stable_sort(members.begin(), members.end(), [&](int32_t a, int32_t b) {
    const int32_t pa = g.PositionOf(a);
    const int32_t pb = g.PositionOf(b);
    if (pa != pb) return pa < pb;
    const std::vector<int64_t> ca = g.Coords(a);
    const std::vector<int64_t> cb = g.Coords(b);
    for (int axis : vary) {
      if (ca[axis] != cb[axis]) return ca[axis] < cb[axis];
    }
    return a < b;
  });
  GroupSpec spec;
  std::vector<std::string> axis_names;
  for (int a : vary) axis_names.push_back(g.axes()[a].name);
  // The smallest member identifies the group among its siblings.
  spec.name = absl::StrCat(prefix, "/", plan::MeshName(g.kind()), "/", kind, "/",
                           axis_names.empty() ? "self" : absl::StrJoin(axis_names, "+"), "/",
                           *std::min_element(members.begin(), members.end()));
  spec.ranks = members;
  spec.rank_in_group =
      static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
  return spec;
}

}  // namespace

MeshGroups GroupsFor(const plan::MeshGeometry& g, int32_t rank, const std::string& prefix) {
  MeshGroups out;
  const std::vector<int>& order = g.shard_order();
  std::vector<int> param_axes;
  std::vector<int> minor_axes;
  for (int a : order) {
    (g.axes()[a].placements.param == plan::Placement::kShard ? param_axes : minor_axes)
        .push_back(a);
  }
  out.domain = Members(g, rank, order, prefix, "domain");
  out.param_gather = Members(g, rank, param_axes, prefix, "param_gather");
  out.param_group = Members(g, rank, minor_axes, prefix, "param_group");
  for (int a : order) {
    out.reduce_scatter.push_back(Members(g, rank, {a}, prefix, "reduce_scatter"));
  }
  for (size_t a = 0; a < g.axes().size(); ++a) {
    const plan::MeshAxis& axis = g.axes()[a];
    if (axis.size > 1 && axis.placements.optimizer != plan::Placement::kShard) {
      out.all_reduce.push_back(Members(g, rank, {static_cast<int>(a)}, prefix, "all_reduce"));
    }
  }
  return out;
}

GroupSpec WorldGroup(int64_t world_size, int32_t rank, const std::string& prefix) {
  GroupSpec spec;
  spec.name = absl::StrCat(prefix, "/world");
  for (int32_t r = 0; r < world_size; ++r) spec.ranks.push_back(r);
  spec.rank_in_group = rank;
  return spec;
}

}  // namespace muonmesh::worker
